"""Magnitude pruning: the smallest weights of each kernel are held at zero,
one by one, in blocks or N of every M (see `patterns`)."""

import keras

from kdist import _keras_private
from kdist.sparsity import bridge
from kdist.sparsity.patterns import check_pattern, mask_for
from kdist.sparsity.schedules import ConstantSparsity, PruningSchedule
from kdist.sparsity.wrapping import KernelWrapper, wrap_layers, wrappers_in

# What `pruning_step` reads before a layer's first training step (as in tfmot).
UNTRAINED_STEP = -1


@keras.saving.register_keras_serializable(package="kdist")
class PruneLowMagnitude(KernelWrapper):
    """Computes its layer with `kernel * mask`; `UpdatePruning` moves the mask.

    Use `prune()` to wrap a model's layers; wrap a layer directly inside a
    subclassed model. Pruned weights get no gradient from the loss, and they
    are set to zero whenever the mask changes. `pruning_step` counts the
    training steps the layer has been through: its schedule's clock (-1
    before the first).

    Args:
        layer: a layer with a kernel (Dense, Conv1D/2D/3D, EinsumDense, ...),
            or a recurrent layer (LSTM, GRU, SimpleRNN, Bidirectional), whose
            input and recurrent kernels are each pruned to the schedule's
            sparsity (`masks` holds one mask per kernel).
        schedule: a `PruningSchedule` (also accepted as `pruning_schedule=`,
            tfmot's name); left out, `ConstantSparsity(0.5, begin_step=0)`,
            tfmot's default.
        block_size: `(height, width)` blocks pruned together in a 2-D kernel.
        block_pooling_type: `"AVG"` or `"MAX"`, how a block's magnitude is taken.
        sparsity_m_by_n: `(m, n)`: m zeros in every n consecutive input-channel
            weights (2:4 is `(2, 4)`); the schedule then only says when.
        require_step_callback: a training step fails with
            `tf.errors.InvalidArgumentError` until an `UpdatePruning` callback
            has started on the model (`step_callback_attached`): tfmot's rule,
            since without one the mask would never move, silently.
            `kdist.tfmot`'s `prune_low_magnitude` sets it.
        pruning_schedule: tfmot's name for `schedule`.
        **kwargs: Keras wrapper arguments (`name`, `dtype`); the name defaults
            to `pruned_<layer name>`.

    Attributes:
        mask: the mask of the first target weight (the kernel).
        masks: one mask per target weight, e.g. a recurrent layer's input and
            recurrent kernels.
        targets: the weights pruned, kernel first.
        pruning_step: the training steps this layer has been through (-1 before
            the first), saved with the model.
        schedule: the `PruningSchedule`, also as tfmot's `pruning_schedule`.
        block_size: as given.
        block_pooling_type: as given.
        sparsity_m_by_n: as given, or None.
        step_callback_attached: whether an `UpdatePruning` callback has started
            on this layer's model.
        base_layer: the plain layer at the bottom of the wrapper chain.

    The wrapper nests with `QuantizeAware` either way round, gives
    `effective_kernel()` (the kernel the layer computes with), and saves and
    loads with the model.

    Raises:
        TypeError: the schedule is given both as `schedule` and
            `pruning_schedule`, or is not a `PruningSchedule`.
        ValueError: a bad pattern (see `prune`); when built, a layer with
            several inputs (MultiHeadAttention) that is not built yet.
    """

    def __init__(self, layer, schedule=None, block_size=(1, 1), block_pooling_type="AVG",
                 sparsity_m_by_n=None, require_step_callback=False, pruning_schedule=None,
                 **kwargs):
        pattern = check_pattern(block_size, block_pooling_type, sparsity_m_by_n)
        if schedule is not None and pruning_schedule is not None:
            raise TypeError("Give the schedule once: as `schedule` or as tfmot's "
                            "`pruning_schedule`, not both.")
        schedule = schedule if schedule is not None else pruning_schedule
        if schedule is None:
            schedule = ConstantSparsity(0.5, begin_step=0)
        if not isinstance(schedule, PruningSchedule):
            raise TypeError("schedule must be a kdist.sparsity.PruningSchedule (ConstantSparsity, "
                            f"PolynomialDecay or a subclass); got {type(schedule).__name__}.")
        kwargs.setdefault("name", f"pruned_{layer.name}")
        super().__init__(layer, **kwargs)
        self.schedule = schedule
        self.block_size, self.block_pooling_type, self.sparsity_m_by_n = pattern
        self.require_step_callback = bool(require_step_callback)
        self.step_callback_attached = False  # set by UpdatePruning.on_train_begin

    @property
    def pruning_schedule(self):
        """The schedule, under tfmot's attribute name."""
        return self.schedule

    accepts_no_targets = True  # as tfmot wraps Dropout or pooling: nothing to prune

    def build_state(self, targets):
        def new_mask(name, target):
            return self.add_weight(name=name, shape=target.shape, initializer="ones",
                                   trainable=False, dtype="float32", autocast=False,
                                   aggregation="only_first_replica")

        self.mask = new_mask("mask", targets[0]) if targets else None
        # Steps trained so far: the schedule's clock lives with the layer, so a
        # new optimizer (recompiling, quantising, reloading) does not restart it.
        # It reads -1 until the first training step, as tfmot's does.
        self.pruning_step = self.add_weight(name="pruning_step", shape=(),
                                            initializer=keras.initializers.Constant(
                                                UNTRAINED_STEP), trainable=False,
                                            dtype="int64", autocast=False,
                                            aggregation="only_first_replica")
        # A recurrent layer's other kernels come last, so files of one-kernel
        # layers keep their layout.
        self.masks = [self.mask] * bool(targets) + [
            new_mask(f"mask_{i}", target) for i, target in enumerate(targets[1:], 1)]

    def transform_kernel(self, value, training, index=0):
        if training and self.require_step_callback and not self.step_callback_attached:
            # Failing when the step runs, as tfmot does, and not while it is traced:
            # a trace that raises leaves the model's train function unusable.
            import tensorflow as tf

            failed = tf.debugging.Assert(False, [
                f"{self.name}: a pruned layer requires the UpdatePruningStep callback "
                "during training, or its mask never moves. Add "
                "tfmot.sparsity.keras.UpdatePruningStep() to model.fit's callbacks (in a "
                "custom loop: set_model, on_train_begin, then on_train_batch_begin each "
                "step)."])
            with tf.control_dependencies([failed]):
                value = tf.identity(value)
        return value * keras.ops.cast(self.masks[index], value.dtype)

    def load_own_variables(self, store):
        own = _keras_private.own_layer_variables(self)
        if (len(store.keys()) == len(own) - 1 and len(self.masks) == 1
                and own[-1] is self.pruning_step):
            # Saved before layers counted their steps: the count starts at 0.
            for i, variable in enumerate(own[:-1]):
                variable.assign(store[f"{i}"])
            self.pruning_step.assign(0)
            return
        super().load_own_variables(store)

    def pattern_mask(self, values, sparsity):
        """The mask this layer's pattern gives kernel `values` at `sparsity`."""
        return mask_for(values, sparsity, self.block_size, self.block_pooling_type,
                        self.sparsity_m_by_n)

    def update_mask(self, sparsity):
        """Masks the smallest `sparsity` of each target weight and zeroes them."""
        for index, (target, mask) in enumerate(zip(self.targets, self.masks)):
            values = self.pattern_mask(
                keras.ops.convert_to_numpy(self.effective_kernel(False, index)), sparsity)
            mask.assign(values)
            target.assign(keras.ops.convert_to_numpy(target) * values.astype(target.dtype))

    def get_config(self):
        config = super().get_config()
        config["schedule"] = keras.saving.serialize_keras_object(self.schedule)
        config.update(require_step_callback=self.require_step_callback,
                      block_size=list(self.block_size),
                      block_pooling_type=self.block_pooling_type,
                      sparsity_m_by_n=None if self.sparsity_m_by_n is None else
                      list(self.sparsity_m_by_n))
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        config["schedule"] = keras.saving.deserialize_keras_object(
            config["schedule"], custom_objects=custom_objects)
        return super().from_config(config, custom_objects=custom_objects)


class PrunableLayer:
    """Mixin for a custom layer that says which of its weights to prune.

    Define `get_prunable_weights()` to return the weights to prune (an
    empty list: nothing); `prune()` then wraps the layer like a built-in one
    and prunes each of them to the schedule's sparsity.

    Example:

        >>> import keras, numpy as np, kdist
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
                                  "returning the weights to prune.")


def prune(model, schedule, skip=(), block_size=(1, 1), block_pooling_type="AVG",
          sparsity_m_by_n=None):
    """Wraps every layer with a kernel in `PruneLowMagnitude`.

    The layers of nested models are wrapped too. Layers with a kernel are
    Dense, the convolutions, EinsumDense, Embedding, custom layers with a
    `kernel` weight and `PrunableLayer`s; a recurrent layer (LSTM, GRU,
    SimpleRNN, ConvLSTM, Bidirectional) has its input and recurrent kernels
    pruned, a MultiHeadAttention its four kernels. Layers already pruned are
    left as they are. The masks come from `magnitude_mask`, `block_mask` or
    `n_of_m_mask`, as the pattern arguments say.

    Args:
        model: a Sequential or functional Keras 3 model (a copy is returned,
            with the same weights), or a single layer (wrapped as it is, for
            subclassed models). A tf_keras model goes to
            tensorflow-model-optimization's `prune_low_magnitude`, without `skip`.
        schedule: a `PruningSchedule`: `ConstantSparsity`, `PolynomialDecay`
            or a subclass.
        skip: layer names or layer classes to leave dense (the output layer,
            usually).
        block_size: prune `(height, width)` blocks of 2-D kernels together.
        block_pooling_type: rank blocks by their mean (`"AVG"`) or largest
            (`"MAX"`) magnitude.
        sparsity_m_by_n: `(m, n)` for m zeros in every n consecutive
            input-channel weights, e.g. `(2, 4)`; the schedule then only says
            when masks change. Not together with `block_size`.

    Returns:
        The pruned model: compile it, and train with the `UpdatePruning`
        callback.

    Raises:
        TypeError: `schedule` is not a `PruningSchedule`, `model` is a
            subclassed model (wrap its layers where it creates them), or a
            `skip` entry is neither a name nor a class.
        ValueError: no layer is left to prune once `skip` is applied (or the
            layer given has no kernel, or is already pruned); `block_size` is
            not two integers >= 1, `block_pooling_type` is not `"AVG"` or
            `"MAX"`, `sparsity_m_by_n` is not `(m, n)` with `0 < m < n`, or
            both `block_size` and `sparsity_m_by_n` are given.

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
    pattern = dict(zip(("block_size", "block_pooling_type", "sparsity_m_by_n"),
                       check_pattern(block_size, block_pooling_type, sparsity_m_by_n)))
    if bridge.is_tf_keras(model):
        return bridge.prune(model, schedule, skip, pattern)
    return wrap_layers(model, lambda layer: PruneLowMagnitude(layer, schedule, **pattern),
                       PruneLowMagnitude, skip, "prune")


def pruned_layers(model):
    """The `PruneLowMagnitude` wrappers in `model`."""
    return wrappers_in(model, PruneLowMagnitude)
