"""Batch normalization with statistics over the global batch (Horovod's `SyncBatchNormalization`).

With data parallelism each rank sees a slice of the global batch; a plain
`BatchNormalization` normalizes with that slice's mean and variance, which
are noisy when slices are small. `SyncBatchNormalization` adds up, over all
ranks, each rank's row count, per-channel sums and sums of squares in one
allreduce, so every rank normalizes with the mean and variance of the whole
global batch, whatever each rank's share of it. The allreduce sits inside the
differentiated computation: the backward pass is also that of the global
batch.
"""

import keras

from kdist import _keras_private
from kdist.comm import collectives
from kdist.comm import processes
from kdist.comm.processes import Sum


def _summed_over_ranks(tensor):
    """The sum of `tensor` over all ranks, differentiable: its gradient is summed too."""
    import tensorflow as tf

    @tf.custom_gradient
    def allreduce_sum(x):
        def grad(upstream):
            return collectives.allreduce(upstream, op=Sum, name="kdist_sync_bn_grad")

        return collectives.allreduce(x, op=Sum, name="kdist_sync_bn"), grad

    return allreduce_sum(tensor)


@keras.saving.register_keras_serializable(package="kdist")
class SyncBatchNormalization(_keras_private.MomentsThrough, keras.layers.BatchNormalization):
    """A `keras.layers.BatchNormalization` whose training statistics span all ranks.

    Horovod's synchronized batch normalization, also reachable as
    `kdist.SyncBatchNormalization`. With data parallelism each rank sees a
    slice of the global batch, and a plain `BatchNormalization` normalizes with
    that slice's statistics, which are noisy when slices are small.

    In training, mean and variance are those of the global batch: each rank's
    row count, per-channel sums and sums of squares are added over all ranks
    in one allreduce, so ranks with different batch sizes count by their
    rows. The allreduce is differentiated too (its gradient is the allreduce
    of the incoming gradient), so the backward pass is that of the global
    batch. The moving statistics are updated with the global values, so they
    stay equal on every rank. In inference it is a plain `BatchNormalization`;
    in a world of one rank it is exactly `BatchNormalization`. Every rank must
    call the layer in each training step (the statistics are an allreduce).

    Registered with Keras serialization (package `kdist`), so saved models
    load it back. Under a `tf.distribute` strategy (`MPIStrategy` included),
    Keras's own `BatchNormalization(synchronized=True)` does the same through
    the strategy.

    Args:
        fused: Horovod's argument; None or False are accepted, and
            `fused=True` raises `ValueError`.
        **kwargs: the arguments of `keras.layers.BatchNormalization`, except
            `synchronized` (statistics are always synchronized, over kdist's
            ranks): `synchronized=True` raises `ValueError`.

    Raises:
        ValueError: `fused=True` or `synchronized=True`.

    Example:

        >>> import keras, kdist
        >>> model = keras.Sequential([keras.Input((4,)), kdist.SyncBatchNormalization()])
        >>> model.layers[0].name.startswith("sync_batch_normalization")
        True
    """

    def __init__(self, fused=None, **kwargs):
        if fused:
            raise ValueError("SyncBatchNormalization does not support fused=True; leave "
                             "fused unset.")
        if kwargs.pop("synchronized", False):
            raise ValueError("SyncBatchNormalization always synchronizes its statistics over "
                             "kdist's ranks; leave synchronized unset.")
        super().__init__(**kwargs)

    def batch_moments(self, inputs, mask, axes):
        """The mean and variance over `axes` of the global batch, of which `inputs`
        (its rows weighted by `mask`) are this rank's part; None on one process,
        where Keras's own statistics are those."""
        import tensorflow as tf

        if processes.size() == 1:
            return None
        channels = inputs.shape[self.axis]
        if mask is None:
            count = tf.cast(tf.size(inputs) // channels, inputs.dtype)
            total = tf.reduce_sum(inputs, axes)
            total_of_squares = tf.reduce_sum(tf.square(inputs), axes)
        else:
            weights = tf.cast(tf.broadcast_to(tf.expand_dims(mask, -1), tf.shape(inputs)),
                              inputs.dtype)
            count = tf.reduce_sum(weights) / channels
            total = tf.reduce_sum(inputs * weights, axes)
            total_of_squares = tf.reduce_sum(tf.square(inputs) * weights, axes)
        # One collective for all three; the row count needs no gradient.
        summed = _summed_over_ranks(tf.concat(
            [tf.reshape(tf.stop_gradient(count), [1]), total, total_of_squares], axis=0))
        global_count = tf.maximum(summed[0], 1.0)
        mean = summed[1:1 + channels] / global_count
        mean_of_squares = summed[1 + channels:] / global_count
        variance = tf.maximum(mean_of_squares - tf.square(mean), 0.0)
        return mean, variance

    def get_config(self):
        config = super().get_config()
        config.pop("synchronized", None)
        return config
