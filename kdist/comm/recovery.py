"""Carrying on after ranks died: recognise the failure, then shrink kdist's world.

Under Open MPI's fault tolerance (`kdist run --elastic` or `--fault-tolerant`)
a rank that dies makes the collectives it should have joined fail on some of
the others, not necessarily all, and not necessarily in the same collective.
The first survivor to see such a failure revokes kdist's world communicator,
which makes every pending and later collective on it fail on every rank; each
survivor then calls `shrink_world`, which agrees on who is left and makes
them kdist's world.
"""

import logging

from kdist.comm import ending, processes

logger = logging.getLogger(__name__)

# Words of Open MPI's error strings for its fault-tolerance error classes, as
# they reach Python through TensorFlow's op errors.
_FAILURE_WORDS = ("MPI_ERR_PROC_FAILED", "MPI_ERR_REVOKED", "PROC_FAILED", "REVOKED",
                  "Process Failure", "communicator was revoked")


class RanksLost(RuntimeError):
    """Some ranks of the job died; the survivors can shrink the world and carry on."""


def _failure_classes(MPI):
    names = ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING", "ERR_REVOKED")
    return {getattr(MPI, name) for name in names if hasattr(MPI, name)}


def lost_ranks():
    """How many ranks of kdist's world this process knows to have died."""
    comm = processes.world().mpi
    if comm is None:
        return 0
    try:
        group = comm.Get_failed()
    except (AttributeError, NotImplementedError):
        return 0
    try:
        return group.Get_size()
    finally:
        group.Free()


def _revoked(comm):
    try:
        return bool(comm.Is_revoked())
    except (AttributeError, NotImplementedError):
        return False


def caused_by_lost_ranks(error):
    """True if `error` (raised by a collective) comes from ranks that died.

    Only a fault-tolerant job can tell; elsewhere a dead rank ends the job.
    """
    if isinstance(error, RanksLost):
        return True
    if not ending.fault_tolerant():
        return False
    from mpi4py import MPI

    comm = processes.world().mpi
    if comm is None:
        return False
    if isinstance(error, MPI.Exception) and error.Get_error_class() in _failure_classes(MPI):
        return True
    text = str(error)
    return (any(word in text for word in _FAILURE_WORDS) or _revoked(comm)
            or lost_ranks() > 0)


def revoke():
    """Makes every pending and later collective on kdist's world fail on every rank."""
    comm = processes.world().mpi
    if comm is None or _revoked(comm):
        return
    try:
        comm.Revoke()
    except Exception as error:  # noqa: BLE001  (already revoked by another rank meanwhile)
        logger.debug("revoking the world: %s", error)


def confirm_everyone_finished():
    """A uniform check at the end of training: raises `RanksLost` on every survivor
    if some rank died, so that no survivor leaves while the others recover."""
    comm = processes.world().mpi
    if comm is None or comm.Get_size() == 1 or not ending.fault_tolerant():
        return
    from mpi4py import MPI

    try:
        comm.Agree(1)
    except MPI.Exception as error:
        raise RanksLost(f"a rank died before every rank finished ({error})") from error


def shrink_world():
    """Agrees with the other survivors on who is left; returns (old size, new size).

    Every surviving rank must call it. The world `Communicator` keeps its
    identity (see `processes.replace_world`), so code that holds it carries on,
    but TensorFlow functions traced before must be traced again.
    """
    world = processes.world()
    old_size = world.size
    revoke()
    # Blocking: Open MPI's Ishrink fails with an internal error.
    survivors = world.mpi.Shrink()
    processes.replace_world(survivors)
    logger.warning("%d rank(s) lost; carrying on with %d.", old_size - world.size, world.size)
    return old_size, world.size
