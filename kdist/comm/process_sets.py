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
    """A set of world ranks that can run collectives on a communicator of their own.

    Register it on every rank (`kdist.add_process_set`, or
    `kdist.init(process_sets=[...])`), then pass it as `process_set=` to the
    collectives, `DistributedOptimizer` and the other reducers to run among its ranks
    only. A collective on a set that is not registered raises `ValueError`; one run on
    a rank outside the set raises TensorFlow's `InvalidArgumentError`, as Horovod does,
    which is also a `ValueError` (a plain `ValueError` in a program without
    TensorFlow). A `process_set` that is not a `ProcessSet` raises `TypeError`.

    A set made from a communicator learns its ranks when it is registered; before
    that, `size()` and `included()` return None.

    Every rank registers a set, ranks outside it too:

    ```python
    evens = kdist.add_process_set(list(range(0, kdist.size(), 2)))
    if evens.included():
        total = kdist.allreduce(np.ones(2), op=kdist.Sum, process_set=evens)
    ```

    Args:
        ranks_or_comm: a list of distinct world ranks (an empty list or a repeated
            rank raises `ValueError`), or an `mpi4py` communicator whose processes form
            the set (on the ranks outside it, `MPI.COMM_NULL`).

    Attributes:
        ranks: the set's world ranks, sorted (None for a set made from a communicator,
            until it is registered).
        process_set_id: the id given when it is registered (None before, and after
            `kdist.remove_process_set`); 0 is the global set's.

    Example:

        The global set is there from the start:

        >>> import kdist
        >>> kdist.global_process_set.size() == kdist.size()
        True
        >>> kdist.global_process_set.process_set_id
        0
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
"""The process set of every rank of the job, registered from the start with id 0.
Collectives given it (or no `process_set`) run on the whole world."""


def add_process_set(process_set):
    """Registers a process set (a `ProcessSet` or a list of ranks) and returns it.

    Every rank of the job must call it, in the same order, even ranks that
    are not in the set. It may be called at any time, not only at `kdist.init()`.
    Ranks that are not ranks of the job, or the ranks of a set already registered
    (the global set's included), raise `ValueError`.
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
    """Unregisters a process set and frees its communicator. Every rank calls it.

    Returns whether it was registered (False for the global set, which stays).
    """
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
