"""MPIStrategy: a MirroredStrategy script under mpiexec trains as one process on the
global batch."""

import numpy as np
import pytest

pytestmark = pytest.mark.mpi


def _assert_same_training(job, single, ranks, atol):
    reports = [job.rank(r) for r in range(ranks)]
    for other in reports[1:]:
        assert other["weights"] == reports[0]["weights"], "ranks must hold identical weights"
        assert other["evaluation"] == reports[0]["evaluation"]
    ours = reports[0]
    assert ours["replicas"] == ranks and ours["strategy"] == "MPIStrategy"
    assert ours["iterations"] == single["iterations"]
    np.testing.assert_allclose(ours["weights"], single["weights"], atol=atol, rtol=0)
    # Metrics are global (summed over ranks), not rank 0's share.
    for name in ("loss", "accuracy"):
        np.testing.assert_allclose(ours["history"][name], single["history"][name], atol=atol)
        np.testing.assert_allclose(ours["evaluation"][name], single["evaluation"][name],
                                   atol=atol)
    # predict hands every rank all rows, in input order.
    np.testing.assert_allclose(ours["predictions"], single["predictions"], atol=10 * atol)


@pytest.mark.parametrize("optimizer,lr,atol", [("adam", 1e-3, 1e-4)])
def test_mirrored_script_under_mpiexec_matches_one_process(mpirun, python_run, optimizer, lr,
                                                           atol):
    args = ["--optimizer", optimizer, "--lr", lr]
    single = python_run("strategy.py", args + ["--strategy", "mirrored"])
    # Different seeds per rank: only the broadcast at creation makes them agree.
    job = mpirun("strategy.py", n=2, args=args + ["--strategy", "mpi", "--seed-per-rank"])
    _assert_same_training(job, single, 2, atol)


def test_four_ranks_with_uneven_prediction_batches(mpirun, python_run):
    single = python_run("strategy.py", ["--strategy", "default"])
    job = mpirun("strategy.py", n=4, args=["--strategy", "mpi"], timeout=240)
    _assert_same_training(job, single, 4, 1e-5)


def test_synchronized_batch_norm_uses_global_batch_statistics(mpirun, python_run):
    args = ["--batch-norm", "sync"]
    single = python_run("strategy.py", args + ["--strategy", "default"])
    job = mpirun("strategy.py", n=2, args=args + ["--strategy", "mpi"])
    _assert_same_training(job, single, 2, 1e-5)


def test_local_batch_norm_differs_from_global_batch_statistics(mpirun, python_run):
    # The control for the test above: without synchronization each rank
    # normalises with its own half of the batch.
    args = ["--batch-norm", "local"]
    single = python_run("strategy.py", args + ["--strategy", "default"])
    job = mpirun("strategy.py", n=2, args=args + ["--strategy", "mpi"])
    difference = np.abs(np.subtract(job.rank(0)["weights"], single["weights"])).max()
    assert difference > 1e-3


def test_mixed_precision_overflow_on_one_rank_skips_the_step_everywhere(mpirun, python_run):
    # Rank 1's half of global batch 3 overflows float16; rank 0's does not.
    args = ["--mixed", "--overflow-batch", 3, "--steps", 6]
    single = python_run("strategy.py", args + ["--strategy", "default"])
    job = mpirun("strategy.py", n=2, args=args + ["--strategy", "mpi"], timeout=150)
    rank0, rank1 = job.rank(0), job.rank(1)
    assert rank0["optimizer"] == "LossScaleOptimizer"
    assert rank0["weights"] == rank1["weights"]
    assert rank0["iterations"] == single["iterations"] == 2 * 6 - 2
    np.testing.assert_allclose(rank0["weights"], single["weights"], atol=2e-3, rtol=0)


SAVE_ON_RANK_ZERO = """
import sys
import keras, numpy as np
import kdist
from workers.common import report

strategy = kdist.distribute.MPIStrategy()
x = np.random.default_rng(0).normal(size=(64, 8)).astype("float32")
y = (x.sum(1) > 0).astype("int32")
with strategy.scope():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
    model.compile(optimizer="adam", metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
model.fit(x, y, batch_size=16, epochs=1, verbose=0)
path = sys.argv[1]
if kdist.rank() == 0:
    model.save(path)
kdist.barrier()
loaded = keras.models.load_model(path)
same = all(np.array_equal(a, b) for a, b in zip(model.get_weights(), loaded.get_weights()))
report({"same": same})
"""


def test_saving_on_rank_zero_alone_neither_hangs_nor_loses_weights(mpirun, tmp_path):
    job = mpirun(SAVE_ON_RANK_ZERO, n=2, args=[tmp_path / "model.keras"], timeout=120)
    assert job.rank(0)["same"] and job.rank(1)["same"]


def test_unbatched_dataset_is_a_clear_error():
    import tensorflow as tf

    from kdist.distribute import slice_batches

    with pytest.raises(ValueError, match="Batch it with the global batch size"):
        slice_batches(tf.data.Dataset.range(8), 0, 2)
    with pytest.raises(ValueError, match="rank must be in"):
        slice_batches(tf.data.Dataset.range(8).batch(4), 2, 2)


def test_slices_cover_every_row_once_in_order():
    import tensorflow as tf

    from kdist.distribute import slice_batches

    data = tf.data.Dataset.from_tensor_slices({"x": tf.range(10), "y": tf.range(10) * 2}).batch(4)
    shares = [[b["x"].numpy().tolist() for b in slice_batches(data, r, 3)] for r in range(3)]
    assert [len(s) for s in shares] == [3, 3, 3], "every rank takes every step"
    rows = [row for step in zip(*shares) for share in step for row in share]
    assert rows == list(range(10))


def test_distributed_optimizer_inside_the_strategy_reduces_once(mpirun, python_run):
    single = python_run("strategy.py", ["--strategy", "default", "--epochs", 1])
    job = mpirun("strategy.py", n=2, args=["--strategy", "mpi", "--epochs", 1,
                                           "--distributed-optimizer"])
    assert job.rank(0)["optimizer"] == "AllreduceOptimizer"
    assert not job.rank(0)["optimizer_reduced_itself"], "the strategy alone reduces"
    np.testing.assert_allclose(job.rank(0)["weights"], single["weights"], atol=1e-5, rtol=0)
