"""Quantizers a `QuantizeConfig` chooses per weight, activation or output.

A quantizer is a plain object: `build(shape, name, layer)` creates the
variables it needs on `layer` and returns them in a dict, and
`quantizer(tensor, training, variables)` returns the tensor fake-quantised.
Three keep a range and differ only in how training moves it:

- `LastValueQuantizer`: the range of the last batch (weights);
- `MovingAverageQuantizer`: an exponential moving average of batch ranges,
  decay 0.999, starting from [-6, 6] (activations);
- `AllValuesQuantizer`: the widest range seen, starting from [0, 0];

and `FixedQuantizer` keeps the range it is given.

Every range holds zero (an integer engine must represent zero exactly);
`symmetric` ranges are centred on it, with the two's-complement grid's one
extra negative step unless `narrow_range`. This is the quantizer interface
of tensorflow-model-optimization, for Keras 3 layers.
"""

import keras

from kdist._args import whole_number


@keras.saving.register_keras_serializable(package="kdist")
class Quantizer:
    """Base class of quantizers: subclass it and give `__call__` (and `build` for state).

    A quantizer is a plain object that a `QuantizeConfig` chooses per
    weight, activation or output. `build(tensor_shape, name, layer)` creates
    the variables it needs on `layer` and returns them in a dict;
    `quantizer(inputs, training, weights)` returns `inputs` fake-quantised,
    given that dict as `weights`. Quantizers compare equal by type and
    `get_config()`. This is tensorflow-model-optimization's quantizer
    interface, for Keras 3 layers.

    Example, a quantizer that only clips (no state):

        >>> import keras, kdist
        >>> class Clip(kdist.sparsity.Quantizer):
        ...     def __call__(self, inputs, training, weights, **kwargs):
        ...         return keras.ops.clip(inputs, -1.0, 1.0)
        >>> keras.ops.convert_to_numpy(Clip()(keras.ops.array([-3.0, 0.5]), False, {})).tolist()
        [-1.0, 0.5]
    """

    def build(self, tensor_shape, name, layer):
        """Creates this quantizer's variables on `layer`; returns them by name."""
        return {}

    def __call__(self, inputs, training, weights, **kwargs):
        raise NotImplementedError(f"{type(self).__name__} must define __call__(inputs, "
                                  "training, weights, **kwargs).")

    def get_config(self):
        return {}

    @classmethod
    def from_config(cls, config):
        return cls(**config)

    def __eq__(self, other):
        return type(other) is type(self) and other.get_config() == self.get_config()

    def __hash__(self):
        return hash((type(self).__name__, repr(sorted(self.get_config().items()))))


class RangeQuantizer(Quantizer):
    """Base of the quantizers that fake-quantise over a tracked [min, max]."""

    initial_range = (-6.0, 6.0)

    def __init__(self, num_bits, per_axis, symmetric, narrow_range):
        self.num_bits = whole_number(num_bits, "num_bits", minimum=2)
        if self.num_bits > 16:
            raise ValueError(f"num_bits must be a whole number from 2 to 16; got {num_bits}.")
        for name, flag in (("per_axis", per_axis), ("symmetric", symmetric),
                           ("narrow_range", narrow_range)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be True or False; got {flag!r}.")
        self.per_axis = per_axis
        self.symmetric = symmetric
        self.narrow_range = narrow_range

    def build(self, tensor_shape, name, layer):
        # Per axis, one range per entry of the last axis (a kernel's output channels).
        shape = (int(tensor_shape[-1]),) if self.per_axis and tensor_shape is not None else ()
        low, high = self.initial_range
        variables = {}
        for end, start in (("min", low), ("max", high)):
            variables[f"{end}_var"] = layer.add_weight(
                name=f"{name}_{end}", shape=shape, trainable=False, dtype="float32",
                initializer=keras.initializers.Constant(start), autocast=False)
        return variables

    def observed_range(self, values):
        """This batch's range, widened to hold zero (and made symmetric if asked)."""
        ops = keras.ops
        axes = tuple(range(len(values.shape) - 1)) if self.per_axis else None
        low, high = ops.min(values, axis=axes), ops.max(values, axis=axes)
        if self.symmetric:
            # The grid of b-bit two's complement reaches one step further below zero
            # than above it; a narrow range drops that step.
            ratio = -1.0 if self.narrow_range else -((1 << self.num_bits) - 2) / (
                1 << self.num_bits)
            return ops.minimum(low, high / ratio), ops.maximum(high, low * ratio)
        return ops.minimum(low, 0.0), ops.maximum(high, 0.0)

    def updated_range(self, values, low, high):
        """The range to keep after a training batch of `values`."""
        raise NotImplementedError

    def __call__(self, inputs, training, weights, **kwargs):
        ops = keras.ops
        values = ops.cast(inputs, "float32")
        low, high = weights["min_var"], weights["max_var"]
        if training:
            new_low, new_high = self.updated_range(values, low.value, high.value)
            low.assign(new_low)
            high.assign(new_high)
            low, high = new_low, new_high
        quantized = keras.quantizers.fake_quant_with_min_max_vars(
            values, ops.stop_gradient(ops.convert_to_tensor(low)),
            ops.stop_gradient(ops.convert_to_tensor(high)), num_bits=self.num_bits,
            narrow_range=self.narrow_range, axis=-1 if self.per_axis else None)
        return ops.cast(quantized, inputs.dtype)

    def get_config(self):
        return {"num_bits": self.num_bits, "per_axis": self.per_axis,
                "symmetric": self.symmetric, "narrow_range": self.narrow_range}


@keras.saving.register_keras_serializable(package="kdist")
class LastValueQuantizer(RangeQuantizer):
    """Quantises over the range of the last training batch (a weight's own range).

    The range (variables `min_var`, `max_var`) starts at [-6, 6] and is the
    last training batch's from the first on.

    Args:
        num_bits: bits of the grid, 2 to 16.
        per_axis: one range per entry of the last axis (a kernel's output
            channels) instead of one for the tensor.
        symmetric: widen each range to be symmetric about zero (with the
            two's-complement grid's one extra negative step unless
            `narrow_range`).
        narrow_range: leave out the grid's lowest level.

    Every range is widened to hold zero, which an integer engine must
    represent exactly.

    Raises:
        ValueError: `num_bits` is not a whole number from 2 to 16.
        TypeError: `num_bits` is not a number, or a flag is not True or False.

    Example:

        >>> import keras, kdist
        >>> quantizer = kdist.sparsity.LastValueQuantizer(
        ...     num_bits=2, per_axis=False, symmetric=False, narrow_range=False)
        >>> layer = keras.layers.Layer()
        >>> ranges = quantizer.build((3,), "kernel", layer)
        >>> quantized = quantizer(keras.ops.array([0.0, 1.0, 3.0]), True, ranges)
        >>> keras.ops.convert_to_numpy(quantized).tolist()
        [0.0, 1.0, 3.0]
        >>> float(ranges["max_var"].value)
        3.0
    """

    def updated_range(self, values, low, high):
        return self.observed_range(values)


@keras.saving.register_keras_serializable(package="kdist")
class MovingAverageQuantizer(RangeQuantizer):
    """Quantises over an exponential moving average of batch ranges (decay 0.999).

    The range starts at [-6, 6]; each training batch moves it 0.1 % of the
    way towards that batch's range. For activations.

    Args:
        num_bits: bits of the grid, 2 to 16.
        per_axis: one range per entry of the last axis (a kernel's output
            channels) instead of one for the tensor.
        symmetric: widen each range to be symmetric about zero (with the
            two's-complement grid's one extra negative step unless
            `narrow_range`).
        narrow_range: leave out the grid's lowest level.

    Every range is widened to hold zero, which an integer engine must
    represent exactly.

    Raises:
        ValueError: `num_bits` is not a whole number from 2 to 16.
        TypeError: `num_bits` is not a number, or a flag is not True or False.
    """

    decay = 0.999

    def updated_range(self, values, low, high):
        batch_low, batch_high = self.observed_range(values)
        keep = self.decay
        return keep * low + (1 - keep) * batch_low, keep * high + (1 - keep) * batch_high


@keras.saving.register_keras_serializable(package="kdist")
class AllValuesQuantizer(RangeQuantizer):
    """Quantises over the widest range seen in training, starting from [0, 0].

    What `quantize_inputs` uses for inputs, by default.

    Args:
        num_bits: bits of the grid, 2 to 16.
        per_axis: one range per entry of the last axis (a kernel's output
            channels) instead of one for the tensor.
        symmetric: widen each range to be symmetric about zero (with the
            two's-complement grid's one extra negative step unless
            `narrow_range`).
        narrow_range: leave out the grid's lowest level.

    Every range is widened to hold zero, which an integer engine must
    represent exactly.

    Raises:
        ValueError: `num_bits` is not a whole number from 2 to 16.
        TypeError: `num_bits` is not a number, or a flag is not True or False.
    """

    initial_range = (0.0, 0.0)

    def updated_range(self, values, low, high):
        ops = keras.ops
        batch_low, batch_high = self.observed_range(values)
        return ops.minimum(low, batch_low), ops.maximum(high, batch_high)


@keras.saving.register_keras_serializable(package="kdist")
class FixedQuantizer(RangeQuantizer):
    """Quantises over a range given once; it has no variables and never moves.

    For values whose range is known: pixels in [0, 1], a sensor's counts.

    Args:
        num_bits: bits of the grid, 2 to 16.
        init_min: the low end of the range.
        init_max: the high end of the range.
        narrow_range: leave out the grid's lowest level.

    Raises:
        ValueError: `num_bits` outside 2 to 16, or `init_min >= init_max`.
    """

    def __init__(self, num_bits, init_min, init_max, narrow_range):
        super().__init__(num_bits, per_axis=False, symmetric=False, narrow_range=narrow_range)
        if not float(init_min) < float(init_max):
            raise ValueError(f"FixedQuantizer needs init_min < init_max; got [{init_min}, "
                             f"{init_max}].")
        self.init_min, self.init_max = float(init_min), float(init_max)

    def build(self, tensor_shape, name, layer):
        return {}

    def __call__(self, inputs, training, weights, **kwargs):
        quantized = keras.quantizers.fake_quant_with_min_max_vars(
            keras.ops.cast(inputs, "float32"), self.init_min, self.init_max,
            num_bits=self.num_bits, narrow_range=self.narrow_range)
        return keras.ops.cast(quantized, inputs.dtype)

    def get_config(self):
        return {"num_bits": self.num_bits, "init_min": self.init_min,
                "init_max": self.init_max, "narrow_range": self.narrow_range}
