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
import os
import signal
import socket

from kdist.comm import ending, job, processes

logger = logging.getLogger(__name__)

# Words of Open MPI's error strings for its fault-tolerance error classes, as
# they reach Python through TensorFlow's op errors.
_FAILURE_WORDS = ("PROC_FAILED", "REVOKED", "Process Failure", "communicator was revoked")


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
        return ending.dead_ranks(comm)
    except (AttributeError, NotImplementedError):
        return 0


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


# kdist world rank -> (host, pid, process start time): to stop ranks declared dead.
_processes = {}


def _start_time(pid):
    try:
        with open(f"/proc/{pid}/stat") as stream:
            return stream.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def remember_processes():
    """Records where every rank of kdist's world runs (collective over it).

    Called again whenever the world changed: the ranks are kdist's, which
    stay meaningful across the MPI jobs of a world that grew.
    """
    world = processes.world()
    if world.mpi is None or world.size == 1 or not ending.fault_tolerant():
        return
    me = (socket.gethostname(), os.getpid(), _start_time(os.getpid()))
    _processes.clear()
    _processes.update(enumerate(world.allgather_object(me)))


def _failed_ranks(comm):
    """The ranks of `comm` that MPI knows to have died."""
    from mpi4py import MPI

    group = comm.Get_failed()
    try:
        if group.Get_size() == 0:
            return []
        mine = comm.Get_group()
        ranks = MPI.Group.Translate_ranks(group, list(range(group.Get_size())), mine)
        mine.Free()
        return [r for r in ranks if r != MPI.UNDEFINED]
    finally:
        group.Free()


def _stop_for_good(ranks):
    """Kills processes MPI declared dead that still run on this host.

    MPI's failure detector declares a rank dead when it stops answering: a
    process stopped by a signal, or stuck outside MPI, is declared dead while
    it still exists. The launcher would wait for it forever, and it could wake
    up and talk to a world that moved on; so the survivors on its host end it.
    """
    host = socket.gethostname()
    for rank in ranks:
        known = _processes.get(rank)
        if known is None or known[0] != host:
            continue
        _, pid, started = known
        if started is None or _start_time(pid) != started:
            continue  # gone, or the number now belongs to another process
        try:
            os.kill(pid, signal.SIGKILL)
            logger.warning("ended rank %d (pid %d), which MPI declared dead but still ran",
                           rank, pid)
        except OSError:
            pass


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
    old_hosts = [job.host_of(r) for r in range(old_size)]
    revoke()
    # Blocking: Open MPI's Ishrink fails with an internal error.
    survivors = world.mpi.Shrink()
    _stop_for_good(_failed_ranks(world.mpi))
    left = _old_ranks(survivors, world.mpi)
    processes.replace_world(survivors)
    if world.size < old_size:
        logger.warning("%d rank(s) lost; carrying on with %d.", old_size - world.size,
                       world.size)
        check_quorum(left, old_hosts)
    return old_size, world.size


class NoQuorum(RuntimeError):
    """The ranks left may be one side of a network partition, and not the larger one."""


def check_quorum(left, hosts, environ=None):
    """Raises `NoQuorum` when the ranks `left` (ranks of the world before, whose hosts are
    `hosts`) may be the smaller side of a partition.

    A host cut off by the network looks dead from both sides, and each side would
    train on alone and write the same files (split brain). When every lost rank ran on a
    host where a survivor runs, no partition can explain the loss; otherwise the ranks
    left go on only with more than half of the ranks, or exactly half and rank 0.
    KDIST_ELASTIC_QUORUM=0 lets any side go on."""
    environ = os.environ if environ is None else environ
    if environ.get("KDIST_ELASTIC_QUORUM", "1").strip().lower() in ("0", "false", "no"):
        return
    lost = [r for r in range(len(hosts)) if r not in set(left)]
    ours = {hosts[r] for r in left}
    if all(hosts[r] in ours for r in lost):
        return
    if 2 * len(left) > len(hosts) or (2 * len(left) == len(hosts) and 0 in left):
        return
    away = sorted({hosts[r] for r in lost if hosts[r] not in ours})
    raise NoQuorum(
        f"{len(lost)} of {len(hosts)} ranks were lost on host(s) {', '.join(away)}, and the "
        f"{len(left)} left are not a majority (nor half with rank 0): those hosts may be "
        "alive behind a network partition, training on by themselves, so these ranks stop "
        "rather than train apart. KDIST_ELASTIC_QUORUM=0 lets any side go on.")


def _old_ranks(survivors, old):
    """The ranks in `old` of the processes of `survivors`."""
    from mpi4py import MPI

    theirs, mine = survivors.Get_group(), old.Get_group()
    try:
        return MPI.Group.Translate_ranks(theirs, list(range(theirs.Get_size())), mine)
    finally:
        theirs.Free()
        mine.Free()


def spawn_command(environ=None):
    """The command line that starts this rank's program again: (executable, args).

    Under `kdist run`'s output prefixer the replacement is wrapped the same way.
    """
    import sys

    environ = os.environ if environ is None else environ
    args = list(sys.orig_argv[1:])
    prefixer = environ.get("KDIST_PREFIXER")
    if prefixer:
        args = [prefixer, "--", sys.executable] + args
    return sys.executable, args


def grow_world(target):
    """Spawns processes that run this program until kdist's world has `target`
    ranks; returns the new size. Collective over kdist's world.

    The new processes join the world in `kdist.init()` and take the highest
    ranks; the others keep theirs. When MPI cannot start them (no free slots,
    a launcher without dynamic processes) the world stays as it is, with a
    warning.
    """
    from mpi4py import MPI

    world = processes.world()
    missing = target - world.size
    if missing <= 0 or world.mpi is None:
        return world.size
    executable, args = spawn_command()
    infos = []
    for offset in range(missing):
        info = MPI.Info.Create()
        info.Set("wdir", os.getcwd())
        # Like the job it joins: a rank that dies does not end the others.
        info.Set("PMIX_JOB_RECOVERABLE", "true")
        info.Set("PMIX_ENVAR", f"{processes.REPLACEMENT_VARIABLE}=1\n"
                               f"KDIST_RANK_TAG={world.size + offset}")
        infos.append(info)
    try:
        joined = world.mpi.Spawn_multiple([executable] * missing, [args] * missing,
                                          [1] * missing, infos, root=0)
    except MPI.Exception as error:
        logger.warning("Could not start %d rank(s) to replace the lost ones (%s); carrying "
                       "on with %d.", missing, error, world.size)
        return world.size
    finally:
        for info in infos:
            info.Free()
    # Merge, then a copy of its own: the same steps as kdist.init() on the new ranks.
    try:
        merged = joined.Merge(high=False).Dup()
    except MPI.Exception as error:
        logger.warning("The rank(s) started to replace lost ones died before joining (%s); "
                       "carrying on with %d.", error, world.size)
        return world.size
    ending.mark_joined()
    processes.replace_world(merged)
    logger.warning("started %d rank(s) to replace lost ones; carrying on with %d.",
                   missing, world.size)
    return world.size
