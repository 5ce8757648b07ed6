"""Process sets: collectives on a subset of the ranks, named as in Horovod.

A `ProcessSet` lists world ranks. Once registered (`init(process_sets=[...])`
or `add_process_set`, which every rank of the job calls), every collective
takes `process_set=` and runs among its ranks only, on a communicator of their
own.

Example:

    >>> import kdist
    >>> kdist.global_process_set.size() == kdist.size()
    True
"""

import threading

from kdist.comm import job

_lock = threading.Lock()
_registered = {}  # id -> ProcessSet
_next_id = [1]


class ProcessSet:
    """A set of world ranks that can run collectives on their own.

    Args:
        ranks_or_comm: a list of world ranks, or an mpi4py communicator whose
            processes form the set.
    """

    def __init__(self, ranks_or_comm):
        self.process_set_id = None
        self.mpi_comm = None
        if hasattr(ranks_or_comm, "Get_group"):
            self.mpi_comm = ranks_or_comm
            self.ranks = None
        else:
            ranks = [int(r) for r in ranks_or_comm]
            if not ranks or len(set(ranks)) != len(ranks):
                raise ValueError(f"A process set needs distinct ranks; got {list(ranks_or_comm)}.")
            self.ranks = sorted(ranks)
        self._comm = None

    def size(self):
        """How many ranks the set has (None before it is registered)."""
        return None if self.ranks is None else len(self.ranks)

    def rank(self):
        """This process's rank within the set (None if it is not in the set or not registered)."""
        if self.ranks is None or job.rank() not in self.ranks:
            return None
        return self.ranks.index(job.rank())

    def included(self):
        """Whether this process is in the set (None before it is registered)."""
        return None if self.ranks is None else job.rank() in self.ranks

    def __eq__(self, other):
        return isinstance(other, ProcessSet) and self.ranks == other.ranks and (
            self.ranks is not None or self.mpi_comm is other.mpi_comm)

    def __hash__(self):
        return hash(tuple(self.ranks or ()))

    def __repr__(self):
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


class _GlobalProcessSet(ProcessSet):
    """Every rank of the job; always registered, with id 0."""

    def __init__(self):
        self.process_set_id = 0
        self.mpi_comm = None
        self._comm = None

    @property
    def ranks(self):
        return list(range(job.size()))

    def size(self):
        return job.size()

    def rank(self):
        return job.rank()

    def included(self):
        return True


global_process_set = _GlobalProcessSet()


def add_process_set(process_set):
    """Registers a process set (a `ProcessSet` or a list of ranks) and returns it.

    Every rank of the job must call it, in the same order, even ranks that
    are not in the set.
    """
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    world = job.world()
    if process_set.ranks is None:
        from mpi4py import MPI

        inside = process_set.mpi_comm != MPI.COMM_NULL
        ranks = world.allgather_object(job.rank() if inside else None)
        process_set.ranks = sorted(r for r in ranks if r is not None)
    bad = [r for r in process_set.ranks if not 0 <= r < world.size]
    if bad:
        raise ValueError(f"Process set ranks {bad} are not ranks of this job "
                         f"(0 to {world.size - 1}).")
    with _lock:
        if any(p.ranks == process_set.ranks for p in _registered.values()) or \
                process_set.ranks == global_process_set.ranks:
            raise ValueError(f"A process set with ranks {process_set.ranks} is already "
                             "registered.")
        process_set.process_set_id = _next_id[0]
        _next_id[0] += 1
        _registered[process_set.process_set_id] = process_set
    process_set._comm = world.create(process_set.ranks)
    return process_set


def remove_process_set(process_set):
    """Unregisters a process set; returns whether it was registered. Every rank calls it."""
    with _lock:
        registered = _registered.pop(getattr(process_set, "process_set_id", None), None)
    if registered is None or registered is global_process_set:
        return False
    if registered._comm is not None:
        registered._comm.free()
        registered._comm = None
    registered.process_set_id = None
    return True


def remove_all():
    """Unregisters every process set but the global one (`kdist.shutdown` does): a job
    started again with `kdist.init()` begins with the global set alone, as Horovod's does."""
    with _lock:
        sets = list(_registered.values())
        _registered.clear()
        _next_id[0] = 1
    for process_set in sets:
        if process_set._comm is not None:
            process_set._comm.free()
            process_set._comm = None
        process_set.process_set_id = None


def registered(process_set_id):
    """The registered process set with this id (0 is the global set), or None."""
    if process_set_id == 0:
        return global_process_set
    with _lock:
        return _registered.get(process_set_id)


def not_in_set_error(message):
    """The error for a collective on a process set by a rank outside it: TensorFlow's
    `InvalidArgumentError`, as Horovod raises, which is also a `ValueError` (and a plain
    `ValueError` in a program without TensorFlow)."""
    import sys

    tf = sys.modules.get("tensorflow")
    if tf is None:
        return ValueError(message)
    if "class" not in _not_in_set:
        class NotInProcessSet(tf.errors.InvalidArgumentError, ValueError):
            """A collective on a process set, run by a rank outside it."""

        _not_in_set["class"] = NotInProcessSet
    return _not_in_set["class"](None, None, message)


_not_in_set = {}


def communicator_of(process_set, outside=None):
    """The `Communicator` a collective on `process_set` runs on, on this rank.

    On a rank outside the set: `outside` if given (a gradient reduction gives such a rank
    a world of its own, keeping its own gradients, as Horovod's tape does), else the
    error of `not_in_set_error`."""
    if process_set is global_process_set or isinstance(process_set, _GlobalProcessSet):
        return job.world()
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"process_set must be a kdist.ProcessSet; got "
                        f"{type(process_set).__name__}.")
    if process_set.process_set_id not in _registered:
        raise ValueError(f"{process_set} is not registered: call kdist.add_process_set(...) on "
                         "every rank first (or pass it to kdist.init(process_sets=[...])).")
    if process_set._comm is None:
        if outside is not None:
            return outside
        raise not_in_set_error(f"Rank {job.rank()} is not in {process_set}; only its ranks "
                               f"({process_set.ranks}) may run collectives on it.")
    return process_set._comm
