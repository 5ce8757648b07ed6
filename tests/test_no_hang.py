"""No hang, anywhere: a stopped rank ends the job within the timeout, naming it."""

import os
import socket
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("case,setting", [("stop", "KDIST_COLLECTIVE_TIMEOUT"),
                                          ("stop-graph", "KDIST_PEER_TIMEOUT")])
def test_a_stopped_rank_ends_the_job_within_the_timeout_naming_it(mpi_job, case, setting):
    # A hang would outlive the fixture's timeout and fail there; how long ending takes is
    # measured by benchmarks/faults.py, not asserted here. The collective timeout ends any
    # long wait; the peer timeout (on by default, shortened here) ends a wait for a rank
    # that stopped answering, and names its host.
    """Its own job: a rank is stopped and the job must end; how it ends is the subject."""
    job = mpi_job("stall.py", n=2, args=[case], check=False, timeout=150, env={setting: "6"})
    assert job.returncode != 0 and job.results == {}
    assert "[kdist rank 0] aborting the job" in job.output
    assert "rank(s) [1] do not answer" in job.output, job.output[-3000:]
    if setting == "KDIST_COLLECTIVE_TIMEOUT":
        assert "KDIST_COLLECTIVE_TIMEOUT=6" in job.output
    else:
        host = socket.gethostname()
        assert (f"rank(s) 1 (host {host}) answered none of kdist's questions for 6 s "
                f"(KDIST_PEER_TIMEOUT): lost, with host(s) {host} down") in job.output
    if case == "stop":
        assert "after the pause" in job.output, "the waiting collective is named"


def test_a_long_wait_is_reported_with_the_missing_rank_and_the_job_goes_on(mpirun):
    # The deadlock and peer timeouts pass too, but the missing rank is running and answers
    # the watchdog: no deadlock, and not lost.
    job = mpirun("stall.py", n=2, args=["pause"], timeout=150,
                 env={"KDIST_STALL_WARNING": "2", "PAUSE_SECONDS": "7",
                      "KDIST_DEADLOCK_TIMEOUT": "2", "KDIST_PEER_TIMEOUT": "2"})
    assert job.rank(0)["waited"] > 5
    assert "stall: 'allreduce (sum) of 1000 float64 values (after the pause)" in job.output
    assert "rank 1 is running, not in a kdist collective" in job.output, job.output[-3000:]


def test_ranks_waiting_in_different_collectives_end_the_job_as_a_deadlock(mpi_job):
    # No KDIST_COLLECTIVE_TIMEOUT: the deadlock timeout is on by default (here shortened).
    """Its own job: the watchdog ends a deadlocked job; how it ends is the subject."""
    job = mpi_job("stall.py", n=2, args=["deadlock"], check=False, timeout=120,
                  env={"KDIST_DEADLOCK_TIMEOUT": "4"})
    assert job.returncode != 0 and job.results == {}
    assert "a deadlock (KDIST_DEADLOCK_TIMEOUT=4)" in job.output, job.output[-3000:]
    # Either rank's watchdog may see the deadlock first; it names the other's wait.
    waits = ["rank 1 is waiting in 'allreduce (sum) of 3 float64 values (on the pair)'",
             "rank 0 is waiting in 'allreduce (sum) of 3 float64 values (on the world)'"]
    assert any(wait in job.output for wait in waits), job.output[-3000:]


def test_a_rank_whose_script_ends_makes_the_waiting_rank_fail_at_once(mpi_job):
    # Rank 1 ends its script; rank 0 then starts a collective. (The C++ engine's side:
    # test_agreement's rank that stops its fit alone.)
    """Its own job: a rank's process ends while the other waits, and the job ends; how is the
    subject.
    """
    job = mpi_job("stall.py", n=2, args=["leave"], check=False, timeout=120)
    assert job.returncode != 0
    error = job.rank(0)["error"]
    assert job.rank(0)["waited"] < 5, "the waiting rank fails at once"
    assert "rank 1: leaving the job: its script ended" in error, error
    assert "Usually a rank left a loop early" in error
    assert "[kdist rank 0] aborting the job" in job.output


STARTS_LATE = """
import os, time
if os.environ.get("OMPI_COMM_WORLD_RANK") == "1":
    time.sleep(120)  # as a rank stopped or lost while the job starts
import kdist
kdist.init()
"""


DIES_AS_MPI_STARTS = """
import os
if os.environ.get("OMPI_COMM_WORLD_RANK") == "1":
    from mpi4py import MPI  # MPI has started; the rank dies before kdist does
    os._exit(3)
import kdist
kdist.init()
"""


def test_a_rank_that_dies_while_the_job_starts_ends_a_fault_tolerant_job(mpi_job):
    # Under fault tolerance the launcher lets the others go on without rank 1; their
    # kdist.init() fails in its first collective and ends the whole job, rather than
    # leave it to the launcher, which would wait on.
    """Its own job: a rank dies while the others start; how they end is the subject."""
    job = mpi_job(DIES_AS_MPI_STARTS, n=3, check=False, timeout=120, fault_tolerant=True)
    assert job.returncode != 0
    assert "kdist.init() failed while the job started" in job.output, job.output[-3000:]
    assert "Ending the job with MPI_Abort" in job.output


@pytest.mark.parametrize("launch", ["mpiexec, fault tolerant", "kdist run --elastic"])
def test_a_rank_that_never_starts_ends_the_job_after_the_start_timeout(mpi_job, launch):
    # kdist's watchdog starts only once kdist.init() is done, and MPI_Init waits for every
    # rank: the start-up clock ends rank 0. A fault-tolerant launcher would let the job go
    # on without it, waiting for rank 1 for ever: the clock ends that launcher too, or
    # tells kdist run, which ends it. (A launcher without fault tolerance ends the job as
    # soon as rank 0 is gone.)
    """Its own job: a rank is missing while the others start; how they end is the subject."""
    started = time.monotonic()
    job = mpi_job(STARTS_LATE, n=2, check=False, timeout=100,
                  env={"KDIST_START_TIMEOUT": "10"}, fault_tolerant=True,
                  kdist_run=launch.startswith("kdist"), elastic=launch.endswith("elastic"))
    assert time.monotonic() - started < 60, "rank 1 sleeps 120 s: the job was ended"
    assert job.returncode != 0
    assert ("[kdist rank 0] kdist.init() has waited 10 s for the job's other ranks to start "
            "(KDIST_START_TIMEOUT)") in job.output, job.output[-3000:]
    if launch.startswith("kdist"):
        assert ("rank 0 gave up waiting for the others to start (KDIST_START_TIMEOUT)"
                in job.output), job.output[-3000:]
        assert "The job could not start; kdist run ended its launcher." in job.output
    else:
        assert "ending this rank and the job's launcher" in job.output


def test_the_clock_finds_the_head_launcher_above_a_rank_before_its_daemon(tmp_path):
    # kdist/comm/_clock.py ends the launcher of a job that cannot start or end: the head
    # (prterun) where it is an ancestor, since a daemon (prted) it ends would leave the
    # head waiting for a host it cannot reach.
    import shutil
    import subprocess
    import sys

    for name in ("prterun", "prted"):
        shutil.copy("/bin/sh", tmp_path / name)
    (tmp_path / "probe.py").write_text(
        f"import os, sys\nsys.path.insert(0, {ROOT!r})\nfrom kdist.comm import _clock\n"
        "print(_clock.launcher_above(os.getpid()), "
        "_clock.launcher_above(os.getpid(), ('prted',)), "
        "_clock.launcher_above(os.getpid(), ('orted',)))\n")
    probe = f"{sys.executable} {tmp_path / 'probe.py'}; true"
    script = f"echo head $$; {tmp_path / 'prted'} -c 'echo daemon $$; {probe}'; true"
    shown = subprocess.run([str(tmp_path / "prterun"), "-c", script], capture_output=True,
                           text=True, timeout=60).stdout.split()
    head, daemon = shown[1], shown[3]
    assert shown[4:] == [head, daemon, "None"], shown


def test_the_exit_clock_kills_a_rank_whose_end_outlasts_its_bound():
    # kdist/comm/ending.py leaves this clock at the exit of every fault-tolerant rank:
    # Open MPI's MPI_Finalize there can wait for ever for a peer that crashed in its own.
    import subprocess
    import sys

    stuck = (f"import subprocess, sys, time\nsys.path.insert(0, {ROOT!r})\n"
             "from kdist.comm import _clock\n"
             "import os\n"
             "subprocess.Popen([sys.executable, '-I', _clock.__file__, '--parent', "
             "str(os.getpid()), '--after', '1', '--message', 'ending stuck exit', "
             "'--kill-parent', '--speak-through-parent'], stdout=subprocess.DEVNULL, "
             "stderr=subprocess.DEVNULL)\n"
             "time.sleep(60)  # as MPI_Finalize waiting for a crashed peer\n")
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", stuck], capture_output=True, text=True,
                          timeout=60)
    assert time.monotonic() - started < 30
    assert done.returncode == -9
    assert "ending stuck exit" in done.stderr
