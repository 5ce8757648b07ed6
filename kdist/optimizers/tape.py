"""Horovod's `DistributedGradientTape`: custom training loops with averaged gradients.

A custom loop records its forward pass on a `tf.GradientTape`, then wraps
the tape; `gradient` returns gradients reduced over the ranks, fused into
buckets exactly as `DistributedOptimizer` fuses them (one collective per
bucket, not one per tensor), eagerly, inside `tf.function` and under XLA:

    with tf.GradientTape() as tape:
        loss = loss_fn(labels, model(images, training=True))
    tape = kdist.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))

The optimizer then must be a plain one: a `DistributedOptimizer` would
average the already averaged gradients a second time (harmless for an
average, wasted time).
"""

import tensorflow as tf

from kdist import _tf_private
from kdist.comm import collectives
from kdist.comm.processes import Average, Communicator
from kdist.optimizers.reduction import GradientReduction, is_variable, local_layer_list


def _recording_state(tape):
    """What a tape has recorded, taken over by the distributed tape that wraps it.

    TensorFlow keeps it in private attributes (read in kdist._tf_private), so
    a TensorFlow that renames them fails here with a clear error.
    """
    try:
        return _tf_private.gradient_tape_state(tape)
    except AttributeError as error:
        raise TypeError(
            f"DistributedGradientTape could not take over this {type(tape).__name__}: this "
            f"TensorFlow ({tf.__version__}) keeps a tape's state elsewhere ({error}). Reduce "
            "the gradients with kdist.grouped_allreduce(tape.gradient(...)) instead.") from None


class DistributedGradientTape(tf.GradientTape):
    """A `tf.GradientTape` whose gradients are reduced over the ranks.

    Horovod's tape for custom training loops, also `kdist.DistributedGradientTape`.
    Wrap a `tf.GradientTape` once it has recorded the loss; `gradient(target, sources)`
    computes this rank's gradients and returns them averaged (or summed) over the
    ranks, in the structure of `sources`. They are reduced exactly as
    `kdist.DistributedOptimizer` reduces them (the arguments mean the same): fused
    into buckets, one collective per bucket rather than one per tensor; sparse ones
    by allgather unless `sparse_as_dense`. It works eagerly, inside `tf.function` and
    under XLA. The wrapper is itself a `tf.GradientTape`, persistent if the wrapped
    tape was.

    Apply the gradients with a plain Keras optimizer: a `DistributedOptimizer` would
    reduce them a second time (for an average, the same result at the cost of a
    second collective).

    ```python
    import keras, numpy as np, tensorflow as tf, kdist

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    optimizer = keras.optimizers.SGD(0.1)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    images, labels = np.ones((8, 4), "float32"), np.zeros(8, "int64")

    with tf.GradientTape() as tape:
        loss = loss_fn(labels, model(images, training=True))
    tape = kdist.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    ```

    Args:
        gradtape: the `tf.GradientTape` that recorded the loss.
        device_dense: accepted for compatibility with Horovod; no effect.
        device_sparse: accepted for compatibility with Horovod; no effect.
        compression: `kdist.Compression.none` (default), `.fp16` or `.topk(ratio)`.
        sparse_as_dense: reduce `tf.IndexedSlices` gradients as dense tensors
            (else their rows are allgathered).
        op: `kdist.Average` (default) or `kdist.Sum`.
        gradient_predivide_factor: with `op=kdist.Average`, scale by `1 / f`
            before the sum and by `f / size` after it.
        num_groups: Horovod's older name for a number of `groups`.
        groups: a number of collectives, or a list of lists of variables
            fused together (variables in no list travel alone).
        process_set: a registered `kdist.ProcessSet`: reduce among its ranks only (a
            rank outside it keeps its own gradients, as in Horovod).
        scale_local_gradients: divide the gradients of local sources
            (`register_local_source`) by the number of ranks, as Horovod does.
        bucket_bytes: most bytes of gradient per collective; None (the default):
            `KDIST_BUCKET_BYTES` where set, else 64 MiB on one host and a quarter of the
            gradient (1-64 MiB) when the job spans hosts, so that buckets overlap the
            backward pass (`kdist plan --measure` recommends a size).
        comm: a `kdist.comm.Communicator` to reduce over instead (not with
            `process_set`).

    Raises:
        TypeError: `gradtape` is not a `tf.GradientTape`, or this TensorFlow keeps a
            tape's state where kdist cannot take it over (the message says to reduce
            with `kdist.grouped_allreduce(tape.gradient(...))` instead).
        ValueError: `gradtape` is already a `DistributedGradientTape`; and the argument
            errors of `kdist.DistributedOptimizer` (`op=kdist.Adasum`, a bad
            `gradient_predivide_factor`, bad groups, both `comm` and `process_set`).

    Example:

        On 2 ranks, where rank r's loss is `(r + 1) * w`:

        >>> import tensorflow as tf, kdist
        >>> w = tf.Variable(1.0)
        >>> with tf.GradientTape() as tape:
        ...     loss = (kdist.rank() + 1.0) * w
        >>> tape = kdist.DistributedGradientTape(tape)
        >>> float(tape.gradient(loss, [w])[0])
        1.5
    """

    def __init__(self, gradtape, device_dense="", device_sparse="", compression=None,
                 sparse_as_dense=False, op=Average, gradient_predivide_factor=1.0,
                 num_groups=0, groups=None, process_set=None, scale_local_gradients=True,
                 bucket_bytes=None, comm=None):
        if not isinstance(gradtape, tf.GradientTape):
            raise TypeError("DistributedGradientTape wraps a tf.GradientTape; got "
                            f"{type(gradtape).__name__}.")
        if isinstance(gradtape, DistributedGradientTape):
            raise ValueError("This tape already reduces its gradients across ranks; wrap the "
                             "plain tf.GradientTape once.")
        recorded, persistent, watch_accessed, watched = _recording_state(gradtape)
        super().__init__(persistent=persistent, watch_accessed_variables=watch_accessed)
        _tf_private.continue_recording(self, recorded, watched)
        # A rank outside the process set keeps its own gradients, as in Horovod.
        self._reduction = GradientReduction(
            collectives.resolve_comm(comm, process_set, outside=Communicator(None)),
            compression, op,
            bucket_bytes=bucket_bytes, num_groups=num_groups, groups=groups,
            gradient_predivide_factor=gradient_predivide_factor,
            sparse_as_dense=sparse_as_dense, scale_local_gradients=scale_local_gradients,
            name="DistributedGradientTape")

    def register_local_source(self, source):
        """Keeps `source`'s gradient on this rank (a variable, a layer or a variable path).

        With `scale_local_gradients` the gradient is divided by the number of ranks.
        Anything else raises `TypeError`.
        """
        if not (is_variable(source) or isinstance(source, str)
                or hasattr(source, "trainable_weights")):
            raise TypeError("register_local_source takes a variable, a layer or a variable "
                            f"path; got {type(source).__name__}.")
        self._reduction.register_local(source)

    def gradient(self, target, sources, output_gradients=None,
                 unconnected_gradients=tf.UnconnectedGradients.NONE, use_generic_names=False):
        """This rank's gradients of `target`, reduced over the ranks, shaped like `sources`.

        `use_generic_names` is accepted for compatibility with Horovod (kdist
        names its collectives by bucket, not by variable).
        """
        gradients = super().gradient(target, sources, output_gradients=output_gradients,
                                     unconnected_gradients=unconnected_gradients)
        flat_sources = tf.nest.flatten(sources)
        flat = tf.nest.flatten(gradients, expand_composites=False)
        reduced = self._reduction(flat, flat_sources)
        return tf.nest.pack_sequence_as(gradients, reduced)

    def get_local_and_global_gradients(self, target, sources, output_gradients=None,
                                       use_generic_names=False):
        """`(local, global)`: lists of `(source, gradient)` split by `register_local_source`.

        The gradients are those `gradient(target, sources)` returns: the local ones kept
        on this rank (and scaled with `scale_local_gradients`), the global ones reduced.
        """
        sources = list(sources)
        gradients = self.gradient(target, sources, output_gradients=output_gradients)
        keys = self._reduction.local_keys()
        local, shared = [], []
        for source, gradient in zip(sources, gradients):
            (local if self._reduction.is_local(source, keys) else shared).append(
                (source, gradient))
        return local, shared


def PartialDistributedGradientTape(gradtape, device_dense="", device_sparse="",
                                   compression=None, sparse_as_dense=False, op=Average,
                                   gradient_predivide_factor=1.0, num_groups=0, groups=None,
                                   process_set=None, local_layers=None,
                                   scale_local_gradients=True, **kwargs):
    """A `DistributedGradientTape` that leaves `local_layers`' gradients on each rank.

    Horovod's `PartialDistributedGradientTape`, also
    `kdist.PartialDistributedGradientTape`. With `scale_local_gradients` those gradients
    are divided by the number of ranks, as Horovod does; everything else is as in
    `DistributedGradientTape`, whose arguments (`bucket_bytes` and `comm` among
    `kwargs`) this takes.

    Args:
        local_layers: a Keras layer or a list of them; they may be unbuilt.

    Returns:
        The `DistributedGradientTape`, with the layers registered as local sources.

    Raises:
        ValueError: something in `local_layers` is not a Keras layer, as in Horovod
            (`PartialDistributedOptimizer` raises `TypeError` there).
    """
    local_layers = local_layer_list(local_layers, error=ValueError)
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression,
                                   sparse_as_dense, op, gradient_predivide_factor, num_groups,
                                   groups, process_set, scale_local_gradients, **kwargs)
    for layer in local_layers:
        tape.register_local_source(layer)
    return tape
