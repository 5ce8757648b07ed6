"""MPIStrategy: a MirroredStrategy script under mpiexec trains as one process on the global batch."""

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


@pytest.mark.parametrize("optimizer,lr,atol", [("sgd", 0.05, 1e-5), ("adam", 1e-3, 1e-4)])
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
