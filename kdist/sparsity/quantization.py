"""Quantization-aware training: weights and activations seen through b bits.

Weights: symmetric, per output channel by default: with
`levels = 2**(bits - 1) - 1` and `scale = max|w| / levels`, the layer
computes with `clip(round(w / scale), -levels, levels) * scale`, so a
channel holds at most `2 * levels + 1 < 2**bits` distinct values and zero
stays zero (pruned weights survive quantisation). The straight-through
estimator passes the loss's gradient to the float weights unchanged.

Activations: each wrapped layer's output is fake-quantised (Keras's
`fake_quant_with_min_max_vars`) over a range tracked by an exponential
moving average of batch minima and maxima while training. Outputs after a
linear or ReLU activation are quantised as they are; for any other
activation (sigmoid, softmax, tanh) the pre-activation values are, and the
activation follows, as integer inference engines do: a saturating output
quantised over its own narrow range would stop the gradient.
"""

import keras
import numpy as np
import tensorflow as tf

from kdist._args import whole_number
from kdist._files import write_atomically
from kdist.sparsity import bridge, fixed
from kdist.sparsity.pruning import PruneLowMagnitude
from kdist.sparsity.wrapping import KernelWrapper, wrap_layers, wrappers_in


_QUANTISED_AFTER = ("linear", "relu", "relu6", None)


def _activation_name(layer):
    activation = getattr(layer, "activation", None)
    return None if activation is None else getattr(activation, "__name__", None)


def _check_bits(bits):
    bits = whole_number(bits, "bits", minimum=2)
    if bits > 16:
        raise ValueError(f"bits must be a whole number from 2 to 16; got {bits}.")
    return bits


def quantize_array(values, bits, per_channel=True, power_of_two=False):
    """Integer codes and scales of a kernel: `values ~ codes * scales`.

    Scales are per last axis (output channel) when `per_channel`, else one
    scalar; powers of two with `power_of_two` (fixed-point firmware). Codes
    are int8 for up to 8 bits, int16 above.

    >>> import numpy as np
    >>> codes, scales = quantize_array(np.array([[0.5, -1.5], [-0.4, 3.0]]), bits=3)
    >>> codes.tolist(), scales.tolist()
    ([[3, -2], [-2, 3]], [0.1666666716337204, 1.0])
    """
    bits = _check_bits(bits)
    values = np.asarray(values, dtype=np.float32)
    levels = np.float32(2 ** (bits - 1) - 1)
    axes = tuple(range(values.ndim - 1)) if per_channel and values.ndim > 1 else None
    largest = np.max(np.abs(values), axis=axes, keepdims=axes is not None)
    if power_of_two:
        scales = np.asarray(fixed.power_of_two_scale(largest, levels), np.float32)
    else:
        scales = np.where(largest > 0, largest * (np.float32(1.0) / levels),
                          np.float32(1.0)).astype(np.float32)
    codes = np.clip(np.rint(values / scales), -levels, levels)
    dtype = np.int8 if bits <= 8 else np.int16
    return codes.astype(dtype), (scales.reshape(-1) if axes is not None else scales)


def fake_quantize(value, bits, per_channel=True, power_of_two=False):
    """`value` on the b-bit grid of `quantize_array`; gradients pass straight through."""
    ops = keras.ops
    value32 = ops.cast(value, "float32")
    levels = float(2 ** (bits - 1) - 1)
    # Multiplied by the float32 reciprocal, as in `quantize_array`: a graph
    # would turn a division by the constant into exactly this, and eager
    # execution must give the same scale.
    step = float(np.float32(1.0) / np.float32(levels))
    shape = value32.shape
    axes = tuple(range(len(shape) - 1)) if per_channel and len(shape) > 1 else None
    largest = ops.max(ops.abs(value32), axis=axes, keepdims=True)
    if power_of_two:
        scale = fixed.power_of_two_scale(largest, levels)
    else:
        scale = ops.where(largest > 0, largest * step, ops.ones_like(largest))

    def to_grid(v):
        return ops.clip(ops.round(v / scale), -levels, levels) * scale

    # An identity gradient, and a forward value exactly on the grid (an
    # `x + stop_gradient(q - x)` form would leave it an ulp off).
    straight = tf.grad_pass_through(to_grid)(value32)
    return ops.cast(straight, value.dtype)


@keras.saving.register_keras_serializable(package="kdist")
class QuantizeAware(KernelWrapper):
    """Trains its layer as it will run in `bits`-bit integers.

    Weights are quantised symmetrically, per output channel by default: with
    `levels = 2**(bits - 1) - 1` and `scale = max|w| / levels`, the layer
    computes with `clip(round(w / scale), -levels, levels) * scale`, so zero
    stays zero (pruned weights survive). The straight-through estimator
    passes the loss's gradient to the float weights unchanged. With
    `activations`, the output is fake-quantised (Keras's
    `fake_quant_with_min_max_vars`) over a range tracked in training by a
    moving average of batch minima and maxima; before the first training
    step outputs pass unquantised.

    Args:
        layer: a layer with a kernel, or a `PruneLowMagnitude` wrapper.
        bits: 2 to 16.
        per_channel: one weight scale per output channel (else per tensor).
        activations: also fake-quantise the layer's output.
        preserve_sparsity: keep weights that are zero when wrapped at zero
            (a pruned, stripped model stays pruned while it is fine-tuned).
        momentum: of the moving average of the output range.
        deferred_activation: an activation (anything `keras.activations.get`
            takes) applied to the output after it is fake-quantised, with
            `activations` only; the layer's own activation is then left as it
            is. None (the default): with `activations`, a layer whose activation
            is not linear, ReLU or ReLU6 (a sigmoid, a softmax) computes linearly,
            and its activation comes after the quantised output instead
            (`export_quantized` names it `activation_after_range`).
        fixed_point: compute as FPGA firmware does: power-of-two weight
            scales, the bias on a `bits`-bit power-of-two grid too, and
            outputs rounded half to even and saturated on the `bits`-bit
            fixed-point type that covers their range (`kdist.sparsity.fixed`).
            `export_hls4ml` then reproduces the model bit for bit.
        output_range: `(min, max)` to quantise the output over, fixed, instead
            of a range tracked in training (a known output range).
        output_bits: the output's bits, if not `bits` (`fix_input_output_range`).
        output_narrow_range: leave out the output grid's lowest level, so that it
            is symmetric about zero (`2**output_bits - 1` levels).
            Neither this nor `output_bits` applies with `fixed_point=True`: the
            output then goes on the `bits`-bit fixed-point grid.
        **kwargs: Keras wrapper arguments (`name`, `dtype`); the name defaults
            to `quantized_<layer name>`.

    Attributes:
        output_min: the low end of the output range (a variable).
        output_max: the high end of the output range (a variable).
        base_layer: the plain layer at the bottom of the wrapper chain.

    The wrapper nests with `PruneLowMagnitude` either way round, gives
    `effective_kernel()` (the kernel the layer computes with) and
    `freeze_zeros()`, and saves and loads with the model.

    Raises:
        ValueError: a recurrent layer (two kernels: leave it in float),
            `bits` or `output_bits` outside 2 to 16, `momentum` outside
            [0, 1), or an `output_range` whose minimum is not below its
            maximum; when built, a layer with more than one weight to quantise
            (MultiHeadAttention) or none.
    """

    def __init__(self, layer, bits=8, per_channel=True, activations=True,
                 preserve_sparsity=True, momentum=0.99, deferred_activation=None,
                 fixed_point=False, output_range=None, output_bits=None,
                 output_narrow_range=False, **kwargs):
        kwargs.setdefault("name", f"quantized_{layer.name}")
        super().__init__(layer, **kwargs)
        base = self.base_layer
        if isinstance(base, (keras.layers.RNN, keras.layers.Bidirectional)):
            raise ValueError(
                f"QuantizeAware quantises one kernel per layer; the recurrent layer "
                f"{base.name} keeps two in its cell. Leave it in float (skip=[...]).")
        if deferred_activation is not None:
            deferred_activation = keras.activations.get(deferred_activation)
        elif activations and _activation_name(base) not in _QUANTISED_AFTER:
            deferred_activation = base.activation
            base.activation = keras.activations.linear
        self.deferred_activation = deferred_activation
        self.bits = _check_bits(bits)
        self.per_channel = bool(per_channel)
        self.activations = bool(activations)
        self.preserve_sparsity = bool(preserve_sparsity)
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must lie in [0, 1); got {momentum}.")
        self.momentum = float(momentum)
        self.fixed_point = bool(fixed_point)
        if output_range is not None:
            low, high = (float(end) for end in output_range)
            if not low < high:
                raise ValueError(f"output_range must be (min, max) with min < max; got "
                                 f"{output_range!r}.")
            output_range = (low, high)
        self.output_range = output_range
        self.output_bits = self.bits if output_bits is None else _check_bits(output_bits)
        self.output_narrow_range = bool(output_narrow_range)

    def build_state(self, targets):
        if len(targets) != 1:
            raise ValueError(
                f"QuantizeAware quantises one kernel per layer; {self.base_layer.name} has "
                f"{len(targets)} weights to transform. Leave it in float (skip=[...]).")
        kernel = targets[0]
        self.keep = self.add_weight(name="keep", shape=kernel.shape, initializer="ones",
                                    trainable=False, dtype="float32", autocast=False,
                                    aggregation="only_first_replica")
        scalar = dict(shape=(), trainable=False, dtype="float32", autocast=False,
                      aggregation="mean")
        # A fixed range is known from the start (and the step graph then assigns nothing,
        # so a converter sees constant bounds).
        low, high = self.output_range or (0.0, 0.0)
        self.output_min = self.add_weight(name="output_min", **scalar,
                                          initializer=keras.initializers.Constant(low))
        self.output_max = self.add_weight(name="output_max", **scalar,
                                          initializer=keras.initializers.Constant(high))
        self.range_seen = self.add_weight(
            name="range_seen", **scalar,
            initializer="ones" if self.output_range is not None else "zeros")

    def freeze_zeros(self):
        """Keeps the kernel's present zeros at zero from now on."""
        kernel = keras.ops.convert_to_numpy(self.kernel)
        self.keep.assign((kernel != 0).astype(np.float32))

    def transform_kernel(self, value, training, index=0):
        value = value * keras.ops.cast(self.keep, value.dtype)
        return fake_quantize(value, self.bits, self.per_channel, self.fixed_point)

    def transform_bias(self, value, training):
        if not self.fixed_point:
            return value
        return fake_quantize(value, self.bits, per_channel=False, power_of_two=True)

    def transform_output(self, outputs, training):
        if not self.activations:
            return outputs
        ops = keras.ops
        low, high = self.output_min, self.output_max
        if self.output_range is not None:
            low, high = self.output_range
        elif training:
            floats = ops.cast(outputs, "float32")
            batch_low, batch_high = ops.min(floats), ops.max(floats)
            seen = self.range_seen > 0
            m = self.momentum
            low = ops.where(seen, m * low + (1 - m) * batch_low, batch_low)
            high = ops.where(seen, m * high + (1 - m) * batch_high, batch_high)
            self.output_min.assign(low)
            self.output_max.assign(high)
            self.range_seen.assign(1.0)
        if self.fixed_point:
            quantized = fixed.fake_fixed(ops.cast(outputs, "float32"), ops.stop_gradient(low),
                                         ops.stop_gradient(high), self.bits)
        else:
            quantized = keras.quantizers.fake_quant_with_min_max_vars(
                ops.cast(outputs, "float32"), ops.stop_gradient(low), ops.stop_gradient(high),
                num_bits=self.output_bits, narrow_range=self.output_narrow_range)
        if not training and self.output_range is None:
            # Before any training step there is no range yet: pass values through.
            quantized = ops.where(self.range_seen > 0, quantized, ops.cast(outputs, "float32"))
        outputs = ops.cast(quantized, outputs.dtype)
        if self.deferred_activation is not None:
            outputs = self.deferred_activation(outputs)
        return outputs

    def restore_config(self, config):
        if self.deferred_activation is not None:
            config = dict(config, activation=keras.activations.serialize(
                self.deferred_activation))
        return config

    def get_config(self):
        config = super().get_config()
        config.update(bits=self.bits, per_channel=self.per_channel,
                      activations=self.activations, preserve_sparsity=self.preserve_sparsity,
                      momentum=self.momentum, fixed_point=self.fixed_point,
                      output_range=self.output_range, output_bits=self.output_bits,
                      output_narrow_range=self.output_narrow_range,
                      deferred_activation=None if self.deferred_activation is None else
                      keras.activations.serialize(self.deferred_activation))
        return config


def quantize(model, bits=8, per_channel=True, activations=True, preserve_sparsity=True,
             skip=(), fixed_point=False, name_prefix="quantized_"):
    """Wraps every layer with a kernel in `QuantizeAware` for fake-quant training.

    Works on a pruned model too (pruning goes on, and the kernel stays on the
    grid), or on a stripped pruned model (`preserve_sparsity` keeps its zeros).
    A tf_keras model goes to tensorflow-model-optimization's `quantize_model`
    (8 bits only).

    Args:
        model: a Sequential or functional model (a copy is returned), or a layer.
        bits: see `QuantizeAware`.
        per_channel: see `QuantizeAware`.
        activations: see `QuantizeAware`.
        preserve_sparsity: see `QuantizeAware`.
        fixed_point: see `QuantizeAware`.
        skip: layer names or classes to leave in float.
        name_prefix: each wrapper is named `<name_prefix><layer name>`.

    Returns:
        A copy of the model with the weights, or the wrapped layer. Recurrent
        layers and MultiHeadAttention (several kernels each) stay in float,
        with a warning unless they are in `skip`. `QuantizeAware(...,
        output_range=(min, max))` quantises a layer's output over a fixed
        range instead; with `fixed_point=True`, weights, biases and outputs
        lie on power-of-two fixed-point grids, as FPGA firmware computes.

    Raises:
        ValueError: `bits` is not a whole number from 2 to 16; no layer with a
            kernel is left once `skip` is applied; `fixed_point=True` or other
            than 8-bit, per-channel, quantised-activation settings for a
            tf_keras model.
        TypeError: a subclassed model (wrap its layers where it creates them),
            a `skip` entry that is neither a name nor a class, or `bits` that is
            not a number.

    Example:

        >>> import keras, numpy as np, kdist
        >>> model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
        >>> qmodel = kdist.sparsity.quantize(model, bits=4)
        >>> exported = kdist.sparsity.export_quantized(qmodel)
        >>> codes, scales = exported[qmodel.layers[0].base_layer.name]["kernel"]
        >>> int(np.abs(codes).max()) <= 7
        True
    """
    bits = _check_bits(bits)
    if bridge.is_tf_keras(model):
        if fixed_point:
            raise ValueError("fixed_point=True needs a Keras 3 model; tf_keras models go to "
                             "tensorflow-model-optimization, which has no fixed-point mode.")
        return bridge.quantize(model, bits, per_channel, activations)
    options = dict(bits=bits, per_channel=per_channel, activations=activations,
                   preserve_sparsity=preserve_sparsity, fixed_point=fixed_point)
    prefix = "" if name_prefix is None else str(name_prefix)

    def wrap(layer):
        return QuantizeAware(layer, name=f"{prefix}{layer.name}", **options)

    quantized = wrap_layers(model, wrap, QuantizeAware,
                            skip, "quantize", several_kernels=False)
    if preserve_sparsity:
        for wrapper in wrappers_in(quantized, QuantizeAware):
            if wrapper.built and not isinstance(wrapper.layer, PruneLowMagnitude):
                wrapper.freeze_zeros()
    return quantized


def export_quantized(model, path=None):
    """The integer weights of every `QuantizeAware` layer, with their scales.

    Returns `{layer name: {"kernel": (codes, scales), "bits": b, "bias": array
    or None, "output_range": (min, max) or None, "activation_after_range":
    name or None}}`, where `codes * scales` is exactly the kernel the layer
    computes with, and the activation named last (sigmoid, softmax, ...)
    applies after the output is quantised over `output_range`. With `path`, also writes
    them to an `.npz` file (atomically) with keys `<layer>/codes`,
    `<layer>/scales`, `<layer>/bits`, `<layer>/bias`, `<layer>/output_range`.

    Raises:
        ValueError: the model has no `QuantizeAware` layer.
    """
    wrappers = wrappers_in(model, QuantizeAware)
    if not wrappers:
        raise ValueError("export_quantized() found no layer wrapped by "
                         "kdist.sparsity.quantize in this model.")
    exported = {}
    for wrapper in wrappers:
        base = wrapper.base_layer
        kernel = wrapper.kernel.value
        for inner in wrapper._chain():
            if inner is wrapper:
                break
            kernel = inner.transform_kernel(kernel, False, 0)
        kernel = keras.ops.convert_to_numpy(kernel) * keras.ops.convert_to_numpy(wrapper.keep)
        bias = wrapper.effective_bias(False)
        output_range = None
        if wrapper.activations and float(wrapper.range_seen) > 0:
            output_range = (float(wrapper.output_min), float(wrapper.output_max))
        exported[base.name] = {
            "kernel": quantize_array(kernel, wrapper.bits, wrapper.per_channel,
                                     wrapper.fixed_point),
            "bits": wrapper.bits,
            "activation_after_range": None if wrapper.deferred_activation is None else
            wrapper.deferred_activation.__name__,
            "bias": None if bias is None else keras.ops.convert_to_numpy(bias),
            "output_range": output_range}
    if path is not None:
        arrays = {}
        for name, entry in exported.items():
            arrays[f"{name}/codes"], arrays[f"{name}/scales"] = entry["kernel"]
            arrays[f"{name}/bits"] = np.array(entry["bits"])
            if entry["bias"] is not None:
                arrays[f"{name}/bias"] = entry["bias"]
            if entry["output_range"] is not None:
                arrays[f"{name}/output_range"] = np.array(entry["output_range"], np.float32)
        write_atomically(path, lambda stream: np.savez(stream, **arrays), suffix=".npz")
    return exported
