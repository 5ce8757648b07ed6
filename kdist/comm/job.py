"""Who this process is in the job, once `kdist.init()` has said so.

The state `kdist.comm.processes.init()` fills in, and the accessors every
layer reads it through. Kept apart from `processes` (which starts and stops
kdist) so that the modules `processes` starts (the watchdog, timeline, process
sets, the end-of-job logic) can read the world without importing it back.
"""

import threading

# Set by `kdist.comm.processes` on import: starts kdist on first use.
initialize = None


class _World:
    """Process-wide state filled in by `init()`."""

    def __init__(self):
        self.initialized = False
        self.world = None
        self.local = None
        self.cross = None
        self.watch = None
        self.hosts = []  # every rank's host name, by rank (an MPI job)
        self.thread_level = None
        # How many times the world changed since this process started (ranks
        # lost or replaced); a process that joined a running job starts at 1.
        self.generation = 0
        self.joined_late = False
        self.lock = threading.Lock()


_state = _World()


def _started():
    if not _state.initialized:
        initialize()
    return _state


def world_generation():
    """0 while the world is the one the job started with; larger once an
    elastic job lost or replaced ranks (or this process joined it late)."""
    return _state.generation


def joined_late():
    """Whether this process was started to replace a lost rank of a running job."""
    return _state.joined_late


def host_of(rank):
    """The host name of world rank `rank`, as that rank gave it at `kdist.init()` (or at
    the last change of the world); "?" when unknown."""
    hosts = _state.hosts
    return hosts[rank] if 0 <= rank < len(hosts) else "?"


def is_initialized():
    """True once `kdist.init()` has run (explicitly, or implicitly by the first function
    that needs the process world) and `kdist.shutdown()` has not run since."""
    return _state.initialized


def world():
    """The `kdist.comm.Communicator` of the whole job (kdist's own duplicate of the world
    communicator). Starts kdist on first use."""
    return _started().world


def local():
    """The `kdist.comm.Communicator` of the job's ranks on this node. Starts kdist on
    first use."""
    return _started().local


def cross():
    """The `kdist.comm.Communicator` of the ranks that have this rank's local rank, one on
    each node. Starts kdist on first use."""
    return _started().cross


def size():
    """The number of processes in the job. Starts kdist on first use."""
    return world().size


def rank():
    """This process's index in the job, from 0 to `size() - 1`. Starts kdist on first use."""
    return world().rank


def local_size():
    """The number of the job's processes on this node. Starts kdist on first use."""
    return local().size


def local_rank():
    """This process's index among the job's processes on this node, from 0 to
    `local_size() - 1`. Use it for anything there is one of per node: a GPU, a scratch
    directory. Starts kdist on first use."""
    return local().rank


def cross_size():
    """The number of nodes that hold a process with this process's local rank. Starts
    kdist on first use."""
    return cross().size


def cross_rank():
    """The index of this process's node among the `cross_size()` nodes that hold a process
    with this process's local rank. Starts kdist on first use."""
    return cross().rank
