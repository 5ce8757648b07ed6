"""The wire protocol of every kdist collective, on the Python side.

Each collective is announced before it moves data: every rank that takes part
contributes a header `[active, kind, dtype, op, count, root]` and its negation,
and every rank takes the maximum of the 12 int64 values over the ranks, by
dissemination (`disseminate_max`: ceil(log2 size) rounds of one message each way,
so that the last rank to arrive finishes at once). The maxima and minima say what
the active ranks are about to do and whether they agree:

- ranks that disagree (another model, another step pattern, tensors of
  other shapes) all see it at once, gather each other's descriptions and
  raise the same `CollectiveMismatch`, instead of exchanging buffers of
  different sizes (a truncation error) or waiting for ever;
- a rank that has joined (`kdist.join`: it ran out of data) sends no header
  of its own, reads what the others announce, and takes part in the payload
  with neutral values (zeros for a sum), whatever the step pattern.

kdist/comm/native/engine.cc implements the same protocol in C++ for the ops
that run inside TensorFlow graphs and XLA programs. The payload of each kind:

- ALLREDUCE: `MPI_Allreduce` of `count` elements; `root` is a key of the shapes
  of the tensors packed in the message (`shapes_key`; 0 under XLA), so tensors of
  the same size in other shapes are a mismatch too;
- ALLGATHER: `MPI_Allgather` of each rank's row count (int64), then
  `MPI_Allgatherv` of bytes (`count` is the number of elements per row);
- BROADCAST: `MPI_Bcast` of `count` elements from `root`;
- BARRIER: `MPI_Barrier`;
- OBJECT_ALLGATHER, OBJECT_BROADCAST: mpi4py's pickled `allgather` / `bcast`;
- ALLTOALL: `MPI_Alltoall` of row counts (int64), then `MPI_Alltoallv` of bytes;
- LEAVE: announced by each rank of a world of several as its process ends
  (`kdist.comm.leaving`), then mpi4py's pickled `allgather` of each rank's
  note. A rank still waiting in a collective sees the headers differ and
  fails at once with `CollectiveMismatch`, naming the rank that left and why.
"""

import functools
import time

import numpy as np

from kdist.comm import watchdog

HEADER_SIZE = 6

ALLREDUCE = 1
ALLGATHER = 2
BROADCAST = 3
BARRIER = 4
OBJECT_ALLGATHER = 5
OBJECT_BROADCAST = 6
ALLTOALL = 7
LEAVE = 8

SUM = 1
MIN = 2
MAX = 3
PRODUCT = 4

# TensorFlow's DataType numbers, shared with the C++ engine.
DTYPE_CODES = {
    "float32": 1, "float64": 2, "int32": 3, "uint8": 4, "int16": 5, "int8": 6, "int64": 9,
    "bool": 10, "bfloat16": 14, "uint16": 17, "float16": 19, "uint32": 22, "uint64": 23,
}
_DTYPE_NAMES = {code: name for name, code in DTYPE_CODES.items()}
_KIND_NAMES = {ALLREDUCE: "allreduce", ALLGATHER: "allgather", BROADCAST: "broadcast",
               BARRIER: "barrier", OBJECT_ALLGATHER: "allgather_object",
               OBJECT_BROADCAST: "broadcast_object", ALLTOALL: "alltoall",
               LEAVE: "leaving the job"}
_INACTIVE = np.iinfo(np.int64).min


class CollectiveMismatch(ValueError):
    """The error every rank raises when the ranks started different collectives.

    Every collective is announced before it moves data, so ranks that start different
    ones (another kind, dtype, reduction, number of elements, shapes or root) all fail
    at once, instead of exchanging buffers of different sizes or waiting for ever. The
    message lists what each rank ran:

    ```text
    kdist: the ranks are not running the same collective (seen by rank 0):
      rank 0: allreduce (sum) of 3 float32 values
      rank 1: allreduce (sum) of 4 float32 values
    Every rank must run the same collectives in the same order. Usually a rank left a
    loop early (a callback stopped its fit on that rank alone: pass fit's callbacks
    through kdist.callbacks.Agreement().around(...); or it ran out of data: see
    kdist.join) or ended its script; otherwise build the same model on every rank,
    give tensors the same shapes and dtypes, and use the same step pattern on all ranks.
    ```

    A rank whose script has ended shows as `leaving the job: its script ended`,
    followed by how its last `fit` ended when kdist saw it (`its last fit stopped after
    epoch 2 of 40: EarlyStopping set stop_training`); see "A rank that leaves early"
    in the reliability guide.

    It is raised as it is for numpy arrays and objects. For tensors the error is
    TensorFlow's `tf.errors.FailedPreconditionError`, as Horovod's ops raise: from
    kdist's C++ ops, and, eagerly, from collectives that run in Python (`alltoall`, or
    any collective where the C++ ops cannot be built), where the error is both a
    `CollectiveMismatch` and a `FailedPreconditionError`. A py-function op inside a
    graph turns it into `tf.errors.InvalidArgumentError`. Either way every rank raises
    it, and the ranks can go on with their next collective.
    """


def _mpi():
    from mpi4py import MPI

    return MPI


def dtype_code(dtype):
    """kdist's code for a numpy dtype (TensorFlow's DataType number)."""
    name = np.dtype(dtype).name
    if name not in DTYPE_CODES:
        raise TypeError(f"kdist collectives move numeric and boolean values; got dtype {name}.")
    return DTYPE_CODES[name]


def numpy_dtype(code):
    name = _DTYPE_NAMES[int(code)]
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


_MASK_64 = (1 << 64) - 1


def _hash_values(values, seed):
    """64-bit FNV-1a over little-endian int64 values, kept to 62 bits (engine.cc's)."""
    digest = (seed & _MASK_64) ^ 14695981039346656037
    for value in values:
        value &= _MASK_64
        for byte in range(8):
            digest ^= (value >> (8 * byte)) & 0xFF
            digest = (digest * 1099511628211) & _MASK_64
    return digest & ((1 << 62) - 1)


@functools.lru_cache(maxsize=4096)
def shapes_key(shapes):
    """The key of the shapes one allreduce message carries (a tuple of shape tuples),
    announced in the header's `root` field, so that tensors of the same size in other
    shapes fail as a mismatch. The C++ engine computes the same keys."""
    keys = [_hash_values(shape, len(shape)) for shape in shapes]
    return _hash_values(keys, len(keys))


def describe(kind, dtype=0, op=0, count=0, root=0, label=""):
    """Words for a header, as error messages and the watchdog show it."""
    text = _KIND_NAMES.get(int(kind), f"collective {kind}")
    if kind == ALLREDUCE:
        text += f" ({['?', 'sum', 'min', 'max', 'product'][int(op)]}) of {count} " \
                f"{_DTYPE_NAMES.get(int(dtype), '?')} values"
    elif kind in (ALLGATHER, ALLTOALL):
        text += f" of rows of {count} {_DTYPE_NAMES.get(int(dtype), '?')} values"
    elif kind == BROADCAST:
        text = f"broadcast from rank {root} of {count} {_DTYPE_NAMES.get(int(dtype), '?')} values"
    elif kind == OBJECT_BROADCAST:
        text = f"broadcast_object from rank {root}"
    return text + (f" ({label})" if label else "")


def wait(request, what, state=None):
    """Completes an MPI request (or a list of them) without holding a core through a
    long wait.

    Peers usually arrive within microseconds, so it tests in a loop first;
    after a millisecond it sleeps between tests, with a growing pause, so a
    rank that waits for a slow peer leaves the core to processes that compute.
    `state` is what the watchdog reports of this wait (`watchdog.WAITING` by default).
    """
    done = request.Test if not isinstance(request, list) else (
        lambda: _mpi().Request.Testall(request))
    with watchdog.waiting(what, state or watchdog.WAITING):
        start = time.monotonic()
        pause = 20e-6
        while not done():
            if time.monotonic() - start > 1e-3:
                time.sleep(pause)
                pause = min(pause * 2, 1e-3)


ANNOUNCE_TAG = 7300  # + the round; the C++ engine's DisseminateMax uses the same


def disseminate_max(raw, values, what, state=None):
    """The element-wise maximum of int64 `values` over `raw`, in place: in round k each
    rank sends what it holds to rank + 2^k and keeps the maximum with what rank - 2^k
    sends (a maximum may count a rank twice), as kdist's C++ engine does."""
    size, rank = raw.Get_size(), raw.Get_rank()
    step, round_ = 1, 0
    while step < size:
        outgoing, incoming = values.copy(), np.empty_like(values)
        wait([raw.Irecv(incoming, source=(rank - step) % size, tag=ANNOUNCE_TAG + round_),
              raw.Isend(outgoing, dest=(rank + step) % size, tag=ANNOUNCE_TAG + round_)],
             what, state)
        np.maximum(values, incoming, out=values)
        step, round_ = step * 2, round_ + 1
    return values


def announce(raw, kind, dtype=0, op=0, count=0, root=0, what="", active=True, state=None):
    """Exchanges the header of the next collective on `raw` (an mpi4py communicator).

    Returns the active ranks' header, or None when no rank is active (every
    rank has joined). Raises `CollectiveMismatch` on every rank when the
    active ranks announced different collectives.
    """
    send = np.full(2 * HEADER_SIZE, _INACTIVE, dtype=np.int64)
    # The negated `active`: -1 from active ranks, 0 from joined ones, so its maximum
    # tells every rank whether all of them train (the C++ engine counts on it).
    send[HEADER_SIZE] = 0
    if active:
        header = np.array([1, kind, dtype, op, count, root], dtype=np.int64)
        send[:HEADER_SIZE] = header
        send[HEADER_SIZE:] = -header
    received = disseminate_max(raw, send.copy(), what or describe(kind, dtype, op, count, root),
                               state)
    if received[0] != 1:
        return None
    maxima, minima = received[1:HEADER_SIZE], received[HEADER_SIZE + 1:]
    if np.any(maxima != -minima):
        raise mismatch(raw, what or describe(kind, dtype, op, count, root))
    return received[:HEADER_SIZE]


# How this rank's last `fit` ended, when kdist's callbacks said so (see set_note).
_note = ""


def set_note(text):
    """Records one line on what this rank last did (\"its fit stopped after epoch 4 of
    10: EarlyStopping set stop_training\"), shown beside its collective when ranks
    disagree and when it leaves the job."""
    global _note
    _note = str(text or "")


def note():
    return _note


ADVICE = ("Every rank must run the same collectives in the same order. Usually a rank left "
          "a loop early (a callback stopped its fit on that rank alone: pass fit's "
          "callbacks through kdist.callbacks.Agreement().around(...); or it ran out of "
          "data: see kdist.join) or ended its script; otherwise build the same model on "
          "every rank, give tensors the same shapes and dtypes, and use the same step "
          "pattern on all ranks.")


def mismatch(raw, what):
    """Gathers every rank's description of its collective; returns the error to raise."""
    if _note and _note not in what:
        what = f"{what} [{_note}]"
    mine = what.encode()
    lengths = np.empty(raw.Get_size(), dtype=np.int64)
    raw.Allgather(np.array([len(mine)], dtype=np.int64), lengths)
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(int)
    everything = np.empty(max(int(lengths.sum()), 1), dtype=np.uint8)
    MPI = _mpi()
    raw.Allgatherv([np.frombuffer(mine, dtype=np.uint8), MPI.BYTE],
                   [everything, lengths.astype(int).tolist(), offsets.tolist(), MPI.BYTE])
    lines = [f"kdist: the ranks are not running the same collective (seen by rank "
             f"{raw.Get_rank()}):"]
    for rank, (start, length) in enumerate(zip(offsets, lengths)):
        lines.append(f"  rank {rank}: {everything[start:start + length].tobytes().decode()}")
    lines.append(ADVICE)
    return CollectiveMismatch("\n".join(lines))


def mpi_datatype(dtype):
    """The predefined MPI datatype that carries numpy `dtype` (16-bit floats as uint16)."""
    MPI = _mpi()
    return {
        "float32": MPI.FLOAT, "float64": MPI.DOUBLE, "int8": MPI.INT8_T, "int16": MPI.INT16_T,
        "int32": MPI.INT32_T, "int64": MPI.INT64_T, "uint8": MPI.UINT8_T,
        "uint16": MPI.UINT16_T, "uint32": MPI.UINT32_T, "uint64": MPI.UINT64_T,
        "bool": MPI.C_BOOL, "float16": MPI.UINT16_T, "bfloat16": MPI.UINT16_T,
    }[np.dtype(dtype).name]


def mpi_op(dtype, op):
    """The MPI operation that applies `op` to numpy `dtype`."""
    MPI = _mpi()
    name = np.dtype(dtype).name
    if name in ("float16", "bfloat16"):
        return _half_op(name, int(op))
    if name == "bool":
        return MPI.LAND if op in (MIN, PRODUCT) else MPI.LOR
    if op == SUM and name in ("int8", "uint8", "int16", "uint16"):
        return _wrapping_sum(name)
    return {SUM: MPI.SUM, MIN: MPI.MIN, MAX: MPI.MAX, PRODUCT: MPI.PROD}[int(op)]


@functools.lru_cache(maxsize=None)
def _wrapping_sum(name):
    """A sum of 8- or 16-bit integers that wraps around, as numpy's and Horovod's do: Open
    MPI 5's vectorised MPI_SUM (its op/avx component) saturates them."""
    dtype = np.dtype(name)

    def reduce(incoming, accumulated, datatype):
        a = np.frombuffer(accumulated, dtype=dtype)
        a += np.frombuffer(incoming, dtype=dtype)

    return _mpi().Op.Create(reduce, commute=True)


@functools.lru_cache(maxsize=None)
def _half_op(name, op):
    """A reduction of 16-bit floats, combined in float32 (MPI has no such type)."""
    dtype = numpy_dtype(DTYPE_CODES[name])
    combine = {SUM: np.add, MIN: np.minimum, MAX: np.maximum, PRODUCT: np.multiply}[op]

    def reduce(incoming, accumulated, datatype):
        a = np.frombuffer(accumulated, dtype=dtype)
        b = np.frombuffer(incoming, dtype=dtype)
        a[...] = combine(a.astype(np.float32), b.astype(np.float32)).astype(dtype)

    return _mpi().Op.Create(reduce, commute=True)


def neutral(dtype, op, count):
    """`count` values that leave a reduction with `op` unchanged."""
    dtype = np.dtype(dtype)
    if op == SUM:
        return np.zeros(count, dtype=dtype)
    if op == PRODUCT:
        return np.ones(count, dtype=dtype)
    if dtype == np.bool_:
        return np.full(count, op == MIN, dtype=dtype)
    if dtype.kind == "f" or dtype.name == "bfloat16":
        return np.full(count, np.inf if op == MIN else -np.inf, dtype=dtype)
    info = np.iinfo(dtype)
    return np.full(count, info.max if op == MIN else info.min, dtype=dtype)
