"""How a process of a fault-tolerant job ends once other ranks have died.

Under Open MPI's fault tolerance (`mpiexec --with-ft ulfm`), `MPI_Finalize`
first closes the failure detector's ring of heartbeats: each process waits for
the one it watches to leave. Once ranks have died the ring has been patched
around them, and that wait can last forever; a job whose training finished
then hangs at exit. So when some rank of the world has died, a surviving
process that ends normally waits for the other survivors (a shrunk
communicator and a barrier, for at most `KDIST_EXIT_TIMEOUT` seconds,
default 30) and then leaves without `MPI_Finalize`, with status 0 (1 after an
uncaught exception). Under a
plain `mpiexec` the survivors of a finished training leave through
`MPI_Abort(0)`: the launcher would otherwise wait for lost ranks that never
end (a stopped process, a host that cannot be reached), and the abort has it
end them and exit 0. A failing survivor exits with status 1 instead, which
ends the job with that status: Open MPI's launcher does not reliably report
`MPI_Abort(1)` once ranks died.

Leaving early is not an option on its own: the launcher ends the whole job
when the first survivor exits without finalizing, killing survivors that
were still writing their results.

A job that grew (survivors spawned replacements for lost ranks) spans
several MPI jobs; all its processes meet on kdist's world first. Then the
survivors leave as above, and the replacements, whose own MPI job lost no
rank, end with `MPI_Finalize` as their launcher expects.
"""

import atexit
import logging
import os
import sys
import time

from kdist import _prefix

logger = logging.getLogger(__name__)


def fault_tolerant():
    """Whether this process runs under Open MPI's fault tolerance."""
    return os.environ.get("OMPI_MCA_mpi_ft_enable", "").lower() in ("1", "true", "yes")


_joined = False


def mark_joined():
    """Records that kdist's world now spans processes of more than one MPI job."""
    global _joined
    _joined = True


_failed = False


def mark_failed():
    """Records that this process ends on an uncaught exception: it then leaves with status
    1, not 0."""
    global _failed
    _failed = True


def install():
    """Arranges the ending above for this process, when fault tolerance is on."""
    if fault_tolerant():
        atexit.register(leave_if_ranks_died)


def dead_ranks(comm):
    """How many ranks of `comm` this process knows to have died (MPI_Comm_get_failed)."""
    group = comm.Get_failed()
    try:
        return group.Get_size()
    finally:
        group.Free()


def ranks_died():
    """Whether this process runs under fault tolerance and knows of a dead rank of its
    MPI job (False outside MPI)."""
    if not fault_tolerant():
        return False
    from mpi4py import MPI

    if not MPI.Is_initialized() or MPI.Is_finalized():
        return False
    try:
        return dead_ranks(MPI.COMM_WORLD) > 0
    except MPI.Exception:
        return False


def _wait(request, deadline):
    while not request.Test():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def leave_if_ranks_died(timeout=None):
    """Ends this process without `MPI_Finalize` if some rank of the world died
    or the world grew."""
    from mpi4py import MPI

    if not MPI.Is_initialized() or MPI.Is_finalized():
        return
    _bound_the_exit()
    world = MPI.COMM_WORLD
    try:
        lost_own = dead_ranks(world) > 0
    except MPI.Exception:
        lost_own = False
    if not (lost_own or _joined):
        return
    if _joined:
        from kdist.comm import job

        # Every process still in the job, whichever MPI job started it.
        world = job.world().mpi
    if timeout is None:
        timeout = float(os.environ.get("KDIST_EXIT_TIMEOUT", "30"))
    deadline = time.monotonic() + timeout
    try:
        # Blocking: Open MPI's Ishrink fails with an internal error here.
        survivors = world.Shrink()
        met = _wait(survivors.Ibarrier(), deadline)
        if not met:
            logger.warning("Not every surviving rank reached the end within %g s; leaving "
                           "anyway.", timeout)
    except MPI.Exception as error:
        # A rank that died meanwhile; the others are on their way out too.
        logger.warning("Meeting the other surviving ranks at the end failed (%s); leaving "
                       "anyway.", error)
    if not lost_own:
        # This process's own MPI job (replacements spawned together) lost no
        # rank: its launcher expects MPI_Finalize, which no longer waits for
        # anyone once the others met it here.
        return
    # A plain launcher waits for every lost rank that has not ended, and one on a stopped
    # or unreachable host never does; MPI_Abort with status 0 has it end them and exit 0.
    # `kdist run` ends such a launcher itself once the survivors have.
    status = 1 if _failed else 0
    # A failure leaves with its status: after MPI_Abort(1) in a job that lost ranks, Open
    # MPI's launcher has exited 0 or waited for good (about 1 job in 10 under load), while
    # a rank's non-zero exit always ends the job with that status.
    through_abort = not (_joined or status or os.environ.get(_prefix.TOKEN_VARIABLE))
    if through_abort:
        logger.warning("Ranks of this job were lost; ending it with MPI_Abort(0) so that the "
                       "launcher does not wait for them (the training finished, this is no "
                       "error).")
        watch_the_launcher("the training finished and the survivors ended the job")
    elif status:
        logger.warning("Ranks of this job were lost and this rank failed; leaving with "
                       "status 1, which ends the job.")
        watch_the_launcher("a surviving rank failed")
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    if through_abort:
        MPI.COMM_WORLD.Abort(status)
    os._exit(status)


def _bound_the_exit():
    """Leaves a clock (kdist/comm/_clock.py) that kills this process if it is still there
    30 s after KDIST_EXIT_TIMEOUT: Open MPI's fault-tolerant MPI_Finalize can wait for
    ever for a peer that crashed inside its own (seen after a link flapped)."""
    from kdist.comm import _clock

    bound = float(os.environ.get("KDIST_EXIT_TIMEOUT", "30")) + 30.0
    message = (f"[kdist] This process, a rank that finished, was still ending "
               f"{bound:g} s later (MPI_Finalize waits for a peer that crashed or "
               "vanished); killing it.")
    _clock.start(after=bound, message=message, kill_parent=True, speak_through_parent=True)


# How long the launcher may take to end the job after the survivors' MPI_Abort.
LAUNCHER_GRACE = 20.0


def watch_the_launcher(after):
    """On the launcher's host, leaves a clock (kdist/comm/_clock.py) that ends the launcher
    if it still waits LAUNCHER_GRACE seconds from now (`after`: what it was told, for the
    message): Open MPI's waits for the daemon of a host it cannot reach (a partition)
    until TCP gives up, 15 minutes. Not under `kdist run`, which ends it itself."""
    from kdist.comm import _clock

    if os.environ.get(_prefix.TOKEN_VARIABLE):
        return
    launcher = _clock.launcher_above(os.getpid(), _clock.HEAD_LAUNCHERS)
    if launcher is None:
        return
    message = (f"[kdist] The launcher (pid {launcher}) still waited {LAUNCHER_GRACE:g} s "
               f"after {after} (for a host it cannot reach); ending it, so its exit status "
               "is not 0.")
    # A session of its own: the launcher ends the rank's process group with it. No hold
    # on the rank's output either: the launcher waits for that to close.
    _clock.start(launcher=launcher, launcher_grace=LAUNCHER_GRACE, launcher_message=message,
                 own_session=True)


