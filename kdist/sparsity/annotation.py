"""Choosing layers for quantization-aware training by marking them first.

`quantize_annotate_layer` marks a layer; `quantize_apply` turns a model's
marked layers into `QuantizeAware` ones and leaves the rest in float. This
is tensorflow-model-optimization's two-step way of quantising part of a
model; `quantize(model, skip=...)` does the same in one call. A layer
marked with a `QuantizeConfig` is quantised as its config says instead
(`QuantizeWithConfig`): that is how a custom layer, or a choice of
quantizers other than kdist's, is quantised.
"""

import warnings

import keras

from kdist import _keras_private
from kdist.sparsity.configured import (QuantizeWithConfig, check_quantize_config,
                                        config_with_quantize_config)
from kdist.sparsity.quantization import quantize
from kdist.sparsity.wrapping import (build_from_call, builds_from_several_inputs, fresh_copy,
                                     kernel_variable, rewrite, wrapper_from_config, wrappers_in)


@keras.saving.register_keras_serializable(package="kdist")
class QuantizeAnnotate(keras.layers.Wrapper):
    """Marks its layer for `quantize_apply`; computes exactly what the layer does.

    It calls its layer with whatever it is called with (several inputs,
    keyword inputs, no inputs), so a marked model trains and predicts as the
    unmarked one.

    Args:
        layer: the layer to mark (not a model).
        quantize_config: a `QuantizeConfig` saying how to quantise the layer,
            or None for kdist's own scheme.
        **kwargs: Keras wrapper arguments; the name defaults to
            `quantize_annotate_<layer name>`.

    Raises:
        ValueError: `layer` is a model.
        TypeError: `quantize_config` lacks a `QuantizeConfig`'s methods.
    """

    def __init__(self, layer, quantize_config=None, **kwargs):
        if isinstance(layer, keras.Model):
            raise ValueError(f"QuantizeAnnotate marks a layer; {layer.name!r} is a model. Use "
                             "quantize_annotate_model to mark a model's layers.")
        kwargs.setdefault("name", f"quantize_annotate_{layer.name}")
        kwargs.setdefault("dtype", layer.dtype_policy)
        super().__init__(layer, **kwargs)
        _keras_private.pass_on_input_shape(self, layer)
        self.quantize_config = check_quantize_config(quantize_config)

    def build(self, input_shape=None):
        # A mark has no weights: a layer built from several inputs (attention) builds
        # itself when the mark first calls it with them all.
        if not builds_from_several_inputs(self.layer):
            super().build(input_shape)
        self.built = True

    def call(self, inputs=None, *args, **kwargs):
        # What the wrapper is called with goes to the layer as given, a layer that takes
        # no inputs (only `training`) included; Keras gives `training` only to a layer
        # whose call takes it.
        if inputs is None and not args:
            return self.layer(**kwargs)
        return self.layer(inputs, *args, **kwargs)

    def compute_output_shape(self, input_shape):
        return self.layer.compute_output_shape(input_shape)

    def compute_output_spec(self, inputs, *args, **kwargs):
        # The layer's own rule, for layers called on several inputs (attention), which
        # are built here from them all.
        if not self.layer.built:
            build_from_call(self.layer, inputs, *args, **kwargs)
        return self.layer.compute_output_spec(inputs, *args, **kwargs)

    copied_by_kdist = True

    def object_arguments(self):
        return {"quantize_config": self.quantize_config}

    def get_config(self):
        config = super().get_config()
        config["quantize_config"] = keras.saving.serialize_keras_object(self.quantize_config)
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        return wrapper_from_config(cls, config_with_quantize_config(config, custom_objects),
                                   custom_objects)


def quantize_annotate_layer(to_annotate, quantize_config=None):
    """Marks one layer to be quantised by `quantize_apply` (as `quantize_config` says).

    Args:
        to_annotate: the layer to mark; a layer already marked is returned as
            it is.
        quantize_config: a `QuantizeConfig` saying how to quantise it, or None
            for kdist's scheme (`QuantizeAware`).

    Returns:
        A `QuantizeAnnotate` around the layer, to use in its place.

    Raises:
        TypeError: `to_annotate` is a model or not a layer (use
            `quantize_annotate_model`), or `quantize_config` lacks a
            `QuantizeConfig`'s methods.

    Example:

        >>> import keras, kdist
        >>> model = keras.Sequential([
        ...     keras.Input((8,)),
        ...     kdist.sparsity.quantize_annotate_layer(keras.layers.Dense(4, activation="relu")),
        ...     keras.layers.Dense(1)])
        >>> quantized = kdist.sparsity.quantize_apply(model)
        >>> [type(layer).__name__ for layer in quantized.layers]
        ['QuantizeAware', 'Dense']
    """
    if not isinstance(to_annotate, keras.layers.Layer) or isinstance(to_annotate, keras.Model):
        raise TypeError("quantize_annotate_layer() takes a layer (use quantize_annotate_model "
                        f"for a model); got {type(to_annotate).__name__}.")
    if isinstance(to_annotate, QuantizeAnnotate):
        return to_annotate
    return QuantizeAnnotate(to_annotate, quantize_config)


def quantize_annotate_model(to_annotate):
    """A copy of a Sequential or functional model with every layer marked.

    The copy has the model's weights; each layer is wrapped in
    `QuantizeAnnotate` without a config. `Lambda` layers stay unmarked (what
    they compute is not known), with a warning: mark one yourself with
    `quantize_annotate_layer(layer, quantize_config)` to quantise it.

    Raises:
        TypeError: `to_annotate` is not a Keras model, or is a subclassed one.
    """
    if not isinstance(to_annotate, keras.Model):
        raise TypeError(f"quantize_annotate_model() takes a Keras model; got "
                        f"{type(to_annotate).__name__}. Use quantize_annotate_layer for a layer.")

    lambdas = []

    def replace(layer):
        if isinstance(layer, (QuantizeAnnotate, keras.layers.InputLayer)):
            return None
        if isinstance(layer, keras.layers.Lambda):
            lambdas.append(layer.name)  # what it computes is not known: left in float
            return None
        fresh = fresh_copy(layer)
        return QuantizeAnnotate(fresh), fresh, layer.get_weights() if layer.built else None

    annotated = rewrite(to_annotate, replace, "quantize_annotate_model")
    if lambdas:
        warnings.warn(f"quantize_annotate_model leaves the Lambda layers {lambdas} unmarked: "
                      "their computation is not known, so they stay in float. Mark one with "
                      "quantize_annotate_layer(layer, quantize_config) to quantise it.",
                      stacklevel=2)
    return annotated


def quantize_apply(model, bits=8, per_channel=True, activations=True, preserve_sparsity=True,
                   name_prefix="quantized_"):
    """Quantises the layers of `model` that were marked, as `quantize()` would.

    This is tensorflow-model-optimization's two-step way of quantising part
    of a model (mark, then apply); `quantize(model, skip=...)` does the same
    in one call. Layers marked with a `QuantizeConfig` become
    `QuantizeWithConfig`, quantised as their config says: that is how a
    custom layer, or a choice of quantizers other than kdist's, is
    quantised. Other marked layers with a kernel become `QuantizeAware`
    (kdist's scheme, weights carried over); marked layers without one, and
    unmarked layers, stay in float.

    Args:
        model: a Sequential or functional model with marked layers.
        bits: see `QuantizeAware`.
        per_channel: see `QuantizeAware`.
        activations: see `QuantizeAware`.
        preserve_sparsity: see `QuantizeAware`.
        name_prefix: wrappers are named `<name_prefix><layer name>`.

    Returns:
        A quantised copy of `model`, with its weights.

    Raises:
        TypeError: `model` is not a Keras model, or is a subclassed one.
        ValueError: no layer of `model` is marked.
    """
    if not isinstance(model, keras.Model):
        raise TypeError(f"quantize_apply() takes a Keras model; got {type(model).__name__}.")
    marked = wrappers_in(model, QuantizeAnnotate)
    if not marked:
        raise ValueError("quantize_apply() found no marked layer in this model: mark layers "
                         "with quantize_annotate_layer, or the whole model with "
                         "quantize_annotate_model.")
    # Marked layers without a kernel (Flatten, pooling) stay in float.
    wanted = {wrapper.layer.name for wrapper in marked if wrapper.quantize_config is None
              and (kernel_variable(wrapper.layer) is not None or not wrapper.layer.built)}

    def unmark(layer):
        if not isinstance(layer, QuantizeAnnotate):
            return None
        inner = layer.layer
        fresh = fresh_copy(inner)
        weights = inner.get_weights() if inner.built else None
        if layer.quantize_config is not None:
            return (QuantizeWithConfig(fresh, layer.quantize_config, name_prefix=name_prefix),
                    fresh, weights)
        return fresh, fresh, weights

    plain = rewrite(model, unmark, "quantize_apply")
    if not wanted:  # every marked layer has its own config, or nothing to quantise
        return plain
    others = [layer.name for layer in _keras_private.flatten_layers(plain, include_self=False)
              if layer.name not in wanted]
    return quantize(plain, bits=bits, per_channel=per_channel, activations=activations,
                    preserve_sparsity=preserve_sparsity, skip=others, name_prefix=name_prefix)
