"""Magnitude pruning: the smallest weights of each kernel are held at zero."""

import keras
import numpy as np

from kdist.sparsity import bridge
from kdist.sparsity.schedules import PruningSchedule
from kdist.sparsity.wrapping import KernelWrapper, wrap_layers, wrappers_in


def magnitude_mask(values, sparsity):
    """1 where a weight is among the `1 - sparsity` largest in magnitude, else 0.

    Ties at the threshold are all kept; at least one weight always is.

    >>> magnitude_mask(np.array([0.1, -3.0, 0.5, 2.0]), 0.5)
    array([0., 1., 0., 1.], dtype=float32)
    """
    magnitudes = np.abs(np.asarray(values, dtype=np.float32))
    size = magnitudes.size
    keep = max(1, int(np.rint(np.float32(size) * np.float32(1.0 - sparsity))))
    threshold = np.partition(magnitudes, size - keep, axis=None)[size - keep]
    return (magnitudes >= threshold).astype(np.float32)


@keras.saving.register_keras_serializable(package="kdist")
class PruneLowMagnitude(KernelWrapper):
    """Computes its layer with `kernel * mask`; `UpdatePruning` moves the mask.

    Use `prune()` to wrap a model's layers; wrap a layer directly inside a
    subclassed model. Pruned weights get no gradient from the loss, and they
    are set to zero whenever the mask changes. `pruning_step` counts the
    training steps the layer has been through: its schedule's clock.

    Args:
        layer: a layer with a kernel (Dense, Conv1D/2D/3D, EinsumDense, ...).
        schedule: a `PruningSchedule`.
    """

    def __init__(self, layer, schedule, **kwargs):
        if not isinstance(schedule, PruningSchedule):
            raise TypeError("schedule must be a kdist.sparsity.PruningSchedule (ConstantSparsity, "
                            f"PolynomialDecay or a subclass); got {type(schedule).__name__}.")
        kwargs.setdefault("name", f"pruned_{layer.name}")
        super().__init__(layer, **kwargs)
        self.schedule = schedule

    def build_state(self, kernel):
        self.mask = self.add_weight(name="mask", shape=kernel.shape, initializer="ones",
                                    trainable=False, dtype="float32", autocast=False,
                                    aggregation="only_first_replica")
        # Steps trained so far: the schedule's clock lives with the layer, so a
        # new optimizer (recompiling, quantising, reloading) does not restart it.
        self.pruning_step = self.add_weight(name="pruning_step", shape=(),
                                            initializer="zeros", trainable=False,
                                            dtype="int64", autocast=False,
                                            aggregation="only_first_replica")

    def transform_kernel(self, value, training):
        return value * keras.ops.cast(self.mask, value.dtype)

    def load_own_variables(self, store):
        own = self._trainable_variables + self._non_trainable_variables
        if len(store.keys()) == len(own) - 1 and own[-1] is self.pruning_step:
            # Saved before layers counted their steps: the count starts at 0.
            for i, variable in enumerate(own[:-1]):
                variable.assign(store[f"{i}"])
            return
        super().load_own_variables(store)

    def update_mask(self, sparsity):
        """Masks the smallest `sparsity` of the kernel and zeroes them."""
        kernel = self.kernel
        mask = magnitude_mask(keras.ops.convert_to_numpy(self.effective_kernel()), sparsity)
        self.mask.assign(mask)
        kernel.assign(keras.ops.convert_to_numpy(kernel) * mask.astype(kernel.dtype))

    def get_config(self):
        config = super().get_config()
        config["schedule"] = keras.saving.serialize_keras_object(self.schedule)
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        config["schedule"] = keras.saving.deserialize_keras_object(
            config["schedule"], custom_objects=custom_objects)
        return super().from_config(config, custom_objects=custom_objects)


class PrunableLayer:
    """Mixin for a custom layer that says which of its weights to prune.

    Define `get_prunable_weights()` to return the one weight to prune (an
    empty list: nothing); `prune()` then wraps the layer like a built-in one.

    Example:

    >>> import keras, kdist
    >>> class Scale(keras.layers.Layer, kdist.sparsity.PrunableLayer):
    ...     def build(self, input_shape):
    ...         self.scale = self.add_weight(shape=input_shape[-1:], initializer="ones")
    ...     def call(self, inputs):
    ...         return inputs * self.scale
    ...     def get_prunable_weights(self):
    ...         return [self.scale]
    >>> layer = kdist.sparsity.prune(Scale(), kdist.sparsity.ConstantSparsity(0.5, 0))
    >>> tuple(layer(np.ones((1, 4))).shape)
    (1, 4)
    """

    def get_prunable_weights(self):
        raise NotImplementedError(f"{type(self).__name__} must define get_prunable_weights(), "
                                  "returning the weight to prune.")


def prune(model, schedule, skip=()):
    """Wraps every layer with a kernel in `PruneLowMagnitude`.

    Args:
        model: a Sequential or functional Keras 3 model (a copy is returned,
            with the same weights), or a single layer (wrapped as it is, for
            subclassed models). A tf_keras model goes to
            tensorflow-model-optimization's `prune_low_magnitude`.
        schedule: `ConstantSparsity` or `PolynomialDecay`.
        skip: layer names or layer classes to leave dense (the output layer,
            usually).

    Returns:
        The pruned model: compile it, and train with the `UpdatePruning`
        callback.

    Example:

    >>> import keras, kdist
    >>> model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16),
    ...                           keras.layers.Dense(1, name="out")])
    >>> schedule = kdist.sparsity.PolynomialDecay(0.0, 0.8, begin_step=0, end_step=100)
    >>> pruned = kdist.sparsity.prune(model, schedule, skip=["out"])
    >>> [type(layer).__name__ for layer in pruned.layers]
    ['PruneLowMagnitude', 'Dense']
    """
    if not isinstance(schedule, PruningSchedule):
        raise TypeError("schedule must be a kdist.sparsity.PruningSchedule (ConstantSparsity, "
                        f"PolynomialDecay or a subclass); got {type(schedule).__name__}.")
    if bridge.is_tf_keras(model):
        return bridge.prune(model, schedule, skip)
    return wrap_layers(model, lambda layer: PruneLowMagnitude(layer, schedule),
                       PruneLowMagnitude, skip, "prune")


def pruned_layers(model):
    """The `PruneLowMagnitude` wrappers in `model`."""
    return wrappers_in(model, PruneLowMagnitude)
