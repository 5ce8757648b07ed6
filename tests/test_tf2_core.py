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
