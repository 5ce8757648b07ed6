"""Choosing layers for quantization-aware training by marking them first.

`quantize_annotate_layer` marks a layer; `quantize_apply` turns a model's
marked layers into `QuantizeAware` ones and leaves the rest in float. This
is tensorflow-model-optimization's two-step way of quantising part of a
model; `quantize(model, skip=...)` does the same in one call.
"""

import keras

from kdist import _keras_private
from kdist.sparsity.quantization import quantize
from kdist.sparsity.wrapping import rewrite, wrapper_from_config, wrappers_in


@keras.saving.register_keras_serializable(package="kdist")
class QuantizeAnnotate(keras.layers.Wrapper):
    """Marks its layer for `quantize_apply`; computes exactly what the layer does."""

    def __init__(self, layer, **kwargs):
        kwargs.setdefault("name", f"quantize_annotate_{layer.name}")
        kwargs.setdefault("dtype", layer.dtype_policy)
        super().__init__(layer, **kwargs)
        self._input_shape_arg = (getattr(self, "_input_shape_arg", None)
                                 or getattr(layer, "_input_shape_arg", None))
        # tfmot's attribute; kdist has one quantisation scheme and no configs.
        self.quantize_config = None

    def call(self, inputs, *args, **kwargs):
        return self.layer(inputs, *args, **kwargs)

    def compute_output_shape(self, input_shape):
        return self.layer.compute_output_shape(input_shape)

    @classmethod
    def from_config(cls, config, custom_objects=None):
        return wrapper_from_config(cls, config, custom_objects)


def _no_config(quantize_config):
    if quantize_config is not None:
        raise ValueError(
            "quantize_config is not supported: kdist quantises a layer's kernel (symmetric, "
            "per channel) and its output, at the bit width given to quantize_apply. Leave "
            "quantize_config out, or call kdist.sparsity.quantize(model, bits=..., "
            "per_channel=..., activations=..., skip=...) for other choices.")


def quantize_annotate_layer(to_annotate, quantize_config=None):
    """Marks one layer to be quantised by `quantize_apply`.

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
    _no_config(quantize_config)
    if not isinstance(to_annotate, keras.layers.Layer) or isinstance(to_annotate, keras.Model):
        raise TypeError("quantize_annotate_layer() takes a layer (use quantize_annotate_model "
                        f"for a model); got {type(to_annotate).__name__}.")
    if isinstance(to_annotate, QuantizeAnnotate):
        return to_annotate
    return QuantizeAnnotate(to_annotate)


def quantize_annotate_model(to_annotate):
    """A copy of a Sequential or functional model with every layer marked."""
    if not isinstance(to_annotate, keras.Model):
        raise TypeError(f"quantize_annotate_model() takes a Keras model; got "
                        f"{type(to_annotate).__name__}. Use quantize_annotate_layer for a layer.")

    def replace(layer):
        if isinstance(layer, (QuantizeAnnotate, keras.layers.InputLayer)):
            return None
        fresh = type(layer).from_config(layer.get_config())
        return QuantizeAnnotate(fresh), fresh, layer.get_weights() if layer.built else None

    return rewrite(to_annotate, replace, "quantize_annotate_model")


def quantize_apply(model, bits=8, per_channel=True, activations=True, preserve_sparsity=True):
    """Quantises the layers of `model` that were marked, as `quantize()` would.

    Marked layers with a kernel become `QuantizeAware` (weights carried
    over); marked layers without one, and unmarked layers, stay in float.

    Args:
        model: a Sequential or functional model with marked layers.
        bits: see `QuantizeAware`.
        per_channel: see `QuantizeAware`.
        activations: see `QuantizeAware`.
        preserve_sparsity: see `QuantizeAware`.
    """
    if not isinstance(model, keras.Model):
        raise TypeError(f"quantize_apply() takes a Keras model; got {type(model).__name__}.")
    marked = wrappers_in(model, QuantizeAnnotate)
    if not marked:
        raise ValueError("quantize_apply() found no marked layer in this model: mark layers "
                         "with quantize_annotate_layer, or the whole model with "
                         "quantize_annotate_model.")
    wanted = {wrapper.layer.name for wrapper in marked}

    def unmark(layer):
        if not isinstance(layer, QuantizeAnnotate):
            return None
        inner = layer.layer
        fresh = type(inner).from_config(inner.get_config())
        return fresh, fresh, inner.get_weights() if inner.built else None

    plain = rewrite(model, unmark, "quantize_apply")
    others = [layer.name for layer in _keras_private.flatten_layers(plain, include_self=False)
              if layer.name not in wanted]
    return quantize(plain, bits=bits, per_channel=per_channel, activations=activations,
                    preserve_sparsity=preserve_sparsity, skip=others)
