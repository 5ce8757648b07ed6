"""`Communicator`: a group of processes that run collectives together.

Every collective follows kdist's wire protocol (`kdist.comm.protocol`): it is
announced first, so ranks that disagree fail with one clear message and ranks
that have joined can take part in whatever the others run.
"""

import threading

import numpy as np

from kdist.comm import protocol
from kdist.comm import timeline
from kdist.comm import watchdog

Average = "average"
"""The sum divided by the number of ranks that contributed (ranks that have joined with
`kdist.join` do not count): the default of `kdist.allreduce` and `DistributedOptimizer`.
Integers are summed, divided by the number of ranks and truncated toward zero, as Horovod
averages them."""
Sum = "sum"
"""The element-wise sum over the ranks."""
Min = "min"
"""The element-wise minimum over the ranks (no gradient)."""
Max = "max"
"""The element-wise maximum over the ranks (no gradient)."""
Product = "product"
"""The element-wise product over the ranks (no gradient)."""
Adasum = "adasum"
"""Horovod's adaptive summation, which kdist does not implement: the name exists so that
Horovod scripts import, but `kdist.allreduce(op=kdist.Adasum)` and
`DistributedOptimizer(op=kdist.Adasum)` raise `ValueError`. Use `kdist.Average` or
`kdist.Sum`."""
REDUCE_OPS = (Average, Sum, Min, Max, Product)
_PROTOCOL_OPS = {Average: protocol.SUM, Sum: protocol.SUM, Min: protocol.MIN,
                 Max: protocol.MAX, Product: protocol.PRODUCT}


def reduce_op(op):
    """Checks a reduction name (numpy strings and Horovod's spellings too)."""
    name = str(op).lower() if op is not None else Average
    if name == Adasum:
        raise ValueError("Adasum is not available in kdist; use op=kdist.Average (the default) "
                         "or kdist.Sum.")
    if name not in REDUCE_OPS:
        raise ValueError(f"Unknown reduction op {op!r}; use one of kdist.Average, kdist.Sum, "
                         "kdist.Min, kdist.Max, kdist.Product.")
    return name


def protocol_op(op):
    return _PROTOCOL_OPS[reduce_op(op)]


class Communicator:
    """A group of processes that run collectives together.

    Wraps an `mpi4py.MPI.Comm`, or nothing for a world of one process. Its methods
    take and return numpy arrays; the top-level collectives (`kdist.allreduce`, ...)
    add the TensorFlow side and take a `Communicator` as `comm=` to run on its ranks
    instead of the world's. `kdist.comm.world()`, `local()` and `cross()` return
    kdist's own; `split` and `create` make sub-communicators.

    Every rank of the group must call each collective method, in the same order.
    Each is announced first (see `kdist.comm.CollectiveMismatch`) and shows in stall
    reports while it waits; the array methods take a `label` that names them there
    and in error messages. Collectives on one communicator run one at a time, guarded
    by its `lock`, because TensorFlow may call them from several threads. Copies
    (`copy.copy`, `copy.deepcopy`) are the same object: a handle on a group of
    processes.

    A communicator of the even ranks and one of the odd ones (every rank calls
    `split`):

    ```python
    sub = kdist.comm.world().split(color=kdist.rank() % 2)
    total = kdist.allreduce(np.array([1.0]), op=kdist.Sum, comm=sub)
    ```

    Args:
        mpi_comm: the `mpi4py.MPI.Comm` to wrap; None for a world of one process.

    Attributes:
        rank: this process's index in the group.
        size: the number of processes in the group.
        lock: the reentrant lock that each collective holds while it runs.
    """

    def __init__(self, mpi_comm=None):
        self._comm = mpi_comm
        self.rank = 0 if mpi_comm is None else mpi_comm.Get_rank()
        self.size = 1 if mpi_comm is None else mpi_comm.Get_size()
        # One collective at a time per communicator: TensorFlow may run two
        # py-function ops on different threads.
        self.lock = threading.RLock()
        self._packed = {}  # dtype -> the reusable buffer of allreduce_many

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        # A handle on a group of processes: copies of callbacks and optimizers
        # (keras-tuner deep-copies the callbacks of each trial) talk to the same ranks.
        return self

    @property
    def mpi(self):
        """The underlying `mpi4py.MPI.Comm`, or None in a world of one."""
        return self._comm

    @property
    def fortran_handle(self):
        """The communicator's MPI Fortran handle, an integer that C and C++ code can convert
        back (kdist's C++ ops take it as their `comm`); None in a world of one."""
        return None if self._comm is None else self._comm.py2f()

    def split(self, color, key=None):
        """Returns the sub-communicator of the ranks that passed the same `color`.

        Its ranks are ordered by `key` (default: this rank in this group). Every rank of
        the group must call it.
        """
        if self._comm is None:
            return Communicator(None)
        with self.lock:
            return Communicator(self._comm.Split(int(color),
                                                 self.rank if key is None else int(key)))

    def create(self, ranks):
        """The communicator of `ranks` (ranks of this group), or None on the ranks that
        are not among them. Every rank of the group must call it."""
        if self._comm is None:
            return Communicator(None)
        with self.lock:
            group = self._comm.Get_group().Incl([int(r) for r in ranks])
            created = self._comm.Create(group)
            group.Free()
        from mpi4py import MPI

        return None if created == MPI.COMM_NULL else Communicator(created)

    def shrink(self):
        """The communicator of the ranks still alive, under Open MPI's fault tolerance
        (`kdist run --fault-tolerant`, or `mpiexec --with-ft ulfm`).

        Every surviving rank must call it. Without failures it is a copy.
        """
        if self._comm is None:
            return Communicator(None)
        return Communicator(self._comm.Shrink())

    def adopt(self, mpi_comm):
        """Makes this object stand for `mpi_comm` from now on (after ranks died).

        Everything that holds this `Communicator` talks to the new group, graphs
        traced before included: their ops look the old handle up each time they run
        (kdist::CurrentComm). The old MPI communicator is kept, not freed, so that MPI
        never gives its handle to another.
        """
        from kdist.comm import native

        with self.lock:
            self._retire_queue()
            native.rebind_communicator(self.fortran_handle, mpi_comm.py2f())
            self._comm = mpi_comm
            self.rank = mpi_comm.Get_rank()
            self.size = mpi_comm.Get_size()
            self._packed = {}

    def free(self):
        """Releases the MPI communicator (no collective works on this object afterwards)."""
        if self._comm is not None:
            from kdist.comm import native

            self._retire_queue()
            native.forget_communicator(self.fortran_handle)
            self._comm.Free()
            self._comm = None

    def _retire_queue(self):
        # Graph ops reach the C++ fusion queue by handle, which MPI reuses.
        from kdist.comm import native

        native.retire_fusion_queue(self.fortran_handle)

    # -- collectives ---------------------------------------------------------------

    def _announce(self, kind, dtype=0, op=0, count=0, root=0, label=""):
        what = protocol.describe(kind, dtype, op, count, root, label)
        with timeline.span("negotiate", what):
            protocol.announce(self._comm, kind, dtype, op, count, root, what)

    def barrier(self):
        """Returns when every rank of the group has called it."""
        if self._comm is None:
            return
        with self.lock:
            self._announce(protocol.BARRIER)
            with watchdog.waiting("barrier", watchdog.MOVING), \
                    timeline.span("barrier", "barrier"):
                self._comm.Barrier()

    def allreduce_(self, array, op=Sum, label=""):
        """Reduces a C-contiguous numpy array in place across the group; returns it.

        Note that the default here is `Sum`, not `kdist.allreduce`'s `Average`. `Average`
        divides by the number of ranks that contributed (ranks that have joined with
        `kdist.join` are not counted) and needs floating values (`TypeError`
        otherwise). An array that is not C-contiguous raises `ValueError`.
        """
        op = reduce_op(op)
        if not array.flags.c_contiguous:
            raise ValueError("allreduce_ works in place on C-contiguous arrays; pass "
                             "numpy.ascontiguousarray(array).")
        if self._comm is None:
            return array
        if op == Average:
            if array.dtype.kind != "f" and array.dtype.name != "bfloat16":
                raise TypeError(f"Averaging needs floating values; got {array.dtype}. "
                                "Use op=kdist.Sum, or convert to float first.")
            result = self.allreduce_many([array], average=True, label=label)[0]
            np.copyto(array, result.reshape(array.shape))
            return array
        self._allreduce_flat(array.reshape(-1), protocol_op(op), label, (array.shape,))
        return array

    def _allreduce_flat(self, flat, op, label, shapes):
        """Reduces `flat`, which packs arrays of `shapes`, announcing their shapes' key."""
        dtype = protocol.dtype_code(flat.dtype)
        shapes = tuple(tuple(int(d) for d in shape) for shape in shapes)
        described = label
        if len(shapes) > 1 or any(len(shape) > 1 for shape in shapes):
            # One flat array's shape says no more than the count already does.
            named = [list(shape) for shape in shapes[:8]]
            described = f"{label + ', ' if label else ''}shapes {named}" + (
                " ..." if len(shapes) > 8 else "")
        with self.lock:
            self._announce(protocol.ALLREDUCE, dtype, op, flat.size,
                           protocol.shapes_key(shapes), label=described)
            what = protocol.describe(protocol.ALLREDUCE, dtype, op, flat.size, label=label)
            with watchdog.waiting(what, watchdog.MOVING), \
                    timeline.span("allreduce", what, flat.nbytes):
                self._comm.Allreduce(_mpi().IN_PLACE,
                                     [flat, protocol.mpi_datatype(flat.dtype)],
                                     op=protocol.mpi_op(flat.dtype, op))

    def allreduce_many(self, arrays, op=Sum, average=False, prescale=1.0, postscale=1.0,
                       label=""):
        """Reduces a list of arrays of one dtype in one collective.

        Returns new arrays: `reduce(a * prescale) * postscale`, divided by the
        number of contributing ranks with `average`. Arrays of several dtypes raise
        `TypeError`, and so does averaging or scaling values that are not floating.
        """
        arrays = [np.asarray(a) for a in arrays]
        dtype = arrays[0].dtype if arrays else np.dtype(np.float32)
        if any(a.dtype != dtype for a in arrays):
            raise TypeError("allreduce_many needs arrays of one dtype; got "
                            f"{sorted({a.dtype.name for a in arrays})}.")
        scaled = (prescale != 1.0 or postscale != 1.0 or average)
        if scaled and dtype.kind != "f" and dtype.name != "bfloat16":
            raise TypeError(f"Averaging or scaling needs floating values; got {dtype}.")
        sizes = [a.size for a in arrays]
        total = sum(sizes) + (1 if average else 0)
        results = [np.empty(a.shape, dtype) for a in arrays]
        with self.lock:
            # One buffer, kept: a fresh one each call costs page faults, and MPI
            # registers new memory again, several times the reduction itself.
            packed = self._pack_buffer(dtype, total)
            offset = 0
            with timeline.span("pack", label, packed.nbytes):
                for a, n in zip(arrays, sizes):
                    if prescale == 1.0:
                        np.copyto(packed[offset:offset + n], a.reshape(-1))
                    else:
                        np.multiply(a.reshape(-1), prescale, out=packed[offset:offset + n],
                                    casting="unsafe")
                    offset += n
            if average:
                packed[-1] = 1
            if self._comm is not None:
                self._allreduce_flat(packed, protocol_op(op), label,
                                     tuple(a.shape for a in arrays))
            factor = postscale
            if average:
                contributors = float(packed[-1])
                factor = postscale / contributors if contributors > 0 else postscale
            # Half floats scale through float32, which rounds once.
            wide = np.float32 if dtype.itemsize < 4 else None
            offset = 0
            with timeline.span("unpack", label, packed.nbytes):
                for result, n in zip(results, sizes):
                    part = packed[offset:offset + n]
                    if factor == 1.0:
                        np.copyto(result.reshape(-1), part)
                    elif wide is None:
                        np.multiply(part, factor, out=result.reshape(-1), casting="unsafe")
                    else:
                        np.multiply(part.astype(wide), factor, out=result.reshape(-1),
                                    casting="unsafe")
                    offset += n
        return results

    def _pack_buffer(self, dtype, count):
        buffer = self._packed.get(dtype)
        if buffer is None or buffer.size < count:
            buffer = self._packed[dtype] = np.empty(max(count, 1), dtype)
        return buffer[:count]

    def bcast_(self, array, root=0, label=""):
        """Broadcasts a contiguous numpy array in place from rank `root`; returns it.

        A `root` that is not a rank of the group raises `ValueError`, one that is not
        an integer `TypeError`.
        """
        self._check_root(root)
        if self._comm is None:
            return array
        flat = array.reshape(-1)
        dtype = protocol.dtype_code(flat.dtype)
        with self.lock:
            self._announce(protocol.BROADCAST, dtype, 0, flat.size, root, label)
            with watchdog.waiting(f"broadcast from rank {root}", watchdog.MOVING), \
                    timeline.span("broadcast", label, flat.nbytes):
                self._comm.Bcast([flat, protocol.mpi_datatype(flat.dtype)], root=root)
        return array

    def allgather_rows(self, array, label=""):
        """Concatenates every rank's array along axis 0, in rank order.

        The first dimension may differ by rank; the others and the dtype must not.
        Scalars raise `ValueError`.
        """
        if np.ndim(array) == 0:
            raise ValueError("allgather needs arrays of at least one dimension; got a scalar.")
        array = np.ascontiguousarray(array)
        if self._comm is None:
            return array.copy()
        row_elements = int(np.prod(array.shape[1:], dtype=np.int64))
        dtype = protocol.dtype_code(array.dtype)
        with self.lock:
            self._announce(protocol.ALLGATHER, dtype, 0, row_elements, label=label)
            with watchdog.waiting("allgather", watchdog.MOVING), \
                    timeline.span("allgather", label, array.nbytes):
                counts = np.empty(self.size, dtype=np.int64)
                self._comm.Allgather(np.array([array.shape[0]], dtype=np.int64), counts)
                out = np.empty((int(counts.sum()),) + array.shape[1:], dtype=array.dtype)
                row_bytes = array.dtype.itemsize * row_elements
                _allgatherv_bytes(self._comm, array, out, counts * row_bytes)
        return out

    def alltoallv(self, array, splits, label=""):
        """Sends `splits[i]` consecutive rows of `array` to rank i.

        Returns `(received, received_splits)`: the rows received, in rank order, and how
        many came from each rank. `splits` must hold one non-negative count per rank,
        adding up to the number of rows (`ValueError` otherwise).
        """
        array = np.ascontiguousarray(array)
        splits = np.asarray(splits, dtype=np.int64).reshape(-1)
        if splits.size != self.size or (splits < 0).any() or splits.sum() != array.shape[0]:
            raise ValueError(f"alltoall: splits must give one non-negative row count per rank "
                             f"({self.size}) adding up to the {array.shape[0]} rows of the "
                             f"tensor; got {splits.tolist()}.")
        if self._comm is None:
            return array.copy(), splits.copy()
        row_elements = int(np.prod(array.shape[1:], dtype=np.int64))
        dtype = protocol.dtype_code(array.dtype)
        with self.lock:
            self._announce(protocol.ALLTOALL, dtype, 0, row_elements, label=label)
            with watchdog.waiting("alltoall", watchdog.MOVING), \
                    timeline.span("alltoall", label, array.nbytes):
                received = np.empty(self.size, dtype=np.int64)
                self._comm.Alltoall(splits, received)
                out = np.empty((int(received.sum()),) + array.shape[1:], dtype=array.dtype)
                row_bytes = array.dtype.itemsize * row_elements
                _alltoallv_bytes(self._comm, array, splits * row_bytes, out,
                                 received * row_bytes)
        return out, received

    def allgather_object(self, obj):
        """Gathers one picklable object from every rank, in rank order."""
        if self._comm is None:
            return [obj]
        with self.lock:
            self._announce(protocol.OBJECT_ALLGATHER)
            with watchdog.waiting("allgather_object", watchdog.MOVING), \
                    timeline.span("allgather_object", type(obj).__name__):
                return self._comm.allgather(obj)

    def bcast_object(self, obj, root=0):
        """Returns rank `root`'s picklable object on every rank of the group."""
        self._check_root(root)
        if self._comm is None:
            return obj
        with self.lock:
            self._announce(protocol.OBJECT_BROADCAST, root=root)
            with watchdog.waiting(f"broadcast_object from rank {root}", watchdog.MOVING), \
                    timeline.span("broadcast_object", type(obj).__name__):
                return self._comm.bcast(obj, root=root)

    def _check_root(self, root):
        if not isinstance(root, (int, np.integer)) or isinstance(root, bool):
            raise TypeError(f"root_rank must be an integer rank; got {root!r}.")
        if not 0 <= int(root) < self.size:
            raise ValueError(f"root_rank={root} is not a rank of this group "
                             f"(ranks 0 to {self.size - 1}).")

    def abort(self, code=1):
        """Ends every process of the job (`MPI_Abort`) with exit code `code`. To say why
        as well, use `kdist.comm.abort`."""
        if self._comm is not None:
            self._comm.Abort(code)
        import os

        os._exit(code)


def _mpi():
    from mpi4py import MPI

    return MPI


def _allgatherv_bytes(raw, send, out, byte_counts):
    MPI = _mpi()
    offsets = np.concatenate([[0], np.cumsum(byte_counts)[:-1]])
    raw.Allgatherv([send.reshape(-1).view(np.uint8), MPI.BYTE],
                   [out.reshape(-1).view(np.uint8), byte_counts.tolist(), offsets.tolist(),
                    MPI.BYTE])


def _alltoallv_bytes(raw, send, send_bytes, out, receive_bytes):
    MPI = _mpi()
    send_offsets = np.concatenate([[0], np.cumsum(send_bytes)[:-1]])
    receive_offsets = np.concatenate([[0], np.cumsum(receive_bytes)[:-1]])
    raw.Alltoallv([send.reshape(-1).view(np.uint8), send_bytes.tolist(),
                   send_offsets.tolist(), MPI.BYTE],
                  [out.reshape(-1).view(np.uint8), receive_bytes.tolist(),
                   receive_offsets.tolist(), MPI.BYTE])
