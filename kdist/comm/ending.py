"""How a process of a fault-tolerant job ends once other ranks have died.

Under Open MPI's fault tolerance (`mpiexec --with-ft ulfm`), `MPI_Finalize`
first closes the failure detector's ring of heartbeats: each process waits for
the one it watches to leave. Once ranks have died the ring has been patched
around them, and that wait can last forever; a job whose training finished
then hangs at exit. So when some rank of the world has died, a surviving
process that ends normally waits for the other survivors (a shrunk
communicator and a barrier, for at most `KDIST_EXIT_TIMEOUT` seconds,
default 30) and then leaves without `MPI_Finalize`, with status 0.

Leaving early is not an option on its own: the launcher ends the whole job
when the first survivor exits without finalizing, killing survivors that
were still writing their results.
"""

import atexit
import logging
import os
import sys
import time

logger = logging.getLogger(__name__)


def fault_tolerant():
    """Whether this process runs under Open MPI's fault tolerance."""
    return os.environ.get("OMPI_MCA_mpi_ft_enable", "").lower() in ("1", "true", "yes")


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


def _wait(request, deadline):
    while not request.Test():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def leave_if_ranks_died(timeout=None):
    """Ends this process without `MPI_Finalize` if some rank of the world died."""
    from mpi4py import MPI

    if not MPI.Is_initialized() or MPI.Is_finalized():
        return
    world = MPI.COMM_WORLD
    try:
        if dead_ranks(world) == 0:
            return
    except MPI.Exception:
        return
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
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
