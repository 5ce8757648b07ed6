"""The process world: who we are, who else there is, and how to reach them.

This is the only module that imports `mpi4py`. Everything above talks to a
`Communicator`, which wraps an MPI communicator or, when the script was not
started by an MPI launcher, stands in for a world of one process so that the
same script runs unchanged on a laptop.
"""

import logging
import os
import sys
import threading

import numpy as np

from kdist.comm.watchdog import Deadline

logger = logging.getLogger(__name__)

# Variables that MPI launchers (Open MPI, MPICH/Hydra, Intel MPI, PMIx, SLURM's
# srun with PMI) put in the environment of the processes they start.
_LAUNCHER_VARIABLES = (
    "OMPI_COMM_WORLD_SIZE",
    "PMIX_RANK",
    "PMI_SIZE",
    "PMI_RANK",
    "MPI_LOCALNRANKS",
    "HYDRA_CONTROL_FD",
    "MV2_COMM_WORLD_SIZE",
)

Average = "average"
Sum = "sum"
Min = "min"
Max = "max"
Product = "product"
REDUCE_OPS = (Average, Sum, Min, Max, Product)


def launched_by_mpi(environ=None):
    """Returns True when an MPI launcher started this process."""
    environ = os.environ if environ is None else environ
    if environ.get("KDIST_FORCE_MPI", "") not in ("", "0"):
        return True
    if any(name in environ for name in _LAUNCHER_VARIABLES):
        return True
    # srun sets SLURM_STEP_ID for every task; PMI variables are then present
    # too when MPI is used, but srun --mpi=none still gives one task per rank.
    return ("SLURM_STEP_ID" in environ
            and int(environ.get("SLURM_STEP_NUM_TASKS", "1") or 1) > 1)


class Communicator:
    """A group of processes that run collectives together.

    Wraps an `mpi4py.MPI.Comm`, or nothing for a world of one process. All
    methods take and return numpy arrays; `kdist.comm.collectives` adds the
    TensorFlow side.
    """

    def __init__(self, mpi_comm=None):
        self._comm = mpi_comm
        self.rank = 0 if mpi_comm is None else mpi_comm.Get_rank()
        self.size = 1 if mpi_comm is None else mpi_comm.Get_size()
        # One collective at a time per communicator: TensorFlow may run two
        # py-function ops on different inter-op threads, and MPI requires every
        # rank to issue collectives on a communicator in the same order.
        self.lock = threading.RLock()

    @property
    def mpi(self):
        """The underlying `mpi4py.MPI.Comm`, or None in a world of one."""
        return self._comm

    @property
    def fortran_handle(self):
        """The communicator's MPI Fortran handle, which C and C++ code can convert back."""
        return None if self._comm is None else self._comm.py2f()

    def split(self, color, key=None):
        """Returns the sub-communicator of the ranks that passed the same color."""
        if self._comm is None:
            return Communicator(None)
        return Communicator(self._comm.Split(int(color), self.rank if key is None else int(key)))

    def shrink(self):
        """The communicator of the ranks still alive (Open MPI with `--with-ft ulfm`).

        Every surviving rank must call it. Without failures it is a copy.
        """
        if self._comm is None:
            return Communicator(None)
        return Communicator(self._comm.Shrink())

    def barrier(self):
        if self._comm is not None:
            with self.lock, Deadline.guard("barrier"):
                self._comm.Barrier()

    def allreduce_(self, array, op=Sum):
        """Reduces a contiguous numpy array in place across the group."""
        if self._comm is None:
            return array
        mpi = _mpi()
        mpi_op = _mpi_op(op)
        with self.lock, Deadline.guard("allreduce"):
            self._comm.Allreduce(mpi.IN_PLACE, array, op=mpi_op)
        if op == Average:
            np.divide(array, self.size, out=array, casting="unsafe")
        return array

    def allreduce_into(self, send, recv, op=Sum):
        """Reduces contiguous `send` across the group into `recv` (same shape)."""
        if op == Average:
            raise ValueError("allreduce_into sums; divide the result, or use allreduce_.")
        if self._comm is None:
            np.copyto(recv, send)
        else:
            mpi_op = _mpi_op(op)
            with self.lock, Deadline.guard("allreduce"):
                self._comm.Allreduce(send, recv, op=mpi_op)
        return recv

    def allreduce_op_(self, array, mpi_op, datatype):
        """In-place allreduce with a user-defined MPI operation and datatype."""
        if self._comm is None:
            return array
        mpi = _mpi()
        with self.lock, Deadline.guard("allreduce"):
            self._comm.Allreduce(mpi.IN_PLACE, [array, datatype], op=mpi_op)
        return array

    def bcast_(self, array, root=0):
        """Broadcasts a contiguous numpy array in place from `root`."""
        if self._comm is not None:
            with self.lock, Deadline.guard("bcast"):
                self._comm.Bcast(array, root=root)
        return array

    def allgather_rows(self, array):
        """Concatenates arrays along axis 0; the first dimension may differ by rank."""
        if np.ndim(array) == 0:
            raise ValueError("allgather needs arrays of at least one dimension; got a scalar.")
        array = np.ascontiguousarray(array)
        if self._comm is None:
            return array.copy()
        shapes = self.allgather_object((array.shape, array.dtype.str))
        for other_rank, (shape, dtype) in enumerate(shapes):
            if shape[1:] != array.shape[1:] or dtype != array.dtype.str:
                raise ValueError(
                    f"allgather: rank {self.rank} has shape {array.shape} ({array.dtype}) but "
                    f"rank {other_rank} has {shape} ({np.dtype(dtype)}); only the first "
                    "dimension may differ between ranks."
                )
        row_bytes = array.dtype.itemsize * int(np.prod(array.shape[1:], dtype=np.int64))
        counts = [shape[0] * row_bytes for shape, _ in shapes]
        displs = [0] + list(np.cumsum(counts)[:-1])
        out = np.empty((sum(s[0] for s, _ in shapes),) + array.shape[1:], dtype=array.dtype)
        MPI = _mpi()
        with self.lock, Deadline.guard("allgatherv"):
            self._comm.Allgatherv(
                [array.reshape(-1).view(np.uint8), MPI.BYTE],
                [out.reshape(-1).view(np.uint8), counts, [int(d) for d in displs], MPI.BYTE],
            )
        return out

    def allgather_object(self, obj):
        """Gathers one picklable object from every rank, in rank order."""
        if self._comm is None:
            return [obj]
        with self.lock, Deadline.guard("allgather"):
            return self._comm.allgather(obj)

    def bcast_object(self, obj, root=0):
        if self._comm is None:
            return obj
        with self.lock, Deadline.guard("bcast"):
            return self._comm.bcast(obj, root=root)

    def abort(self, code=1):
        if self._comm is not None:
            self._comm.Abort(code)
        os._exit(code)


class _World:
    """Process-wide state filled in by `init()`."""

    def __init__(self):
        self.initialized = False
        self.world = None
        self.local = None
        self.cross = None
        self.lock = threading.Lock()


_state = _World()


def _mpi():
    from mpi4py import MPI

    return MPI


def _mpi_op(op):
    """The MPI reduction for a kdist op name (an average is a sum, divided afterwards)."""
    MPI = _mpi()
    return {Sum: MPI.SUM, Average: MPI.SUM, Min: MPI.MIN, Max: MPI.MAX, Product: MPI.PROD}[op]


def _import_mpi():
    try:
        import mpi4py
    except ImportError as error:
        raise ImportError(
            "This process was started by an MPI launcher but mpi4py is not installed. "
            "Install kdist's MPI extra: pip install 'kdist[mpi]'."
        ) from error
    # TensorFlow runs py-function ops on its own threads, so MPI must accept
    # calls from any thread. kdist serialises them per communicator.
    mpi4py.rc.thread_level = "multiple"
    from mpi4py import MPI

    return MPI


def init(comm=None):
    """Starts kdist on this process. Safe to call more than once.

    Args:
        comm: optional `mpi4py.MPI.Comm` (or a list of world ranks) to use as
            the world instead of `MPI.COMM_WORLD`, for programs that run kdist
            on a subset of their processes.

    Example:

    >>> import kdist
    >>> kdist.init()
    >>> kdist.rank(), kdist.size()
    (0, 1)
    """
    with _state.lock:
        if _state.initialized:
            if comm is not None:
                raise ValueError(
                    "kdist is already initialised (collectives and kdist.precision.enable "
                    "start it implicitly), so init(comm=...) cannot "
                    "change its world now. Call kdist.init(comm=...) first.")
            return
        mpi_comm = None
        if comm is not None or launched_by_mpi():
            MPI = _import_mpi()
            if comm is None:
                mpi_comm = MPI.COMM_WORLD
            elif isinstance(comm, (list, tuple)):
                # Every process of the job must take part in creating the group.
                group = MPI.COMM_WORLD.Get_group().Incl(list(comm))
                mpi_comm = MPI.COMM_WORLD.Create(group)
                if mpi_comm == MPI.COMM_NULL:
                    raise ValueError(
                        f"This process (world rank {MPI.COMM_WORLD.Get_rank()}) is not in "
                        f"the ranks {list(comm)} given to kdist.init(comm=...); only those "
                        "processes may use kdist.")
            else:
                mpi_comm = comm
            if comm is None:
                _check_not_a_lonely_task(mpi_comm.Get_size())
        world = Communicator(mpi_comm)
        if mpi_comm is None:
            local = Communicator(None)
            cross = Communicator(None)
        else:
            MPI = _mpi()
            local = Communicator(mpi_comm.Split_type(MPI.COMM_TYPE_SHARED, key=world.rank))
            cross = Communicator(mpi_comm.Split(local.rank, world.rank))
        _state.world, _state.local, _state.cross = world, local, cross
        _state.initialized = True
    from kdist.comm import watchdog

    watchdog.install_failure_handlers()
    _configure_logging()
    from kdist.comm import devices

    devices.configure(local)
    if world.size > 1:
        logger.debug("kdist started: rank %d of %d (local %d of %d)",
                     world.rank, world.size, local.rank, local.size)


def _check_not_a_lonely_task(world_size, environ=None):
    """Fails when srun started several tasks but MPI sees each as a world of one.

    That happens when srun's PMI plugin does not match the MPI library; the
    tasks would then train separate models without a word.
    """
    environ = os.environ if environ is None else environ
    tasks = int(environ.get("SLURM_STEP_NUM_TASKS", "1") or 1)
    if "SLURM_STEP_ID" in environ and tasks > 1 and world_size == 1:
        raise RuntimeError(
            f"srun started {tasks} tasks but MPI sees a world of 1 on this one: srun's PMI "
            "plugin does not match this MPI library. Run with `srun --mpi=pmix` (or the "
            "plugin your site documents), or use `mpiexec` inside the allocation.")


def shutdown():
    """Releases kdist's communicators. `init()` may be called again afterwards."""
    with _state.lock:
        if not _state.initialized:
            return
        for comm in (_state.cross, _state.local):
            if comm is not None and comm.mpi is not None:
                comm.mpi.Free()
        _state.world = _state.local = _state.cross = None
        _state.initialized = False


def is_initialized():
    return _state.initialized


def world():
    """The world `Communicator`, initialising kdist on first use."""
    if not _state.initialized:
        init()
    return _state.world


def local():
    if not _state.initialized:
        init()
    return _state.local


def cross():
    if not _state.initialized:
        init()
    return _state.cross


def size():
    """Number of processes in the job."""
    return world().size


def rank():
    """This process's index in the job, from 0 to `size() - 1`."""
    return world().rank


def local_size():
    """Number of processes of the job on this node."""
    return local().size


def local_rank():
    """This process's index among the job's processes on this node."""
    return local().rank


def cross_size():
    """Number of nodes that hold a process with this process's local rank."""
    return cross().size


def cross_rank():
    """Index of this process's node among those."""
    return cross().rank


def mpi_enabled():
    """True when kdist runs over MPI (even with one rank)."""
    return world().mpi is not None


def mpi_threads_supported():
    """True when the MPI library accepts calls from several threads."""
    if not mpi_enabled():
        return False
    MPI = _mpi()
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


class _RankFilter(logging.Filter):
    def filter(self, record):
        record.kdist_rank = _state.world.rank if _state.initialized else 0
        return True


def _configure_logging():
    """Gives kdist's loggers a rank prefix; only rank 0 speaks at INFO by default."""
    root = logging.getLogger("kdist")
    if getattr(root, "_kdist_configured", False):
        return
    root._kdist_configured = True
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_RankFilter())
    handler.setFormatter(logging.Formatter("[kdist %(kdist_rank)s] %(levelname)s %(message)s"))
    root.addHandler(handler)
    root.propagate = False
    level = os.environ.get("KDIST_LOG_LEVEL")
    if level:
        root.setLevel(level.upper())
    else:
        root.setLevel(logging.INFO if rank() == 0 else logging.WARNING)
