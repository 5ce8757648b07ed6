"""A quantised model's inputs and outputs: `QuantizeLayer` and fixed ranges.

An integer engine takes integer inputs, so a model trained for one sees
its inputs on a grid too: `quantize_inputs` puts a `QuantizeLayer` after
each input. When the range of the inputs or outputs is known (pixels in
[0, 255], a classifier's probabilities), `fix_input_output_range` fixes it
instead of tracking it; `remove_input_range` takes the input quantisation
away again (a model fed by another quantised model). These are
tensorflow-model-optimization's model edits, for Keras 3 models.
"""

import keras

from kdist import _keras_private
from kdist.sparsity.configured import QuantizeConfig, QuantizeWithConfig
from kdist.sparsity.quantization import QuantizeAware
from kdist.sparsity.quantizers import AllValuesQuantizer, FixedQuantizer, Quantizer
from kdist.sparsity.wrapping import fresh_copy, fresh_inputs, rewrite


@keras.saving.register_keras_serializable(package="kdist")
class QuantizeLayer(keras.layers.Layer):
    """Passes its input on fake-quantised by `quantizer` (None: unchanged).

    An integer engine takes integer inputs, so a model trained for one sees
    its inputs on a grid too: `quantize_inputs` puts one after each input.

    Args:
        quantizer: a `Quantizer`, whose variables are created on this layer,
            or None.
        **kwargs: Keras layer arguments, such as `name`.

    Raises:
        ValueError: `quantizer` is neither a `Quantizer` nor None.
    """

    def __init__(self, quantizer, **kwargs):
        super().__init__(**kwargs)
        if quantizer is not None and not isinstance(quantizer, Quantizer):
            raise ValueError(f"quantizer must be a kdist.sparsity.Quantizer or None; got "
                             f"{type(quantizer).__name__}.")
        self.quantizer = quantizer
        self._quantizer_variables = {}

    def build(self, input_shape):
        if self.quantizer is not None:
            self._quantizer_variables = self.quantizer.build(input_shape, self.name, self)
        self.built = True

    def call(self, inputs, training=None):
        if self.quantizer is None:
            return inputs
        return self.quantizer(inputs, bool(training), self._quantizer_variables)

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        config = super().get_config()
        config["quantizer"] = (None if self.quantizer is None else
                               keras.saving.serialize_keras_object(self.quantizer))
        return config

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        if isinstance(config.get("quantizer"), dict):
            config["quantizer"] = keras.saving.deserialize_keras_object(config["quantizer"])
        return cls(**config)


def _input_quantizer():
    return AllValuesQuantizer(num_bits=8, per_axis=False, symmetric=False, narrow_range=False)


@keras.saving.register_keras_serializable(package="kdist")
class OutputOnlyConfig(QuantizeConfig):
    """Another config's activations and output quantizers, without its weights: for a
    float layer whose output a quantised layer reads, so that it reads values on a grid.

    `get_config()["quantize_config"]` is the other config itself (Keras serialises
    it with the wrapper).
    """

    def __init__(self, quantize_config):
        if isinstance(quantize_config, dict):
            quantize_config = keras.saving.deserialize_keras_object(quantize_config)
        self.quantize_config = quantize_config

    def get_weights_and_quantizers(self, layer):
        return []

    def get_activations_and_quantizers(self, layer):
        return self.quantize_config.get_activations_and_quantizers(layer)

    def set_quantize_activations(self, layer, quantize_activations):
        self.quantize_config.set_quantize_activations(layer, quantize_activations)

    def get_output_quantizers(self, layer):
        return self.quantize_config.get_output_quantizers(layer)

    def get_config(self):
        return {"quantize_config": self.quantize_config}


def _quantised(layer):
    """Whether `layer` computes quantised, and so reads its inputs quantised (a float
    layer whose output alone is quantised does not)."""
    if isinstance(layer, QuantizeWithConfig):
        return not isinstance(layer.quantize_config, OutputOnlyConfig)
    return isinstance(layer, QuantizeAware)


def quantize_inputs(model, quantizer=None, only_before_quantized=False):
    """A copy of `model` (weights included) with a `QuantizeLayer` after each input.

    The layers are named `quantize_layer`, `quantize_layer_1`, ... in the
    order of the model's inputs.

    Args:
        model: a Sequential or functional model.
        quantizer: a function giving a fresh `Quantizer` per input; by default
            8 bits over the widest range seen (`AllValuesQuantizer`), as
            tensorflow-model-optimization quantises inputs.
        only_before_quantized: quantise only what quantised layers read (an
            input read by float layers stays as it is), as
            tensorflow-model-optimization's `quantize_apply` does. A layer
            wrapped in `QuantizeWithConfig` with a
            `kdist.sparsity.inputs.OutputOnlyConfig` counts as float here: it
            reads its input in float. An `OutputOnlyConfig(quantize_config)` is
            another config without its weights (its activations and output
            quantizers only, `get_config()["quantize_config"]` being that
            config), for a float layer whose output a quantised layer reads.

    Raises:
        TypeError: `model` is not a Sequential or functional model.
    """
    make = quantizer or _input_quantizer
    fills = []

    def copy(layer):
        fresh = fresh_copy(layer)
        fills.append((fresh, layer.get_weights() if layer.built else None))
        return fresh

    if isinstance(model, keras.Sequential):
        first = model.inputs[0]
        reader = [] if only_before_quantized and not (
            model.layers and _quantised(model.layers[0])) else [
            QuantizeLayer(make(), name="quantize_layer")]
        result = keras.Sequential(
            [keras.Input(batch_shape=first.shape, dtype=first.dtype,
                         name=_keras_private.producing_layer_name(first))] + reader
            + [copy(l) for l in model.layers], name=model.name)
    elif _keras_private.is_functional(model):
        structure = fresh_inputs(model)
        inputs = keras.tree.flatten(structure)
        quantized = {id(tensor): QuantizeLayer(
            make(), name="quantize_layer" + ("" if i == 0 else f"_{i}"))(tensor)
            for i, tensor in enumerate(inputs)}

        def through_quantizers(layer, *args, **kwargs):
            # A layer that read an input reads it quantised (a QuantizeLayer no layer
            # reads is not part of the model).
            if not only_before_quantized or _quantised(layer):
                args, kwargs = keras.tree.map_structure(
                    lambda value: quantized.get(id(value), value), (args, kwargs))
            return layer(*args, **kwargs)

        clone = keras.models.clone_model(model, input_tensors=structure, clone_function=copy,
                                         call_function=through_quantizers)
        result = keras.Model(clone.input, clone.output, name=model.name)
    else:
        raise TypeError(f"quantize_inputs takes a Sequential or functional model; got "
                        f"{type(model).__name__}.")
    for fresh, weights in fills:
        if weights and fresh.built:
            fresh.set_weights(weights)
    return result


def input_quantize_layers(model):
    """The `QuantizeLayer`s that read `model`'s inputs."""
    if not isinstance(model, keras.Model):
        raise TypeError(f"Expected a Keras model; got {type(model).__name__}.")
    return [layer for layer in _keras_private.flatten_layers(model, include_self=False)
            if isinstance(layer, QuantizeLayer)
            and any(tensor is model_input for model_input in model.inputs
                    for tensor in _keras_private.inbound_tensors(layer))]


def _output_layers(model):
    return {_keras_private.producing_layer_name(tensor) for tensor in model.outputs}


@keras.saving.register_keras_serializable(package="kdist")
class FixedRangeConfig(QuantizeConfig):
    """Another config with its activations and output quantised over a fixed range."""

    def __init__(self, config, num_bits, init_min, init_max, narrow_range):
        if isinstance(config, dict):
            config = keras.saving.deserialize_keras_object(config)
        self.config = config
        self.fixed = FixedQuantizer(num_bits, init_min, init_max, narrow_range)

    def get_weights_and_quantizers(self, layer):
        return self.config.get_weights_and_quantizers(layer)

    def get_activations_and_quantizers(self, layer):
        return [(activation, self.fixed) for activation, _ in
                self.config.get_activations_and_quantizers(layer)]

    def set_quantize_activations(self, layer, quantize_activations):
        self.config.set_quantize_activations(layer, quantize_activations)

    def get_output_quantizers(self, layer):
        return [self.fixed for _ in self.config.get_output_quantizers(layer)]

    def get_config(self):
        fixed = self.fixed.get_config()
        return {"config": keras.saving.serialize_keras_object(self.config),
                "num_bits": fixed["num_bits"], "init_min": fixed["init_min"],
                "init_max": fixed["init_max"], "narrow_range": fixed["narrow_range"]}


def _check_quantised_inputs(model, caller):
    found = input_quantize_layers(model)
    if not found:
        raise ValueError(f"{caller}: `model` should be already quantized: no QuantizeLayer "
                         "reads its inputs (quantize it with kdist.tfmot's quantize_model or "
                         "quantize_apply, or kdist.sparsity.quantize_inputs).")
    return {layer.name for layer in found}


def fix_input_output_range(model, num_bits=8, input_min=0.0, input_max=1.0, output_min=0.0,
                           output_max=1.0, narrow_range=False):
    """A copy of a quantised `model` with fixed input and output ranges.

    For inputs or outputs whose range is known (pixels in [0, 1], a
    classifier's probabilities), instead of ranges tracked in training. The
    inputs' `QuantizeLayer`s get a `FixedQuantizer(num_bits, input_min,
    input_max, narrow_range)`; the output layers quantise their activations
    and outputs over `[output_min, output_max]` on `num_bits` bits (a
    `QuantizeAware` output layer through its `output_range`, `output_bits`
    and `output_narrow_range`). This is tensorflow-model-optimization's
    model edit of the same name, for Keras 3 models.

    Raises:
        ValueError: no `QuantizeLayer` reads the model's inputs (quantise it
            with `quantize_inputs`, or `kdist.tfmot`'s `quantize_model` or
            `quantize_apply`, first); `num_bits` outside 2 to 16; a minimum
            not below its maximum.
    """
    inputs = _check_quantised_inputs(model, "fix_input_output_range")
    FixedQuantizer(num_bits, output_min, output_max, narrow_range)  # checks the arguments
    outputs = _output_layers(model)

    def fix(layer):
        if layer.name in inputs:
            fixed = QuantizeLayer(FixedQuantizer(num_bits, input_min, input_max, narrow_range),
                                  name=layer.name)
            return fixed, fixed, None
        if layer.name not in outputs:
            return None
        if isinstance(layer, QuantizeWithConfig):
            inner = fresh_copy(layer.layer)
            config = FixedRangeConfig(layer.quantize_config, num_bits, output_min, output_max,
                                      narrow_range)
            return (QuantizeWithConfig(inner, config, name=layer.name), inner,
                    layer.layer.get_weights() if layer.built else None)
        if isinstance(layer, QuantizeAware):
            config = layer.get_config()
            config.update(output_range=(output_min, output_max), output_bits=num_bits,
                          output_narrow_range=narrow_range)
            config["layer"] = fresh_copy(layer.layer)
            fixed = QuantizeAware.from_config(config)
            ranged.append(fixed)
            return fixed, fixed, layer.get_weights() if layer.built else None
        return None

    ranged = []
    copy = rewrite(model, fix, "fix_input_output_range")
    for wrapper in ranged:  # the tracked range was copied over with the weights
        if wrapper.built:
            wrapper.output_min.assign(output_min)
            wrapper.output_max.assign(output_max)
            wrapper.range_seen.assign(1.0)
    return copy


def remove_input_range(model):
    """A copy of a quantised `model` whose inputs are no longer quantised.

    Its input `QuantizeLayer`s pass values on unchanged: for a model fed by
    another quantised model.

    Raises:
        ValueError: no `QuantizeLayer` reads the model's inputs.
    """
    inputs = _check_quantised_inputs(model, "remove_input_range")

    def remove(layer):
        if layer.name not in inputs:
            return None
        plain = QuantizeLayer(None, name=layer.name)
        return plain, plain, None

    return rewrite(model, remove, "remove_input_range")
