"""Quantisation chosen layer by layer: a `QuantizeConfig` says what and how.

A config names, for one layer, the weights to quantise and their
quantizers, the activations to quantise, and quantizers for the layer's
output (`kdist.sparsity.quantizers`). `QuantizeWithConfig` applies it:
quantised weights replace the variables' values while the layer runs (in a
`keras.StatelessScope`, as `KernelWrapper` does), so the layer's code runs
unchanged; activations are replaced through the config's
`set_quantize_activations`. This is tensorflow-model-optimization's
`QuantizeConfig`, for Keras 3 layers, with one difference: Keras 3 layers
read their variables (a Dense's `kernel` is a read-only property), so
`set_quantize_weights` is never called and need not be written.
"""

import abc

import keras

from kdist import _keras_private
from kdist.sparsity.wrapping import check_buildable, wrapper_from_config

# Activations whose inputs an integer engine quantises (they saturate, and their
# own outputs have a fixed range) and those whose outputs it quantises.
_QUANTISED_BEFORE = frozenset({"softmax", "sigmoid", "tanh", "gelu"})
_QUANTISED_AFTER = frozenset({"linear", "relu", "swish", "silu", "gelu"})


class QuantizeConfig(abc.ABC):
    """What to quantise in one layer, and with which quantizers.

    A config names, for one layer, the weights to quantise and their
    quantizers, the activations to quantise, and quantizers for the layer's
    output; `QuantizeWithConfig` applies it. This is
    tensorflow-model-optimization's `QuantizeConfig`, for Keras 3 layers.

    A subclass defines `get_weights_and_quantizers`,
    `get_activations_and_quantizers`, `set_quantize_activations`,
    `get_output_quantizers` and `get_config` (all abstract).
    `set_quantize_weights` is optional and never called: Keras 3 layers read
    their variables (a Dense's `kernel` is a read-only property), so kdist
    gives the layer its quantised weights itself. A config may answer None
    for "nothing". `from_config(config)` calls the class with the config's
    items as arguments.

    Example, a Dense layer's kernel in 4 bits and its output after ReLU in 8:

        >>> import keras, kdist
        >>> from kdist.sparsity import LastValueQuantizer, MovingAverageQuantizer
        >>> class DenseIn4Bits(kdist.sparsity.QuantizeConfig):
        ...     def get_weights_and_quantizers(self, layer):
        ...         return [(layer.kernel, LastValueQuantizer(4, False, True, False))]
        ...     def get_activations_and_quantizers(self, layer):
        ...         return [(layer.activation, MovingAverageQuantizer(8, False, False, False))]
        ...     def set_quantize_activations(self, layer, quantize_activations):
        ...         layer.activation = quantize_activations[0]
        ...     def get_output_quantizers(self, layer):
        ...         return []
        ...     def get_config(self):
        ...         return {}
        >>> layer = kdist.sparsity.QuantizeWithConfig(
        ...     keras.layers.Dense(3, activation="relu"), DenseIn4Bits())
        >>> layer.build((None, 5))
        >>> layer.name.startswith("quant_dense")
        True
    """

    @abc.abstractmethod
    def get_weights_and_quantizers(self, layer):
        """`[(variable, quantizer), ...]`: `layer`'s weights to quantise."""

    @abc.abstractmethod
    def get_activations_and_quantizers(self, layer):
        """`[(activation, quantizer), ...]`: `layer`'s activations to quantise."""

    def set_quantize_weights(self, layer, quantize_weights):
        """Not called: kdist gives the layer its quantised weights itself."""

    @abc.abstractmethod
    def set_quantize_activations(self, layer, quantize_activations):
        """Puts the quantising activations (in the order given) into `layer`."""

    @abc.abstractmethod
    def get_output_quantizers(self, layer):
        """Quantizers for the layer's output: `[]` or one."""

    @abc.abstractmethod
    def get_config(self):
        """The config's arguments, so that saved models load."""

    @classmethod
    def from_config(cls, config):
        return cls(**config)


_CONFIG_METHODS = ("get_weights_and_quantizers", "get_activations_and_quantizers",
                   "set_quantize_activations", "get_output_quantizers")


def check_quantize_config(quantize_config):
    """`quantize_config` if it has a `QuantizeConfig`'s methods (None passes); else TypeError."""
    for method in _CONFIG_METHODS:
        if quantize_config is not None and not callable(getattr(quantize_config, method, None)):
            raise TypeError(f"quantize_config must be a QuantizeConfig "
                            f"(kdist.sparsity.QuantizeConfig); {type(quantize_config).__name__} "
                            f"has no {method}().")
    return quantize_config


def config_with_quantize_config(config, custom_objects=None):
    """A wrapper's `config` with its `quantize_config` deserialised (if still a dict)."""
    config = dict(config)
    if isinstance(config.get("quantize_config"), dict):
        config["quantize_config"] = keras.saving.deserialize_keras_object(
            config["quantize_config"], custom_objects=custom_objects)
    return config


def _activation_name(activation):
    return getattr(activation, "__name__", type(activation).__name__)


@keras.saving.register_keras_serializable(package="kdist")
class QuantizeAwareActivation:
    """An activation with its input or output fake-quantised, as an integer engine runs it.

    `QuantizeWithConfig` puts it in the layer in place of each activation a
    config's `get_activations_and_quantizers` names. Linear, ReLU, swish,
    SiLU: the output is quantised (the engine fuses them into the layer
    before). Softmax, sigmoid, tanh: the input is (their output range is
    fixed). GELU: both. Serialised, it is its plain activation, so a saved
    model holds the plain layer.

    Args:
        activation: one of Keras's activations above.
        quantizer: the `Quantizer` to apply.
        quantize_wrapper: the layer on which the quantizer's variables are
            created (the `QuantizeWithConfig`).

    Raises:
        ValueError: an activation other than those above (quantise the layer's
            output with `get_output_quantizers` instead).
    """

    def __init__(self, activation, quantizer, quantize_wrapper):
        name = _activation_name(activation)
        if name not in _QUANTISED_BEFORE | _QUANTISED_AFTER:
            raise ValueError(
                f"Activation {name!r} cannot be quantised by name: only Keras's "
                f"{sorted(_QUANTISED_BEFORE | _QUANTISED_AFTER)} are known. Leave it out of "
                "get_activations_and_quantizers and quantise the layer's output with "
                "get_output_quantizers instead.")
        self.activation = activation
        self.quantizer = quantizer
        self.training = False
        self._before = self._after = None
        if name in _QUANTISED_BEFORE:
            self._before = quantizer.build(None, "pre_activation", quantize_wrapper)
        if name in _QUANTISED_AFTER:
            self._after = quantizer.build(None, "post_activation", quantize_wrapper)

    @property
    def __name__(self):
        return _activation_name(self.activation)

    def __call__(self, inputs, *args, **kwargs):
        if self._before is not None:
            inputs = self.quantizer(inputs, self.training, self._before)
        outputs = self.activation(inputs, *args, **kwargs)
        if self._after is not None:
            outputs = self.quantizer(outputs, self.training, self._after)
        return outputs

    def get_config(self):
        return {"activation": keras.activations.serialize(self.activation)}

    @classmethod
    def from_config(cls, config):
        return keras.activations.deserialize(config["activation"])


@keras.saving.register_keras_serializable(package="kdist")
class QuantizeWithConfig(keras.layers.Wrapper):
    """Trains `layer` quantised as `quantize_config` says.

    While the layer runs, the quantised weights are substituted for the
    variables' values (in a `keras.StatelessScope`), so the layer's own code
    runs unchanged and gradients reach the float weights; the config's
    activations are replaced by `QuantizeAwareActivation`s through its
    `set_quantize_activations`, and its output quantizer (one at most) is
    applied to the output. `kdist.sparsity.strip` turns it back into the
    plain layer, with the weights as inference sees them.

    Args:
        layer: any Keras layer (not a model).
        quantize_config: a `QuantizeConfig` for this layer.
        name_prefix: the wrapper is named `<name_prefix><layer name>`.
        **kwargs: Keras wrapper arguments (`name`, `dtype`).

    Raises:
        ValueError: `layer` is a model or not a layer, or `quantize_config` is
            None; when built, the config names a variable that is not the
            layer's; when called, an output quantizer meets a layer with
            several outputs.
        TypeError: `quantize_config` lacks a `QuantizeConfig`'s methods.
    """

    copied_by_kdist = True

    def __init__(self, layer, quantize_config, name_prefix="quant_", **kwargs):
        if not isinstance(layer, keras.layers.Layer) or isinstance(layer, keras.Model):
            raise ValueError(f"`layer` can only be a Keras layer (not a model); got "
                             f"{type(layer).__name__}.")
        if quantize_config is None:
            raise ValueError("quantize_config cannot be None: it says how to quantise "
                             f"{layer.name}.")
        check_quantize_config(quantize_config)
        kwargs.setdefault("name", f"{name_prefix or ''}{layer.name}")
        kwargs.setdefault("dtype", layer.dtype_policy)
        super().__init__(layer, **kwargs)
        _keras_private.pass_on_input_shape(self, layer)
        self.quantize_config = quantize_config

    def object_arguments(self):
        """What `kdist.sparsity.wrapping.fresh_copy` passes on as an object."""
        return {"quantize_config": self.quantize_config}

    def build(self, input_shape=None):
        check_buildable(self, self.layer)
        super().build(input_shape)
        config, layer = self.quantize_config, self.layer
        owned = {id(variable) for variable in layer.variables}
        self._weight_quantizers = []
        # A config may answer None for "nothing", as tfmot's own test configs do.
        for weight, quantizer in config.get_weights_and_quantizers(layer) or []:
            if id(weight) not in owned:
                raise ValueError(
                    f"{type(config).__name__}.get_weights_and_quantizers must name variables "
                    f"of {layer.name}; {getattr(weight, 'path', weight)!r} is not one.")
            name = weight.name.split("/")[-1].split(":")[0]
            self._weight_quantizers.append(
                (weight, quantizer, quantizer.build(weight.shape, name, self)))
        pairs = config.get_activations_and_quantizers(layer) or []
        self._plain_activations = [activation for activation, _ in pairs]
        self._activations = [QuantizeAwareActivation(activation, quantizer, self)
                             for activation, quantizer in pairs]
        if self._activations:
            config.set_quantize_activations(layer, self._activations)
        self._output_quantizers = list(config.get_output_quantizers(layer) or [])
        self._output_variables = None
        if self._output_quantizers:
            shape = layer.compute_output_shape(input_shape)
            self._output_variables = self._output_quantizers[0].build(shape, "output", self)
        self.built = True

    def call(self, inputs, *args, training=None, **kwargs):
        training = bool(training)
        # Quantizers get tensors (a variable's value is a variable again under TF).
        given = {id(weight): quantizer(keras.ops.copy(weight.value), training, variables)
                 for weight, quantizer, variables in self._weight_quantizers}
        for activation in self._activations:
            activation.training = training
        inner = {id(variable) for variable in self.layer.variables}
        own = [variable for variable in self.variables if id(variable) not in inner]
        mapping = [(variable, given.get(id(variable), variable.value))
                   for variable in self.layer.variables + own]
        with keras.StatelessScope(mapping, collect_losses=True) as scope:
            outputs = self.layer(inputs, *args, training=training, **kwargs)
        # Statistics the layer or an activation quantizer updated in the scope are kept.
        for variable, value in mapping:
            updated = scope.get_current_value(variable)
            if updated is not None and updated is not value:
                variable.assign(updated)
        for loss in scope.losses:
            self.add_loss(loss)
        if self._output_quantizers:
            if isinstance(outputs, (list, tuple)):
                raise ValueError(f"{self.layer.name} has several outputs; an output quantizer "
                                 "quantises one.")
            outputs = self._output_quantizers[0](outputs, training, self._output_variables)
        return outputs

    def compute_output_shape(self, input_shape):
        return self.layer.compute_output_shape(input_shape)

    def compute_output_spec(self, inputs, *args, **kwargs):
        # The layer's own rule, for layers called on several inputs (attention).
        return self.layer.compute_output_spec(inputs, *args, **kwargs)

    @property
    def base_layer(self):
        return self.layer

    def stripped_layer(self):
        """A new plain layer configured as the wrapped one, with its plain activations."""
        return type(self.layer).from_config(self.get_config()["layer"]["config"])

    def strip_weights(self):
        """The layer's weights, those the config quantises as inference sees them."""
        seen = {id(weight): quantizer(weight.value, False, variables)
                for weight, quantizer, variables in self._weight_quantizers}
        return [keras.ops.convert_to_numpy(seen.get(id(weight), weight.value))
                for weight in self.layer.weights]

    def get_config(self):
        # The layer is saved with its plain activations; the config puts the
        # quantising ones back when the loaded wrapper is built.
        swapped = self.built and self._activations
        if swapped:
            self.quantize_config.set_quantize_activations(self.layer, self._plain_activations)
        try:
            config = super().get_config()
        finally:
            if swapped:
                self.quantize_config.set_quantize_activations(self.layer, self._activations)
        config["quantize_config"] = keras.saving.serialize_keras_object(self.quantize_config)
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        return wrapper_from_config(cls, config_with_quantize_config(config, custom_objects),
                                   custom_objects)
