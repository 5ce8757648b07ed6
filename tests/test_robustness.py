"""Failures end the job with a clear message; uneven data, overflow and restarts are safe."""

import os
import time

import pytest

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("case", ["raise", "kill"])
def test_a_failing_rank_ends_every_rank_quickly_and_says_which(mpirun, case):
    started = time.monotonic()
    job = mpirun("robust.py", n=2, args=[case], check=False, timeout=120)
    elapsed = time.monotonic() - started
    assert job.returncode != 0
    assert elapsed < 60, f"the job took {elapsed:.0f} s to end after rank 1 failed"
    assert job.results == {}, "no rank may report success"
    if case == "raise":
        assert "[kdist rank 1] aborting the job: uncaught RuntimeError on rank 1" in job.output
        assert "injected failure on purpose" in job.output
    else:
        assert "signal 9" in job.output or "Killed" in job.output, job.output[-2000:]


def test_different_models_are_reported_by_variable_name(mpirun):
    job = mpirun("robust.py", n=2, args=["mismatch"], check=False, timeout=120)
    assert job.returncode != 0
    assert "every rank must build the same model" in job.output
    assert "kernel" in job.output and "(12, 32)" in job.output and "(12, 33)" in job.output


@pytest.mark.parametrize("case,native", [("uneven", "1"), ("uneven", "0"),
                                         ("mixed_uneven", "1")])
def test_uneven_batches_across_ranks_finish_with_identical_weights(mpirun, case, native):
    # mixed_uneven: mixed_float16, uneven batches and an overflow on rank 1, all at once.
    # native=0: the py-function engine, whose join protocol must match too.
    job = mpirun("robust.py", n=2, args=[case], timeout=150,
                 env={"KDIST_NATIVE_OPS": native})
    assert job.rank(0)["weights"] == job.rank(1)["weights"]
    assert job.rank(0)["loss"] == job.rank(1)["loss"], "averaged metrics must agree"


def test_an_overflow_on_one_rank_makes_every_rank_skip_and_lower_the_scale(mpirun):
    job = mpirun("robust.py", n=2, args=["overflow"], timeout=150)
    rank0, rank1 = job.rank(0), job.rank(1)
    assert rank0["optimizer"] == "LossScaleOptimizer"
    assert rank0["weights"] == rank1["weights"]
    # Batch 3 of rank 1 overflows in each of the 2 epochs: two skipped steps, scale / 4.
    assert rank0["scale"] == rank1["scale"] == rank0["initial_scale"] / 4
    assert rank0["iterations"] == rank1["iterations"] == 2 * 8 - 2


def test_an_interrupted_run_resumes_to_the_same_weights(mpirun, tmp_path):
    straight = mpirun("resume.py", n=2, args=["--checkpoints", tmp_path / "straight"])
    crashed = mpirun("resume.py", n=2, check=False,
                     args=["--checkpoints", tmp_path / "resumed", "--crash-after-epoch", 1])
    assert crashed.returncode != 0 and crashed.results == {}
    assert sorted(os.listdir(tmp_path / "resumed")) == ["epoch-000001.npz", "epoch-000002.npz"]
    resumed = mpirun("resume.py", n=2, args=["--checkpoints", tmp_path / "resumed"])
    assert resumed.rank(0)["resumed_from"] == 2
    assert resumed.rank(0)["epochs_run"] == 2
    assert resumed.rank(0)["iterations"] == straight.rank(0)["iterations"] == 4 * 6
    assert resumed.rank(0)["weights"] == straight.rank(0)["weights"]
    assert resumed.rank(1)["weights"] == straight.rank(0)["weights"]
