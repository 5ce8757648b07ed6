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
    # Integers average and scale as in Horovod: in float64, truncated toward zero.
    assert kdist.allreduce(tf.constant([1, -2])).numpy().tolist() == [1, -2]
    assert kdist.allreduce(np.array([1, -2])).dtype == np.array([1]).dtype
    assert kdist.allreduce(tf.constant([10, -10]), prescale_factor=0.25).numpy().tolist() == \
        [2, -2]
    assert kdist.allreduce(np.array([10, -10]), postscale_factor=0.25).tolist() == [2, -2]
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


def test_between_hosts_the_default_bucket_is_a_quarter_of_the_gradient(monkeypatch):
    import tensorflow as tf

    from kdist.comm import tensors

    grads = [tf.zeros((1024, 1024)), tf.zeros((1024,)), tf.zeros((1024, 1024)),
             tf.zeros((1024, 1024)), tf.zeros((1024, 1024)), tf.zeros((10,))]
    dense = dict(enumerate(grads))

    def buckets(spans_hosts, **kwargs):
        monkeypatch.setattr(tensors, "_job_spans_hosts", lambda: spans_hosts)
        return tensors.TensorReducer(**kwargs)._plan(list(dense), dense)

    # 16 MiB of gradient: one bucket on one host; between hosts at least four, in
    # backpropagation order, every tensor in exactly one.
    assert len(buckets(False)) == 1
    split = buckets(True)
    assert len(split) >= 4 and split[0][0] == 5
    assert sorted(i for bucket in split for i in bucket) == list(range(6))
    # A size given is a size kept.
    assert len(buckets(True, bucket_bytes=64 * 2**20)) == 1
    assert fusion.auto_bucket_bytes(100, spans_hosts=True) == fusion.HOSTS_MIN_BUCKET_BYTES


class _TwoRanks:
    """Two ranks in one process for top-k: the other rank sends `other` rows."""

    size, rank = 2, 0

    def __init__(self, other):
        self.other = other


def test_topk_sends_the_largest_entries_and_keeps_the_rest_for_later(monkeypatch):
    from kdist.comm import graph_ops

    sent = []

    def gather(message, comm, label=""):
        sent.append(message.numpy())
        return tf.concat([message, comm.other], 0)

    monkeypatch.setattr(graph_ops, "allgather", gather)
    topk = compression.TopKCompressor(ratio=0.5)
    # The other rank sends one entry (index 1, value 1.0) and its count row.
    other = tf.constant([[1, np.float32(1.0).view(np.int32)],
                         [4, np.float32(1.0).view(np.int32)]], tf.int32)
    grads = [tf.constant([0.1, -5.0]), tf.constant([[0.2, 3.0]])]
    summed = topk.reduce(grads, _TwoRanks(other), average=False, key="k")
    assert sent[0].shape == (3, 2), "k = 2 of 4 entries, plus the count row"
    assert summed[0].numpy().tolist() == [0.0, -4.0] and summed[1].shape == (1, 2)
    assert np.allclose(summed[1].numpy(), [[0.0, 3.0]])
    assert np.allclose(topk.residual("k").numpy(), [0.1, 0.0, 0.2, 0.0])
    # Next step: the residual is added before choosing, so small entries get their turn.
    averaged = topk.reduce([tf.zeros(2), tf.zeros((1, 2))], _TwoRanks(other), average=True,
                           key="k")
    assert np.allclose(averaged[0].numpy(), [0.05, 0.5]) and np.allclose(averaged[1].numpy(),
                                                                         [[0.1, 0.0]])
    assert np.allclose(topk.residual("k").numpy(), 0.0)


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
        assert "not running the same collective" in got["allgather_error"]
        for r2 in ranks:
            assert f"rank {r2}: allgather of rows of {r2 + 1} float64 values" in \
                got["allgather_error"]
        for r2 in ranks:  # every rank names every rank's shapes
            assert f"rank {r2}: allreduce (sum) of {3 + r2 + 1} float32 values" in \
                got["allreduce_error"]
        assert np.allclose(got["prescaled"], np.sum(values, axis=0))
        # Large tensors: average, max, average with pre/post-scale, float16, float64.
        assert max(got["large_errors"][:3] + got["large_errors"][4:]) < 1e-5
        assert got["large_errors"][3] < 5e-3  # float16
        assert got["grouped"] == [[float(sum(ranks))], [[1.0 * n, 2.0 * n]], [sum(ranks)]]
        rows = 2 * n + 1
        reduced = np.arange(rows) * sum(r2 + 1 for r2 in ranks)
        start = sum(rows // n + (k < rows % n) for k in range(r))
        stop = start + rows // n + (r < rows % n)
        assert got["reducescatter"] == reduced[start:stop].tolist()
        if r == 0:
            assert got["alltoall_counts"] == [k + 1 for k in ranks]
            assert got["alltoall"] == [k for k in ranks for _ in range(k + 1)]
        else:
            assert got["alltoall_counts"] == [1] * n and got["alltoall"] == list(ranks)
        x = np.array([1.0 + r, 2.0])
        assert np.allclose(got["grad_allreduce"], 2 * x * n), "d/dx sum_r x_r^2 summed over ranks"
        assert np.allclose(got["grad_allgather"], np.mean([k + 1.0 for k in ranks])), \
            "allgather's gradient: the average over ranks of the upstream gradient"
        assert np.allclose(got["grad_broadcast"], 3.0 if r == 0 else 0.0)
        evens = [k for k in ranks if k % 2 == 0]
        assert got["process_set"] == [len(evens), evens.index(r) if r in evens else None,
                                      r in evens]
        if r in evens:
            assert got["process_set_sum"] == [float(sum(evens))]
            assert got["process_set_broadcast"] == [float(evens[-1])]  # a rank of the job
            assert got["process_set_tape"] == pytest.approx(2.0 * np.mean(evens))
        else:
            assert "is not in ProcessSet" in got["process_set_error"]
            assert got["process_set_error_class"] == "InvalidArgumentError"
            assert got["process_set_tape"] == pytest.approx(2.0 * r)  # its own
        for dtype, value in (("uint8", 229), ("int8", 100), ("int16", 30000),
                             ("uint16", 60000)):
            wrapped = int(np.array([value * n], dtype=np.int64).astype(dtype)[0])
            assert got[f"wrapped_{dtype}"] == [wrapped, wrapped], dtype
        assert got["graph_broadcast_grads"] == [[1.0 * (r == root)] * 3 for root in (0, n - 1)]
        assert got["removed"] is True and got["homogeneous"] is True
        assert got["world_is_a_copy"] is True
        if r == n - 1:
            assert got["own_message"] == "the script's own message"
        assert got["last_joined"] in ranks
        # Every rank, then all but the last (which joined): the mean of those training.
        mean_all, mean_rest = (n + 1) / 2, n / 2
        assert got["large_average"] == ([mean_all, mean_rest] if r < n - 1 else [mean_all])
        if r < n - 1:
            assert got["large_sum"] == sum(range(1, n))


def test_mpi_without_thread_support_is_refused_and_serialized_is_warned(monkeypatch):
    class FakeMPI:
        THREAD_SINGLE, THREAD_FUNNELED, THREAD_SERIALIZED, THREAD_MULTIPLE = 0, 1, 2, 3
        level = 1

        @classmethod
        def Query_thread(cls):
            return cls.level

    monkeypatch.setattr(processes, "_mpi", lambda: FakeMPI)
    with pytest.raises(RuntimeError, match="MPI_THREAD_FUNNELED.*mpi4py.rc.thread_level"):
        processes._check_thread_level()
    FakeMPI.level = FakeMPI.THREAD_SERIALIZED
    warnings = []
    monkeypatch.setattr(processes.logger, "warning", lambda text, *args: warnings.append(text))
    assert processes._check_thread_level() == FakeMPI.THREAD_SERIALIZED
    assert "cannot ask other ranks" in warnings[0]
    FakeMPI.level = FakeMPI.THREAD_MULTIPLE
    assert processes._check_thread_level() == FakeMPI.THREAD_MULTIPLE


def test_srun_with_a_mismatched_pmi_plugin_is_refused(monkeypatch):
    srun = {"SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "4"}
    # The plugin named is the one this MPI library starts under.
    for line, plugin in (("Open MPI v5.0.11, package: Open MPI", "pmix"),
                         ("MPICH Version:      5.0.2", "pmi2"),
                         ("Intel(R) MPI Library 2021.14 for Linux* OS", "pmi2")):
        monkeypatch.setattr(processes, "mpi_library",
                            lambda line=line: {"mpi4py": "4.1", "library": line})
        with pytest.raises(RuntimeError, match=f"--mpi={plugin}`"):
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

    monkeypatch.setattr(native, "_ops", None)
    monkeypatch.setattr(native, "_ops_failure", None)
    monkeypatch.setattr(native, "_mpicxx", lambda: None)
    assert native.load() is None
    assert "mpicxx" in native.failure()
    with pytest.raises(RuntimeError, match="jit_compile=False"):
        native.load_xla()
    monkeypatch.setattr(native, "_ops_failure", None)
    monkeypatch.setenv("KDIST_NATIVE_OPS", "0")
    assert native.load() is None and "KDIST_NATIVE_OPS" in native.failure()
