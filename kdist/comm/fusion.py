"""Fused gradient allreduce: one collective per bucket of tensors, and join.

A model's gradients are many tensors; reducing each on its own pays MPI's
latency once per tensor. `FusedReducer` packs a bucket of tensors into one
persistent float32 buffer, reduces it with one collective, and hands back the
average. The buffer's extra last element counts the ranks that contributed, so
that a rank that ran out of data can `join()` and feed zeros until the others
finish, without deadlock and without biasing the average.
"""

import ctypes
import itertools
import logging
import sys
import threading

import numpy as np

from kdist.comm import compression as compression_lib
from kdist.comm import processes

logger = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 64 * 1024 * 1024
DIRECT_BYTES = 256 * 1024

_reducers = []  # every reducer that has reduced at least once, in order of first use
_reducers_lock = threading.Lock()
_ids = itertools.count()
_malloc_tuned = False


def _keep_large_buffers_in_heap():
    """Stops glibc from unmapping multi-megabyte buffers after every step.

    Gradient-sized temporaries (a few MB) are above glibc's default mmap
    threshold, so each step would map and fault in fresh pages; keeping them in
    the heap makes steady-state steps allocation-free.
    """
    global _malloc_tuned
    if _malloc_tuned or not sys.platform.startswith("linux"):
        return
    _malloc_tuned = True
    try:
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        libc.mallopt(m_mmap_threshold, 32 * 1024 * 1024)
        libc.mallopt(m_trim_threshold, 256 * 1024 * 1024)
    except (OSError, AttributeError):
        pass


def plan_buckets(sizes, bucket_bytes=DEFAULT_BUCKET_BYTES, itemsize=4):
    """Groups consecutive tensors into buckets of at most `bucket_bytes`.

    Returns a list of `(start, stop)` index ranges. A tensor larger than the
    bucket gets a bucket of its own.

    >>> plan_buckets([10, 10, 10], bucket_bytes=80)
    [(0, 2), (2, 3)]
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive; got {bucket_bytes}.")
    buckets, start, filled = [], 0, 0
    for i, n in enumerate(sizes):
        nbytes = int(n) * itemsize
        if i > start and filled + nbytes > bucket_bytes:
            buckets.append((start, i))
            start, filled = i, 0
        filled += nbytes
    if start < len(sizes):
        buckets.append((start, len(sizes)))
    return buckets


class _OutputRing:
    """Aligned result buffers that TensorFlow can wrap without copying.

    A py-function result that is a 64-byte-aligned numpy array becomes a
    tensor without a copy; the tensor then holds a reference to the array
    until it is freed. A buffer is reused only once nothing refers to it any
    more, so a result can never change under a tensor that still uses it.
    """

    def __init__(self, items, slots=3):
        self.items = items
        self.slots = slots
        self._entries = []  # [owner, float32 view, reference count when idle]

    def take(self):
        for entry in self._entries:
            if sys.getrefcount(entry[0]) <= entry[2]:
                return entry[1]
        owner = np.empty(self.items * 4 + 64, dtype=np.uint8)
        start = (-owner.ctypes.data) % 64
        view = owner[start:start + self.items * 4].view(np.float32)
        if len(self._entries) < self.slots:
            entry = [owner, view, 0]
            self._entries.append(entry)
            del owner
            entry[2] = sys.getrefcount(entry[0])
        return view


class FusedReducer:
    """Averages (or sums) lists of arrays across a communicator, bucket by bucket.

    Small arrays of a bucket are packed (pre-divided by the number of ranks)
    into one persistent send buffer and reduced with one collective; without
    compression, float32 arrays of at least `direct_bytes` skip the packing
    and are reduced straight from the caller's memory, since one more
    collective costs less than copying them. Results land in aligned buffers
    and come back as views shaped like the inputs.

    Args:
        comm: the `Communicator` to reduce over (the world by default).
        compression: a `Compression` mode.
        average: divide by the number of contributing ranks (else sum).
        direct_bytes: arrays this large or larger are not packed (no compression only).

    Example:

    >>> import numpy as np
    >>> from kdist.comm.fusion import FusedReducer
    >>> reducer = FusedReducer()
    >>> [a.shape for a in reducer.reduce(0, [np.ones((2, 2)), np.zeros(3)])]
    [(2, 2), (3,)]
    """

    def __init__(self, comm=None, compression=None, average=True, direct_bytes=DIRECT_BYTES):
        self.comm = comm if comm is not None else processes.world()
        self.compression = compression_lib.get(compression)
        self.average = average
        self.direct_bytes = direct_bytes
        self.id = next(_ids)
        self._send = {}
        self._rings = {}
        self._layouts = {}
        _keep_large_buffers_in_heap()

    def _is_direct(self, a):
        return (self.compression.name == "none" and a.dtype == np.float32
                and a.nbytes >= self.direct_bytes and a.flags.c_contiguous)

    def _ring(self, key, items):
        ring = self._rings.get(key)
        if ring is None or ring.items != items:
            ring = self._rings[key] = _OutputRing(items)
        return ring.take()

    def plan(self, bucket, arrays):
        """Records how `bucket` travels: the packed part, then each direct array.

        `join` replays this layout with zeros. `arrays` may be anything with
        `size`, `dtype` and `nbytes`-like shape information (numpy arrays, or
        `numpy.empty` stand-ins for tensors that another engine reduces).
        """
        direct = [self._is_direct(a) for a in arrays]
        packed_items = sum(int(a.size) for a, d in zip(arrays, direct) if not d)
        send = self._send.get(bucket)
        if send is None or send.shape[0] != packed_items + 1:
            send = self._send[bucket] = np.empty(packed_items + 1, dtype=np.float32)
        self._layouts[bucket] = [int(a.size) for a, d in zip(arrays, direct) if d]
        with _reducers_lock:
            if self not in _reducers:
                _reducers.append(self)
        return direct, packed_items, send

    def reduce(self, bucket, arrays):
        """Reduces one bucket of arrays; returns float32 arrays shaped like them."""
        direct, packed_items, send = self.plan(bucket, arrays)
        recv = self._ring((bucket, "packed"), packed_items + 1)
        size = self.comm.size
        scale = 1.0 / size if self.average else 1.0
        offset = 0
        for a, d in zip(arrays, direct):
            if d:
                continue
            n = int(a.size)
            np.multiply(a.reshape(-1), scale, out=send[offset:offset + n], casting="unsafe")
            offset += n
        send[-1] = 1.0
        # The packed part goes first: its count says how many ranks contributed.
        self.compression.sum_(self.comm, send, recv, key=(self.id, bucket))
        contributors = float(recv[-1])
        if self.average and 0 < contributors < size:
            # Some ranks joined and sent zeros: average over those that trained.
            np.multiply(recv[:-1], size / contributors, out=recv[:-1])
        results, offset = [], 0
        for i, (a, d) in enumerate(zip(arrays, direct)):
            n = int(a.size)
            if d:
                out = self._ring((bucket, i), n)
                self.comm.allreduce_into(a.reshape(-1), out)
                if self.average and contributors > 0:
                    np.multiply(out, 1.0 / contributors, out=out)
                results.append(out.reshape(a.shape))
            else:
                results.append(recv[offset:offset + n].reshape(a.shape))
                offset += n
        return results

    def _feed_zeros(self):
        """Takes part in one round of this reducer's collectives with zeros.

        Returns the number of ranks still training in that round.
        """
        still_training = 0.0
        for bucket in sorted(self._send):
            send = self._send[bucket]
            send[...] = 0.0
            recv = np.empty_like(send)
            self.compression.sum_(self.comm, send, recv, key=None)
            still_training = max(still_training, float(recv[-1]))
            for n in self._layouts[bucket]:
                zeros = np.zeros(n, dtype=np.float32)
                self.comm.allreduce_into(zeros, np.empty_like(zeros))
        return still_training


def join(comm=None):
    """Waits for every rank to finish its gradient steps, feeding zeros meanwhile.

    A rank with fewer batches calls `join()` when it runs out; it then takes
    part in the other ranks' gradient allreduces with zero gradients (they
    average over the ranks that really contributed) until every rank has
    joined. Returns the rank that joined last. The ranks that joined early
    missed updates: copy the model from the returned rank (kdist's callbacks
    do this for you at the end of each epoch).
    """
    return join_and_tell(comm)[0]


def join_and_tell(comm=None):
    """`join()`, also saying whether any rank had to feed zeros (and so fell behind)."""
    comm = comm if comm is not None else processes.world()
    if comm.size == 1:
        return comm.rank, False
    with _reducers_lock:
        reducers = [r for r in _reducers if r.comm is comm]
    rounds = 0
    while True:
        rounds += 1
        flag = np.array([0.0], dtype=np.float64)
        # A probe in the same order on every rank decides when all have joined;
        # the reducers' own collectives mirror what training ranks are doing.
        if reducers:
            still_training = max(r._feed_zeros() for r in reducers)
        else:
            comm.allreduce_(flag)
            still_training = float(flag[0])
        if still_training == 0.0:
            break
    joined_rounds = comm.allgather_object(rounds)
    fewest = min(joined_rounds)
    last = max(r for r, n in enumerate(joined_rounds) if n == fewest)
    if rounds > 1:
        logger.debug("join: fed zeros for %d rounds; rank %d joined last", rounds - 1, last)
    return last, max(joined_rounds) > 1
