"""Reduces a list of TensorFlow tensors across ranks: the data-parallel step's collective.

Both `AllreduceOptimizer` and `kdist.distribute.MPIStrategy` hand their
gradients here, so the data-parallel step has one implementation: floating
tensors travel in fused buckets (one collective per bucket; inside it, small
tensors packed together and large ones reduced in place), through kdist's
C++ op when it is available; the compression mode decides the bytes on the
wire. It works eagerly, in graphs and under XLA.

Buckets follow backpropagation order: the last tensors of a list (the last
layers' gradients, which backpropagation produces first) travel first. In a
graph each bucket's collective depends only on its own tensors, so when
TensorFlow has a second inter-op thread it reduces a bucket while the earlier
layers' gradients are still being computed; `KDIST_OVERLAP=0` makes every
bucket wait for the whole list instead (to measure what overlap hides).
"""

import logging
import os

import numpy as np

from kdist._args import whole_number
from kdist.comm import compression as compression_lib
from kdist.comm import processes
from kdist.comm.fusion import auto_bucket_bytes, plan_buckets

logger = logging.getLogger(__name__)


class TensorReducer:
    """Sums or averages lists of TensorFlow tensors over a communicator.

    Works eagerly, inside a `tf.function` and under XLA. `AllreduceOptimizer` (what
    `DistributedOptimizer` returns) and `kdist.distribute.MPIStrategy` both reduce
    their gradients with it. Calling it with a list returns the reduced list; `None`
    entries stay `None`.

    - Floating tensors travel in buckets, planned on the first call with each list
      signature (shapes and dtypes), so the same reducer can serve gradients and,
      say, batch-normalisation statistics: consecutive tensors of one dtype, at most
      `bucket_bytes` per bucket (or about `num_groups` buckets of equal size), in
      backpropagation order (from the end of the list: the last layers' gradients,
      which exist first, travel first). Each bucket is one collective through the
      `compression` mode's `reduce`; without compression that is kdist's C++ op when
      it is available, which packs the small tensors into one buffer and reduces those
      of 256 KiB or more in place.
    - An average is over the ranks that contributed (see `kdist.join`). Integer and
      boolean tensors are summed, never averaged, one collective each.
    - Overlap: in a graph (`tf.function`, Keras's compiled steps) a bucket's collective
      depends only on its own tensors, so with a second inter-op thread TensorFlow
      reduces it while the earlier layers' gradients are still being computed.
      Collectives still run in one order on every rank. kdist gives a rank a second
      inter-op thread when it has 2 or more cores; docs/performance.md measures what
      overlap hides, and when.

    A tensor of unknown shape raises `ValueError` when the reducer is called.

    Args:
        comm: the `kdist.comm.Communicator` (the world by default).
        compression: a `kdist.Compression` mode (or its name or config), applied to
            floating tensors.
        average: divide by the number of contributing ranks (else sum).
        bucket_bytes: most bytes per fused collective; None (the default) reads
            `KDIST_BUCKET_BYTES` (`kdist plan --measure` recommends a value from the
            measured link), and where that is unset chooses
            (`kdist.comm.fusion.auto_bucket_bytes`): 64 MiB on one host, a quarter of
            the list's bytes (1-64 MiB) when the job spans hosts. A positive whole
            number (`ValueError` otherwise).
        num_groups: if positive, split each list into about this many
            collectives of equal size instead. A whole number, 0 or more
            (`ValueError` otherwise).
        groups: explicit fusion: a list of lists of positions in the lists
            this reducer is called with. The floating tensors of each inner
            list travel in one collective; those in no list travel alone.
            Overrides `bucket_bytes` and `num_groups`. A position in two lists, or a
            negative one, raises `ValueError`.
        prescale_factor: multiplies each tensor before the reduction.
        postscale_factor: multiplies each result, so that results are
            `reduce(t * prescale_factor) * postscale_factor`, as in `kdist.allreduce`
            (also in a world of one).
        name: labels its collectives in log messages, error reports and stall
            reports.
        overlap: let a bucket's collective start as soon as its own tensors
            exist (True) or only once every tensor of the list exists (False).
            None (the default) reads `KDIST_OVERLAP` (on unless it is `0`). Off, every
            bucket waits for the whole list (to measure what overlap hides).

    Example:

        >>> import tensorflow as tf
        >>> from kdist.comm import TensorReducer
        >>> [t.shape for t in TensorReducer()([tf.ones((2, 3)), tf.zeros(4)])]
        [TensorShape([2, 3]), TensorShape([4])]
    """

    def __init__(self, comm=None, compression=None, average=True,
                 bucket_bytes=None, num_groups=0, name="kdist", groups=None,
                 prescale_factor=1.0, postscale_factor=1.0, overlap=None):
        if bucket_bytes is None:
            bucket_bytes = _bucket_bytes_from_environment()
        elif whole_number(bucket_bytes, "bucket_bytes") <= 0:
            raise ValueError(f"bucket_bytes must be positive; got {bucket_bytes}.")
        whole_number(num_groups or 0, "num_groups", minimum=0)
        self._comm = comm
        self.compression = compression_lib.get(compression)
        self.average = bool(average)
        self.bucket_bytes = None if bucket_bytes is None else int(bucket_bytes)
        self.num_groups = int(num_groups or 0)
        self.groups = _check_groups(groups)
        self.prescale_factor = float(prescale_factor)
        self.postscale_factor = float(postscale_factor)
        self.name = name
        self.overlap = _overlap_from_environment() if overlap is None else bool(overlap)
        self._plans = {}  # signature -> list of buckets (lists of indices)

    @property
    def comm(self):
        return self._comm if self._comm is not None else processes.world()

    def __call__(self, tensors):
        """Returns the reduced tensors; None entries stay None."""
        import tensorflow as tf

        from kdist.comm import graph_ops

        comm = self.comm
        tensors = list(tensors)
        if graph_ops.single_rank(comm) and self.prescale_factor * self.postscale_factor == 1.0:
            return tensors
        present = [i for i, t in enumerate(tensors) if t is not None]
        dense = {i: tf.convert_to_tensor(tensors[i]) for i in present}
        reduced = list(tensors)
        factor = self.prescale_factor * self.postscale_factor
        for i in present:
            if not dense[i].dtype.is_floating:
                summed = graph_ops.allreduce([dense[i]], comm, op="sum",
                                             label=f"{self.name}, integer tensor")[0]
                if factor != 1.0:
                    summed = tf.cast(tf.cast(summed, tf.float64) * factor, summed.dtype)
                reduced[i] = summed
        floating = [i for i in present if dense[i].dtype.is_floating]
        after = [dense[i] for i in floating] if not self.overlap else []
        for number, bucket in enumerate(self._plan(floating, dense)):
            members = _after(after, [dense[i] for i in bucket])
            for t in members:
                if not t.shape.is_fully_defined():
                    raise ValueError(f"{self.name}: cannot reduce a tensor of unknown shape "
                                     f"{t.shape}.")
            results = self.compression.reduce(
                members, comm, self.average, self.prescale_factor, self.postscale_factor,
                label=f"{self.name}, bucket {number}", key=(id(self), number))
            for i, result in zip(bucket, results):
                reduced[i] = result
        return reduced

    @property
    def plans(self):
        """The bucket plans made so far: for each list signature, the positions per bucket."""
        return [list(map(list, plan)) for plan in self._plans.values()]

    def _plan(self, indices, dense):
        signature = tuple((i, tuple(dense[i].shape.as_list()), dense[i].dtype.name)
                          for i in indices)
        plan = self._plans.get(signature)
        if plan is not None:
            return plan
        if self.groups is not None:
            chosen = set(indices)
            plan = [[i for i in group if i in chosen] for group in self.groups]
            grouped = {i for group in plan for i in group}
            plan = [g for g in plan if g] + [[i] for i in indices if i not in grouped]
        else:
            plan = []
            by_dtype = {}
            for i in indices:
                by_dtype.setdefault(dense[i].dtype, []).append(i)
            for members in by_dtype.values():
                members = members[::-1]  # backpropagation order
                sizes = [int(np.prod(dense[i].shape)) for i in members]
                itemsize = members and dense[members[0]].dtype.size
                bucket_bytes = self.bucket_bytes or auto_bucket_bytes(
                    itemsize * sum(sizes), _job_spans_hosts())
                if self.num_groups:
                    bucket_bytes = max(1, -(-itemsize * sum(sizes) // self.num_groups))
                plan += [members[start:stop] for start, stop in
                         plan_buckets(sizes, bucket_bytes, itemsize=itemsize)]
        self._plans[signature] = plan
        logger.debug("%s: %d tensors in %d bucket(s)", self.name, len(indices), len(plan))
        return plan


def _job_spans_hosts():
    """Whether this job's ranks are on more than one host (no communication needed)."""
    from kdist.comm import job

    return job.local_size() < job.size()


def _bucket_bytes_from_environment():
    """`KDIST_BUCKET_BYTES` as a whole number of bytes, or None where it is unset."""
    value = os.environ.get("KDIST_BUCKET_BYTES", "").strip()
    if not value:
        return None
    try:
        nbytes = int(value)
    except ValueError:
        nbytes = 0
    if nbytes <= 0:
        raise ValueError(f"KDIST_BUCKET_BYTES must be a positive whole number of bytes; "
                         f"got {value!r}.")
    return nbytes


def _overlap_from_environment():
    value = os.environ.get("KDIST_OVERLAP", "1").strip().lower()
    if value not in ("0", "1", "false", "true", "no", "yes", "off", "on", ""):
        raise ValueError(f"KDIST_OVERLAP must be 1 or 0; got {value!r}.")
    return value not in ("0", "false", "no", "off")


def _after(tensors, members):
    """`members`, made to wait for every tensor of `tensors` when in a graph."""
    import tensorflow as tf

    if not tensors or tf.executing_eagerly():
        return members
    with tf.control_dependencies(tensors):
        return [tf.identity(t) for t in members]


def _check_groups(groups):
    """Explicit fusion groups as lists of positions; a position may be in one group only."""
    if groups is None:
        return None
    checked, seen = [], set()
    for group in groups:
        positions = [int(i) for i in group]
        for i in positions:
            if i < 0:
                raise ValueError(f"Fusion group positions must be non-negative; got {i}.")
            if i in seen:
                raise ValueError(f"Position {i} is in more than one group; each tensor may "
                                 "be fused with one group only.")
            seen.add(i)
        checked.append(positions)
    return checked
