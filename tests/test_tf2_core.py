"""Horovod's TensorFlow 2 core API: custom loops, grouped collectives, accessors, errors."""

import pytest

pytestmark = pytest.mark.mpi


def test_horovods_tf2_custom_loop_trains_and_ends_with_identical_ranks(mpirun):
    # Different initial weights on each rank; rank 0's state is broadcast from inside the
    # tf.function after the first step, as Horovod's TF2 examples do.
    job = mpirun("tf2_loop.py", n=2, args=["plain"])
    for rank in (0, 1):
        out = job.rank(rank)
        assert out["max_rank_difference"] == 0.0
        assert out["last_loss"] < 0.6 * out["first_loss"]
        assert out["iterations"] == 60
        assert (out["rank_op"], out["size_op"]) == (rank, 2)


def test_tf2_core_collectives_tape_and_errors_on_two_ranks(mpirun):
    job = mpirun("tf2_core.py", n=2)
    for rank in (0, 1):
        out = job.rank(rank)
        # (rank + 1) * w on each rank: averaged 1.5, summed 3, eagerly, traced and under XLA.
        assert out["tape_eager"] == out["tape_function"] == out["tape_xla"] == [1.5, 1.5]
        assert out["tape_sum"] == [3.0, 3.0]
        # The shared kernel's gradient is averaged; the local one is this rank's, halved.
        assert out["partial"] == [1.5, (rank + 1) / 2]
        assert out["grouped_allgather"] == [[3, 2], [4, 3]]
        # Sums of 0..7 (times 1 and 2) and of 0..5 (times 1 and 2), split by rank.
        expected = ([[[0.0, 3.0], [6.0, 9.0]], [0, 3, 6]] if rank == 0
                    else [[[12.0, 15.0], [18.0, 21.0]], [9, 12, 15]])
        assert out["grouped_reducescatter"] == expected
        # Integers average as Horovod's do: the sum divided, truncated toward zero.
        assert out["reducescatter_int_average"] == ([4, -4] if rank == 0 else [7, 10])
        assert out["allreduce_int_average"] == out["numpy_int_average"] == [4, -4]
        assert out["grouped_sparse"] == ["IndexedSlices", [[0.5, 0.5], [1.0, 1.0]], [0.5, 0.5]]
        assert out["broadcast_"] == [[1.0, 10.0], [1.0, 10.0]]
        assert out["ops"] == [rank, 2, rank, 2]
        assert out["included"] == [1, rank, -2]
        assert out["mismatch"] == ["FailedPreconditionError", "FailedPreconditionError"]
        assert out["after_mismatch"] == [2.0]
        assert "BroadcastGlobalVariablesCallback(0)" in out["missing_name"]
        assert out["error_kinds"] == ["NotImplementedError"] * 3 + [
            "InvalidArgumentError", "FailedPreconditionError"]
        # 10 * 0.25 truncates to 2 on each rank; (10 + 10) * 0.5 and (7 + 7) * 0.5 per row.
        assert out["int_scaled"] == [[4, -4], [10] if rank == 0 else [7]]
        assert out["fp16"] == ["float16", "float64"]
        assert out["elastic_state"] == [[1.0, 1.0], 20, [1.0, 1.0], 20]


def test_collectives_in_a_tensorflow_1_graph_run_in_the_order_they_were_built(mpirun):
    # Five allreduces of other sizes and an allgather fetched together, ten times: without
    # an order, the ranks would start different collectives and fail.
    job = mpirun("tf1_graph.py", n=2)
    for rank in (0, 1):
        out = job.rank(rank)
        assert out["native"] is True  # the C++ ops loaded although first used in a graph
        assert out["runs"] == [[[3.0]] * 5 + [3, rank, 2]] * 10


def test_separate_allreduces_in_a_function_are_fused_and_reduce_correctly(mpirun):
    job = mpirun("fusion.py", n=2)
    fused = job.rank(0)["fused"]
    # Three runs of 20 separate allreduces: every tensor reduced once, and the float32
    # ones of one reduction travel together (8 tensors in one message), not one by one.
    assert sum(fused) == 60 and max(fused) > 1
    assert job.rank(0)["unfused"] == []  # KDIST_FUSION=0 when the function was traced
    for rank in (0, 1):
        out = job.rank(rank)
        expected_sums = [[3.0 * (i + 1)] * 2 for i in range(8)] + [[3, 30], [1.5]]
        assert out["sums"] == out["unfused_sums"] == expected_sums
        # Floats average; integers average as Horovod's do, truncated: (1 + 2) // 2 = 1.
        assert out["averages"] == [[1.5 * (i + 1)] * 2 for i in range(8)] + [[1, 15], [0.75]]
        # average, allgather between, a reduction of a reduction, scaling, Min, Max, and
        # a constant input.
        assert out["mixed"] == [[1.5], [1.0, 2.0], [6.0], [3.0], [1.0], [2.0], [5.5]]
        # [2, 3] against [3, 2]: the same count in other shapes fails on both ranks, and
        # the ranks go on together.
        assert out["mismatch"] == ["FailedPreconditionError", True]
        assert out["after_mismatch"] == [3.0, 3.0]
        # Eagerly too, where the header carries a key of the shapes; the report shows them.
        assert out["eager_mismatch"] == [["FailedPreconditionError", True],
                                         ["CollectiveMismatch", True]]
        assert out["looped"] == [8.0]
        # Sum of 1 and 2; the allgather in the branch on the first two steps (the
        # rank's own value twice after); rank 0's 2x; the sum of 3 and 6.
        for step, got in enumerate(out["nested"]):
            branch = [1.0, 2.0] if step < 2 else [1.0 + rank] * 2
            assert got == [[3.0], branch, [2.0], [9.0]], step
        assert out["last_joined"] == 0
    # Rank 1 ran out of data after two steps and joined: rank 0 averaged its own alone.
    assert job.rank(0)["uneven"] == [[1.5, 15.0]] * 2 + [[1.0, 10.0]] * 2
    assert job.rank(1)["uneven"] == [[1.5, 15.0]] * 2


def test_allreduces_no_other_rank_runs_fail_on_each_rank_after_the_deadlock_timeout(mpirun):
    job = mpirun("fusion.py", n=2, args=["stalled"], env={"KDIST_DEADLOCK_TIMEOUT": "4"})
    for rank in (0, 1):
        assert job.rank(rank)["before"] == 2.0
        # The world's queue ended with it (MPI may give the next world the same handle).
        assert job.rank(rank)["queues"] == [1, 0]
        kind, message = job.rank(rank)["error"]
        assert kind == "FailedPreconditionError"
        assert f"only_on_rank_{rank}/" in message and "KDIST_DEADLOCK_TIMEOUT" in message
        assert f"rank {1 - rank} waits for 1 allreduce(s) of its own" in message
