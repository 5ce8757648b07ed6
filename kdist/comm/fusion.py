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


class FusedReducer:
    """Averages (or sums) lists of arrays across a communicator, bucket by bucket.

    Args:
        comm: the `Communicator` to reduce over (the world by default).
        compression: a `Compression` mode.
        average: divide by the number of contributing ranks (else sum).

    Example:

    >>> import numpy as np
    >>> from kdist.comm.fusion import FusedReducer
    >>> reducer = FusedReducer()
    >>> reducer.reduce(0, [np.ones((2, 2), np.float32), np.zeros(3, np.float32)]).shape
    (7,)
    """

    def __init__(self, comm=None, compression=None, average=True):
        self.comm = comm if comm is not None else processes.world()
        self.compression = compression_lib.get(compression)
        self.average = average
        self.id = next(_ids)
        self._buffers = {}
        self.reductions = 0
        _keep_large_buffers_in_heap()

    def _buffer(self, bucket, items):
        buffer = self._buffers.get(bucket)
        if buffer is None or buffer.shape[0] != items + 1:
            buffer = self._buffers[bucket] = np.empty(items + 1, dtype=np.float32)
        return buffer

    def reduce(self, bucket, arrays):
        """Reduces one bucket; returns the flat float32 result (a new array)."""
        items = sum(int(a.size) for a in arrays)
        buffer = self._buffer(bucket, items)
        offset = 0
        for a in arrays:
            n = int(a.size)
            np.copyto(buffer[offset:offset + n], a.reshape(-1), casting="unsafe")
            offset += n
        buffer[-1] = 1.0
        if self.reductions == 0:
            with _reducers_lock:
                if self not in _reducers:
                    _reducers.append(self)
        self.reductions += 1
        self.compression.sum_(self.comm, buffer, key=(self.id, bucket))
        contributors = float(buffer[-1])
        if self.average and contributors > 0:
            return np.multiply(buffer[:-1], 1.0 / contributors)
        return buffer[:-1].copy()

    def _feed_zeros(self):
        """Takes part in one round of this reducer's collectives with zeros.

        Returns the number of ranks still training in that round.
        """
        still_training = 0.0
        for bucket in sorted(self._buffers):
            buffer = self._buffers[bucket]
            buffer[...] = 0.0
            self.compression.sum_(self.comm, buffer, key=None)
            still_training = max(still_training, float(buffer[-1]))
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
