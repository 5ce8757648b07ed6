"""Failures end the job with a clear message; uneven data, overflow and restarts are safe."""

import os

import numpy as np
import pytest

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("case", ["raise", "kill"])
def test_a_failing_rank_ends_every_rank_quickly_and_says_which(mpi_job, case):
    # Ending at all is the fixture's check (a hang fails at its timeout); how fast is
    # benchmarks/faults.py's measurement.
    """Its own job: a rank raises or is killed and the job must end; how it ends is the
    subject.
    """
    job = mpi_job("robust.py", n=2, args=[case], check=False, timeout=120)
    assert job.returncode != 0
    assert job.results == {}, "no rank may report success"
    if case == "raise":
        assert "[kdist rank 1] aborting the job: uncaught RuntimeError on rank 1" in job.output
        assert "injected failure on purpose" in job.output
    else:
        assert "signal 9" in job.output or "Killed" in job.output, job.output[-2000:]


def test_different_models_are_reported_by_variable_name(mpi_job):
    """Its own job: the mismatch ends the job (kdist aborts it); how it ends is the subject."""
    job = mpi_job("robust.py", n=2, args=["mismatch"], check=False, timeout=120)
    assert job.returncode != 0
    assert "every rank must build the same model" in job.output
    assert "kernel" in job.output and "(12, 32)" in job.output and "(12, 33)" in job.output


@pytest.fixture(scope="module")
def uneven_reference(python_run):
    """One process trained as two ranks with uneven data must train together."""
    return python_run("robust.py", ["reference"], timeout=120)


@pytest.mark.parametrize("case,native", [("uneven", "1"), ("uneven", "0"),
                                         ("mixed_uneven", "1")])
def test_uneven_batches_average_over_the_ranks_that_still_train(mpirun, uneven_reference,
                                                                case, native):
    # Rank 0 has 5 batches per epoch, rank 1 has 8. Steps 1-5 average both
    # ranks' gradients; steps 6-8 take rank 1's alone (rank 0 feeds zeros,
    # which must not count); at the epoch's end rank 0 takes rank 1's state.
    # mixed_uneven: mixed_float16 and an overflow on rank 1 at step 4 as well.
    # native=0: the py-function engine, whose join protocol must match too.
    # kdist's epoch-end agreement would join before the worker's first callback looks;
    # without it the worker sees each rank's own steps (the agreement's case is below).
    job = mpirun("robust.py", n=2, args=[case], timeout=150, env={"KDIST_NATIVE_OPS": native})
    expected = uneven_reference[case]["after_step"]
    atol = 1e-4 if case == "mixed_uneven" else 1e-5
    rank0, rank1 = job.rank(0), job.rank(1)
    # Before the epoch-end copy: each rank is where its own steps took it.
    for epoch in range(2):
        np.testing.assert_allclose(rank0["before_epoch_end"][epoch], expected[8 * epoch + 4],
                                   atol=atol, rtol=0, err_msg=f"rank 0, epoch {epoch + 1}")
        np.testing.assert_allclose(rank1["before_epoch_end"][epoch], expected[8 * epoch + 7],
                                   atol=atol, rtol=0, err_msg=f"rank 1, epoch {epoch + 1}")
    # After it: both hold the last rank's weights, and rank 0 had fallen behind.
    assert rank0["weights"] == rank1["weights"]
    np.testing.assert_allclose(rank0["weights"], expected[-1], atol=atol, rtol=0)
    assert np.abs(np.subtract(rank0["before_epoch_end"][1], expected[-1])).max() > 10 * atol
    # The averaged metric is the mean of each rank's own epoch loss (not a
    # number in mixed_uneven, where the overflowing batch's loss counts too).
    np.testing.assert_allclose(rank0["loss"], rank1["loss"], rtol=0, atol=0)
    np.testing.assert_allclose(rank0["loss"], uneven_reference[case]["loss"], rtol=1e-5)


def test_with_uneven_batches_every_epoch_end_callback_sees_the_synced_model(mpirun,
                                                                            uneven_reference):
    # With kdist's agreement the join and the copy from the last rank to join happen
    # before any callback of the list, so a ModelCheckpoint on rank 0 saves the model
    # every rank goes on from, not rank 0's, which missed rank 1's last steps.
    job = mpirun("robust.py", n=2, args=["uneven", "--agreement"], timeout=150)
    expected = uneven_reference["uneven"]["after_step"]
    rank0, rank1 = job.rank(0), job.rank(1)
    assert rank0["before_epoch_end"] == rank1["before_epoch_end"]
    for epoch in range(2):
        np.testing.assert_allclose(rank0["before_epoch_end"][epoch], expected[8 * epoch + 7],
                                   atol=1e-5, rtol=0, err_msg=f"epoch {epoch + 1}")
    assert rank0["weights"] == rank1["weights"]
    np.testing.assert_allclose(rank0["loss"], uneven_reference["uneven"]["loss"], rtol=1e-5)


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


def test_the_watchdog_channel_outlives_a_dead_peer(monkeypatch):
    # In a fault-tolerant job a dead rank fails MPI calls on the watchdog's
    # channel (MPI_ERR_PROC_FAILED_PENDING); the monitor thread must carry on.
    import types

    from kdist.comm import peers

    class Failure(Exception):
        pass

    monkeypatch.setattr(peers, "_mpi", lambda: types.SimpleNamespace(
        Exception=Failure, Status=lambda: None, ANY_SOURCE=-1))

    class Request:
        def Test(self, status=None):
            raise Failure("MPI_ERR_PROC_FAILED_PENDING")

        def Cancel(self):
            raise Failure("MPI_ERR_PROC_FAILED")

        Wait = Cancel

    class Comm:
        def Get_size(self):
            return 3

        def Irecv(self, buffer, source, tag):
            return Request()

        def Isend(self, buffer, dest, tag):
            if dest == 2:
                raise Failure("MPI_ERR_PROC_FAILED")
            return Request()

    channel = peers.PeerStatus(Comm(), rank=0)
    channel.answer("is running")
    assert channel._incoming is None  # it stopped listening instead of raising
    assert channel.ask(lambda: "is running", grace=0.1) == {1: None, 2: None}
    channel.close()

    # Where MPI can acknowledge the death, the channel listens on, once per new death.
    class FaultTolerantComm(Comm):
        deaths = 1

        def Ack_failed(self):
            return self.deaths

    comm = FaultTolerantComm()
    channel = peers.PeerStatus(comm, rank=0)
    channel.answer("is running")
    assert channel._incoming is not None
    channel.answer("is running")  # the same error, no new death: a real fault
    assert channel._incoming is None


SURVIVORS_AT_EXIT = """
import atexit, os, sys, time

# Registered before kdist's own handler, so it runs after it: only if MPI_Finalize runs.
atexit.register(lambda: print("finalized as usual", flush=True))
import kdist
from workers.common import report

kdist.init()
from mpi4py import MPI

rank = kdist.rank()
if rank == 2:
    os._exit(3)
while MPI.COMM_WORLD.Get_failed().Get_size() == 0:
    MPI.COMM_WORLD.Iprobe()  # lets the failure detector run
    time.sleep(0.01)
if rank == 0:
    time.sleep(3)  # the quick survivor's exit must not cut this one short
report({"rank": rank})
print(f"rank {rank} done", flush=True)
"""


def test_survivors_of_a_fault_tolerant_job_all_finish_and_the_job_ends(mpi_job):
    """Its own job: a rank exits under fault tolerance and the survivors' exit is the subject."""
    job = mpi_job(SURVIVORS_AT_EXIT, n=3, check=False, timeout=120, fault_tolerant=True)
    assert sorted(job.results) == [0, 1], job.output[-3000:]
    assert "rank 0 done" in job.output and "rank 1 done" in job.output
    # They left without MPI_Finalize, which can hang in Open MPI's failure detector.
    assert "finalized as usual" not in job.output


THREAD_FAILS = """
import threading, time
import kdist
from workers.common import report

kdist.init()

def fail():
    raise RuntimeError("thread failure on purpose")

# A thread of the user's own failing is the user's business: the job goes on.
user = threading.Thread(target=fail, name="users-thread")
user.start(); user.join()
kdist.allreduce(1.0, name="after the user's thread")
if kdist.rank() == 1:
    threading.Thread(target=fail, name="kdist-on-purpose").start()
kdist.allreduce(1.0, name="rank 0 waits here")
time.sleep(60)
report({"finished": True})
"""


def test_an_exception_in_a_kdist_thread_ends_the_job_and_says_where(mpi_job):
    """Its own job: a failing kdist thread aborts the job; how it ends is the subject."""
    job = mpi_job(THREAD_FAILS, n=2, check=False, timeout=120)
    assert job.returncode != 0 and job.results == {}
    assert ("[kdist rank 1] aborting the job: uncaught RuntimeError in kdist's thread "
            "kdist-on-purpose on rank 1: thread failure on purpose") in job.output, \
        job.output[-3000:]
    # The user's own thread failed first, printed its traceback, and the job went on.
    assert "users-thread" in job.output
    assert job.output.index("users-thread") < job.output.index("kdist-on-purpose")
