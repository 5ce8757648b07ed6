"""TensorFlow's MultiWorkerMirroredStrategy, made to work with Keras 3 `fit`.

With the stock `tf.distribute.MultiWorkerMirroredStrategy` and more than one
worker, Keras 3's `model.fit` and `model.evaluate` fail before the first step
(keras-team/keras#20585). Keras's TensorFlow trainer asks the strategy for two
reductions that TensorFlow's multi-worker code path does not support:

1. `strategy.reduce("MEAN", batch, axis=None)` on a whole data batch, a
   nested structure such as `(x, y)` of per-replica tensors, to get an
   example batch for building the model (`_maybe_symbolic_build`). One
   process reduces such a nest without looking at it; several workers hand
   it to the collective all-reduce, which accepts only single tensors
   ("Attempt to convert a value (PerReplica...) to a Tensor").
2. `strategy.reduce("MEAN", value, axis=0)` on every per-replica loss and
   metric after each step (`reduce_per_replica`). Those are scalars, which
   have no axis 0 ("Invalid reduction dimension 0 for input with 0
   dimensions").

`MultiWorkerMirroredStrategy` here is the stock strategy with `reduce` taught
both cases: it reduces a nest element by element, and reduces a scalar across
replicas only (the only reduction a scalar has). Everything else, from
variable placement and gradient all-reduce to dataset sharding, is
TensorFlow's. It also finds its cluster without TF_CONFIG, from SLURM or an
MPI launcher (see `kdist.distribute.cluster`).

Limits, with several workers:

* `steps_per_execution` must be 1. Keras 3 then calls its step function
  inside a `tf.while_loop`, where TensorFlow cannot hand the step's
  collectives their keys; this strategy says so while tracing instead of
  failing with "You must feed a value for placeholder tensor".
* Building the model all-reduces the first batch of each `fit` and
  `evaluate` call once, as Keras asks (cheap for most inputs, a moment for
  large images).
* Keras's saving callbacks write on every worker: use
  `kdist.callbacks.ModelCheckpoint`, `BackupAndRestore` and `save_model`,
  which write on the chief only. TensorBoard writes on every worker: give
  workers other than task 0 their own log directories.

Run the same script on every worker, e.g. `kdist launch -n 2 train.py`:

    import keras, tensorflow as tf
    from kdist.distribute.multi_worker import MultiWorkerMirroredStrategy

    strategy = MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse")
    data = tf.data.Dataset.from_tensor_slices(([[0.0] * 4] * 64, [0.0] * 64))
    model.fit(data.batch(16), epochs=2)   # 16 is the global batch

On one process (no TF_CONFIG, SLURM step or MPI launcher) it is a
single-worker strategy:

>>> strategy = MultiWorkerMirroredStrategy()
>>> strategy.num_replicas_in_sync
1
"""

import ctypes
import os
import platform

import tensorflow as tf

from kdist import _tf_private
from kdist.distribute import cluster


def _pool_cpu_memory():
    # Run under a tf.distribute strategy, a training step's large temporaries
    # (gradients, optimizer intermediates: megabytes each) are malloc'ed and
    # freed so that glibc hands the pages back to the kernel and faults them in
    # again on every step: about 3,700 page faults a step for a 670k-parameter
    # MLP, which doubles its step time on a CPU. TensorFlow's pooling (BFC) CPU
    # allocator keeps them. TensorFlow reads the switch once, when it creates
    # its devices, which a multi-worker strategy does itself: set it before.
    if not _tf_private.eager_context_started():
        os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
    # The collectives' gRPC buffers (megabytes a step) bypass that allocator.
    # Have glibc keep 64 MiB spare at the top of each heap instead of handing
    # it back after every step (as MALLOC_TOP_PAD_ would, which takes effect
    # only at start-up): about 1,500 fewer page faults a step per worker.
    if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc" \
            and "MALLOC_TOP_PAD_" not in os.environ:
        try:
            ctypes.CDLL(None).mallopt(_M_TOP_PAD, 64 << 20)
        except (OSError, AttributeError):
            pass


_M_TOP_PAD = -2  # glibc's mallopt parameter number


def _check_not_called_from_control_flow():
    # Multi-worker collectives take their instance keys at call time, through
    # "call-time captures" that TensorFlow cannot thread through a tf.cond or
    # tf.while_loop around a nested tf.function: such a step fails at run time
    # with "You must feed a value for placeholder tensor ...". Keras 3 traces
    # its step that way when steps_per_execution > 1; say so while tracing.
    graph = tf.compat.v1.get_default_graph()
    while getattr(graph, "is_control_flow_graph", False):
        graph = graph.outer_graph
    graph = getattr(graph, "outer_graph", None)
    while graph is not None:
        if getattr(graph, "is_control_flow_graph", False):
            raise ValueError(
                "With several workers, a tf.function that all-reduces cannot be called "
                "inside tf.cond or tf.while_loop (TensorFlow cannot pass it the collective "
                "keys there). Keras 3 does that when steps_per_execution > 1: compile the "
                "model with steps_per_execution=1.")
        graph = getattr(graph, "outer_graph", None)


class MultiWorkerMirroredStrategy(tf.distribute.MultiWorkerMirroredStrategy):
    """`tf.distribute.MultiWorkerMirroredStrategy` that Keras 3 can `fit` with.

    With the stock strategy and more than one worker, Keras 3's `fit` and
    `evaluate` fail before the first step (keras-team/keras#20585): the stock
    strategy cannot reduce the nested batch Keras builds the model from, nor a
    scalar along axis 0 as Keras reduces each step's logs. Here only `reduce`
    is changed, to handle both, and `fit`, `evaluate` and `predict` work
    across workers (every worker gets the global results); variables,
    gradients and dataset sharding are TensorFlow's.

    With several workers, compile with `steps_per_execution=1`: a larger value
    raises a `ValueError` saying so while the step is traced (Keras 3 then
    calls the step inside a `tf.while_loop`, where TensorFlow cannot give the
    collectives their keys). Keras's saving callbacks and TensorBoard write on
    every worker; `kdist.callbacks.ModelCheckpoint`, `BackupAndRestore` and
    `save_model` write on the chief only.

    Run the same script on every worker, e.g. `kdist launch -n 2 train.py`,
    or under `srun` or an MPI launcher; datasets are batched with the global
    batch size.

    Args:
        cluster_resolver: a `tf.distribute.cluster_resolver.ClusterResolver`.
            By default `kdist.distribute.resolve_cluster()`: TF_CONFIG, a SLURM
            step or an MPI launcher's environment describes the cluster;
            without any of them this process is the only worker.
        communication_options: `tf.distribute.experimental.CommunicationOptions`,
            as for the stock strategy.

    >>> import tensorflow as tf
    >>> float(MultiWorkerMirroredStrategy().reduce("SUM", tf.constant(2.0), axis=0))
    2.0
    """

    def __init__(self, cluster_resolver=None, communication_options=None):
        if cluster_resolver is None:
            cluster_resolver = cluster.resolve_cluster()
        _pool_cpu_memory()
        super().__init__(cluster_resolver=cluster_resolver,
                         communication_options=communication_options)

    def reduce(self, reduce_op, value, axis=None):
        """`tf.distribute.Strategy.reduce`, also for nests and for scalars with an axis."""
        if _tf_private.in_multi_worker_mode(self):
            _check_not_called_from_control_flow()
        if tf.nest.is_nested(value):
            return tf.nest.map_structure(lambda v: self.reduce(reduce_op, v, axis), value)
        if axis is not None and self._each_replica_is_scalar(value):
            axis = None
        return super().reduce(reduce_op, value, axis)

    def _each_replica_is_scalar(self, value):
        # A plain tensor comes back as its own only local result.
        local = self.experimental_local_results(value)
        shape = getattr(local[0], "shape", None) if local else None
        return shape is not None and shape.rank == 0
