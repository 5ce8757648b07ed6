"""Reduces a list of TensorFlow tensors across ranks, eagerly or inside `tf.function`.

Both `AllreduceOptimizer` and `kdist.distribute.MPIStrategy` hand their
gradients here, so the data-parallel step has one implementation: float32
tensors travel in fused buckets through kdist's C++ op when it is available
(otherwise a py-function around `FusedReducer`); other dtypes take one
collective each.
"""

import functools
import logging

import numpy as np

from kdist.comm import compression as compression_lib
from kdist.comm import fusion
from kdist.comm import processes
from kdist.comm.collectives import allreduce
from kdist.comm.processes import Average, Sum

logger = logging.getLogger(__name__)


class TensorReducer:
    """Sums or averages lists of tensors over a communicator.

    Each distinct list signature (shapes and dtypes) gets its own bucket plan,
    made on first use, so the same reducer can serve gradients and, say,
    batch-normalisation statistics.

    Args:
        comm: the `Communicator` (the world by default).
        compression: a `Compression` mode, applied to float32 buckets.
        average: divide by the number of contributing ranks (else sum).
        bucket_bytes: most bytes per fused collective.
        num_groups: if positive, split each list into about this many
            collectives of equal size instead.
        name: used in log messages.
        groups: explicit fusion: a list of lists of positions in the lists
            this reducer is called with. The floating tensors of each inner
            list travel in one collective; those in no list travel alone.
            Overrides `bucket_bytes` and `num_groups`.
        prescale_factor, postscale_factor: multiply each tensor by these
            before and after the reduction, as `kdist.allreduce` does.

    Example:

    >>> import tensorflow as tf
    >>> from kdist.comm.tensors import TensorReducer
    >>> [t.shape for t in TensorReducer()([tf.ones((2, 3)), tf.zeros(4)])]
    [TensorShape([2, 3]), TensorShape([4])]
    """

    def __init__(self, comm=None, compression=None, average=True,
                 bucket_bytes=fusion.DEFAULT_BUCKET_BYTES, num_groups=0, name="kdist",
                 groups=None, prescale_factor=1.0, postscale_factor=1.0):
        if int(bucket_bytes) <= 0:
            raise ValueError(f"bucket_bytes must be positive; got {bucket_bytes}.")
        if int(num_groups or 0) < 0:
            raise ValueError(f"num_groups must be 0 or positive; got {num_groups}.")
        self.groups = _check_groups(groups)
        self.prescale_factor = float(prescale_factor)
        self.postscale_factor = float(postscale_factor)
        self._comm = comm
        self.compression = compression_lib.get(compression)
        self.average = bool(average)
        self.bucket_bytes = int(bucket_bytes)
        self.num_groups = int(num_groups or 0)
        self.name = name
        self._plans = {}  # signature -> (FusedReducer, buckets)

    @property
    def comm(self):
        return self._comm if self._comm is not None else processes.world()

    def __call__(self, tensors):
        """Returns the reduced tensors; None entries stay None."""
        comm = self.comm
        tensors = list(tensors)
        if comm.size == 1:
            factor = self.prescale_factor * self.postscale_factor
            return [t if t is None or factor == 1.0 else _scaled(_dense(t), factor)
                    for t in tensors]
        import tensorflow as tf

        reduced = list(tensors)
        present = [i for i, t in enumerate(tensors) if t is not None]
        dense = {i: _dense(tensors[i]) for i in present}
        fused = [i for i in present if dense[i].dtype in (tf.float32, tf.float16, tf.bfloat16)]
        for i in present:
            if i in fused:
                continue
            reduced[i] = allreduce(dense[i], op=Average if self.average else Sum, comm=comm,
                                   name=f"{self.name}_allreduce",
                                   prescale_factor=self.prescale_factor,
                                   postscale_factor=self.postscale_factor)
        if fused:
            order, group_sizes = self._fused_order(fused)
            inputs = [_scaled(dense[i], self.prescale_factor) for i in order]
            results = self._reduce_floats(inputs, group_sizes)
            for i, result in zip(order, results):
                reduced[i] = _scaled(result, self.postscale_factor)
        return reduced

    def _fused_order(self, fused):
        """The order the floating tensors travel in, and the size of each explicit group."""
        if self.groups is None:
            return fused, None
        remaining = set(fused)
        order, group_sizes = [], []
        for group in self.groups:
            members = [i for i in group if i in remaining]
            remaining.difference_update(members)
            if members:
                order += members
                group_sizes.append(len(members))
        for i in fused:
            if i in remaining:
                order.append(i)
                group_sizes.append(1)
        return order, tuple(group_sizes)

    def _plan(self, tensors, group_sizes=None):
        signature = (tuple((tuple(t.shape.as_list()), t.dtype.name) for t in tensors),
                     group_sizes)
        plan = self._plans.get(signature)
        if plan is None:
            sizes = [int(np.prod(t.shape)) for t in tensors]
            if group_sizes is not None:
                stops = np.cumsum(group_sizes).tolist()
                buckets = list(zip([0] + stops[:-1], stops))
            else:
                bucket_bytes = self.bucket_bytes
                if self.num_groups:
                    bucket_bytes = max(1, -(-4 * sum(sizes) // self.num_groups))
                buckets = fusion.plan_buckets(sizes, bucket_bytes)
            reducer = fusion.FusedReducer(self.comm, self.compression, average=self.average)
            plan = self._plans[signature] = (reducer, buckets)
            logger.debug("%s: %d tensors in %d bucket(s), %.1f MB", self.name, len(sizes),
                         len(plan[1]), 4e-6 * sum(sizes))
        return plan

    @property
    def fused_reducers(self):
        """The `FusedReducer`s planned so far (one per list signature)."""
        return [reducer for reducer, _ in self._plans.values()]

    def _reduce_floats(self, tensors, group_sizes=None):
        import tensorflow as tf

        for t in tensors:
            if not t.shape.is_fully_defined():
                raise ValueError(f"{self.name}: cannot reduce a tensor of unknown shape {t.shape}.")
        reducer, buckets = self._plan(tensors, group_sizes)
        native_op = self._native_op(tensors)
        reduced = []
        for bucket, (start, stop) in enumerate(buckets):
            members = tensors[start:stop]
            if native_op is not None:
                # Same protocol as FusedReducer, run in C++; the reducer keeps
                # the layout so that a joined rank can mirror it.
                reducer.plan(bucket, [np.empty(t.shape, np.float32) for t in members])
                reduced += native_op.kdist_allreduce(
                    members, comm=self.comm.fortran_handle, average=self.average,
                    direct_bytes=reducer.direct_bytes)
                continue
            results = tf.numpy_function(
                functools.partial(_reduce_bucket, reducer, bucket), members,
                [tf.float32] * len(members), stateful=True, name=f"{self.name}_fused_allreduce")
            for result, t in zip(results, members):
                result.set_shape(t.shape)
                reduced.append(result if t.dtype == tf.float32 else tf.cast(result, t.dtype))
        return reduced

    def _native_op(self, tensors):
        """kdist's C++ allreduce op when it can do this job, else None."""
        if self.compression.name != "none" or self.comm.mpi is None:
            return None
        if any(t.dtype != "float32" for t in tensors):
            return None
        from kdist.comm import native

        return native.load()


def _reduce_bucket(reducer, bucket, *arrays):
    return reducer.reduce(bucket, arrays)


def _check_groups(groups):
    """Explicit fusion groups as tuples of positions; a position may be in one group only."""
    if groups is None:
        return None
    checked, seen = [], set()
    for group in groups:
        positions = tuple(int(i) for i in group)
        for i in positions:
            if i < 0:
                raise ValueError(f"groups hold positions in the reduced list; got {i}.")
            if i in seen:
                raise ValueError(f"Position {i} is in more than one group; each tensor "
                                 "travels in one collective only.")
            seen.add(i)
        checked.append(positions)
    return tuple(checked)


def _scaled(tensor, factor):
    if factor == 1.0:
        return tensor
    return tensor * factor  # a Python float takes the tensor's dtype


def _dense(tensor):
    import tensorflow as tf

    # IndexedSlices (embedding gradients) become dense: one fused layout per step.
    return tf.convert_to_tensor(tensor)
