"""The communication layer on one process and on real MPI jobs."""

import numpy as np
import pytest
import tensorflow as tf

import kdist
from kdist.comm import compression, fusion, processes


def test_a_plain_python_process_is_a_world_of_one():
    kdist.init()
    kdist.init()
    assert (kdist.rank(), kdist.size(), kdist.local_rank(), kdist.local_size()) == (0, 1, 0, 1)
    assert kdist.allreduce(np.array([3.0])).tolist() == [3.0]
    assert kdist.allgather(np.ones((2, 2))).shape == (2, 2)
    assert kdist.broadcast(tf.constant([1.0, 2.0])).numpy().tolist() == [1.0, 2.0]
    assert kdist.join() == 0


def test_launcher_detection_reads_the_environment():
    assert not processes.launched_by_mpi({})
    assert processes.launched_by_mpi({"OMPI_COMM_WORLD_SIZE": "2"})
    assert processes.launched_by_mpi({"PMI_RANK": "0"})
    assert processes.launched_by_mpi({"SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "4"})
    assert not processes.launched_by_mpi({"SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "1"})
    assert processes.launched_by_mpi({"KDIST_FORCE_MPI": "1"})


def test_bad_arguments_raise_clear_errors():
    with pytest.raises(ValueError, match="either `average` or `op`"):
        kdist.allreduce(np.ones(2), average=True, op=kdist.Sum)
    with pytest.raises(ValueError, match="Unknown reduction op"):
        kdist.allreduce(np.ones(2), op="median")
    with pytest.raises(ValueError, match="root_rank=3"):
        kdist.broadcast(np.ones(2), root_rank=3)
    with pytest.raises(TypeError, match="floating"):
        kdist.allreduce(tf.constant([1, 2]))
    with pytest.raises(TypeError, match="floating"):
        kdist.allreduce(np.array([1, 2]))
    with pytest.raises(ValueError, match="already initialised"):
        kdist.init(comm=[0])
    with pytest.raises(ValueError, match="scalar"):
        kdist.allgather(np.float32(1.0))
    with pytest.raises(ValueError, match="ratio"):
        kdist.Compression.topk(0.0)
    with pytest.raises(ValueError, match="Unknown compression"):
        compression.get("zip")


def test_buckets_respect_the_byte_limit_and_keep_order():
    assert fusion.plan_buckets([10, 10, 10], bucket_bytes=80) == [(0, 2), (2, 3)]
    assert fusion.plan_buckets([100, 1, 1], bucket_bytes=40) == [(0, 1), (1, 3)]
    assert fusion.plan_buckets([5] * 4, bucket_bytes=10**6) == [(0, 4)]
    with pytest.raises(ValueError):
        fusion.plan_buckets([1], bucket_bytes=0)


def test_fused_reducer_packs_and_unpacks_in_order():
    reducer = fusion.FusedReducer()
    arrays = [np.arange(6, dtype=np.float64).reshape(2, 3), np.array([7.0], np.float16)]
    first = reducer.reduce(0, arrays)
    assert [a.shape for a in first] == [(2, 3), (1,)]
    assert first[0].tolist() == [[0, 1, 2], [3, 4, 5]] and first[1].tolist() == [7.0]
    # A result still in use is never overwritten by the next reduction.
    second = reducer.reduce(0, [a * 2 for a in arrays])
    assert first[1].tolist() == [7.0] and second[1].tolist() == [14.0]
    del first, second
    third = reducer.reduce(0, arrays)
    assert third[0].ctypes.data % 64 == 0, "results are aligned so TensorFlow need not copy"


class _FakeComm:
    """Two ranks in one process: what a sum over them would give."""

    size, rank = 2, 0

    def __init__(self, other):
        self.other = other

    def allgather_rows(self, message):
        return np.concatenate([message, self.other])


def test_topk_sends_the_largest_entries_and_keeps_the_rest_for_later():
    topk = compression.TopKCompressor(ratio=0.5)
    peer = np.array([[3, np.float32(0.0).view(np.int32)], [4, np.float32(1.0).view(np.int32)]],
                    dtype=np.int32)  # the other rank sends nothing but its count
    send = np.array([0.1, -5.0, 0.2, 3.0, 1.0], dtype=np.float32)  # last entry: count
    recv = np.empty_like(send)
    topk.sum_(_FakeComm(peer), send, recv, key="k")
    assert recv.tolist() == [0.0, -5.0, 0.0, 3.0, 2.0]
    assert np.allclose(topk.residual("k"), [0.1, 0.0, 0.2, 0.0])
    # Next step: the residual is added before choosing, so small entries get their turn.
    send = np.array([0.0, 0.0, 0.0, 0.0, 1.0], dtype=np.float32)
    topk.sum_(_FakeComm(peer), send, recv, key="k")
    assert np.allclose(recv[:4], [0.1, 0.0, 0.2, 0.0])
    assert np.allclose(topk.residual("k"), 0.0)


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 3])
def test_collectives_on_real_ranks(mpirun, n):
    job = mpirun("collectives.py", n=n)
    ranks = range(n)
    values = [np.array([r + 1.0, 10.0 * (r + 1)]) for r in ranks]
    for r in ranks:
        got = job.rank(r)
        assert got["size"] == n and got["rank"] == r
        assert got["local_size"] == n and got["local_rank"] == r  # one node here
        assert got["cross_size"] == 1
        assert np.allclose(got["np_average"], np.mean(values, axis=0))
        assert np.allclose(got["np_sum"], np.sum(values, axis=0))
        assert np.allclose(got["np_sum_via_average_false"], np.sum(values, axis=0))
        assert np.allclose(got["np_min"], np.min(values, axis=0))
        assert np.allclose(got["np_max"], np.max(values, axis=0))
        assert np.allclose(got["np_product"], np.prod(values, axis=0))
        assert got["int_sum"] == [sum(ranks), n]
        assert np.allclose(got["tf_eager_average"], np.mean(values, axis=0))
        assert np.allclose(got["tf_graph_sum"], np.sum(values, axis=0))
        assert np.allclose(got["tf_graph_broadcast"], values[n - 1])
        assert len(got["tf_graph_allgather"]) == sum(min(r2 + 1, 2) for r2 in ranks)
        assert got["np_broadcast"] == [1.0, 1.0, 1.0]
        assert got["np_allgather_uneven"] == [[r2, r2] for r2 in ranks for _ in range(r2 + 1)]
        assert got["object_allgather"] == [{"rank": r2} for r2 in ranks]
        assert got["object_broadcast"] == "from 0"
        assert got["sub_size"] == len([r2 for r2 in ranks if r2 % 2 == r % 2])
        assert got["sub_sum"] == [float(sum(r2 for r2 in ranks if r2 % 2 == r % 2))]
        assert got["variable_after_broadcast"] == [[0.0] * 3] * 2
        assert "only the first dimension may differ" in got["allgather_error"]
        assert got["last_joined"] in ranks


def test_srun_with_a_mismatched_pmi_plugin_is_refused():
    srun = {"SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "4"}
    with pytest.raises(RuntimeError, match="--mpi=pmix"):
        processes._check_not_a_lonely_task(1, srun)
    processes._check_not_a_lonely_task(4, srun)
    processes._check_not_a_lonely_task(1, {"SLURM_STEP_NUM_TASKS": "4"})  # salloc shell


def test_threads_per_rank_follow_binding_or_sharing():
    from kdist.comm.devices import intra_op_threads

    assert intra_op_threads([[0, 1], [2, 3]], environ={}) == 2  # bound: own cores each
    assert intra_op_threads([[0], [1, 2, 3]], environ={}, local_rank=1) == 3
    assert intra_op_threads([[0], [1]], environ={"OMP_NUM_THREADS": ""}) == 1
    assert intra_op_threads([[0], [1], [2], [3]], environ={}) == 1
    assert intra_op_threads([list(range(8))] * 4, environ={}) == 2  # shared: split evenly
    assert intra_op_threads([list(range(8))] * 4, environ={"OMP_NUM_THREADS": "3"}) == 3


def test_without_a_compiler_the_native_op_steps_aside(monkeypatch, caplog):
    from kdist.comm import native

    monkeypatch.setattr(native, "_loaded", None)
    monkeypatch.setattr(native, "_failure", None)
    monkeypatch.setattr(native, "_mpicxx", lambda: None)
    assert native.load() is None
    assert "mpicxx" in native.failure()
    monkeypatch.setattr(native, "_failure", None)
    monkeypatch.setenv("KDIST_NATIVE_OPS", "0")
    assert native.load() is None and "KDIST_NATIVE_OPS" in native.failure()
