"""How layers without weights are quantised, as an integer engine runs them.

A layer that only moves, drops or picks values (Reshape, Flatten, Dropout,
padding, cropping, max pooling) keeps its input's grid: nothing to
quantise. A layer that computes new values (average pooling, Add,
Concatenate, ReLU, upsampling) needs its output
requantised: its output goes through an 8-bit moving-average quantizer.
An `Activation` layer is quantised after ReLU-like functions and left alone
after linear, softmax, sigmoid and tanh (integer engines quantise those
from the layer before, or run them on a fixed output range).

`weightless_config(layer)` gives the config for one layer, or None for a
layer it does not know. tensorflow-model-optimization's default scheme
treats these layers the same way; `kdist.tfmot` uses this module for it.
"""

import keras

from kdist.sparsity.configured import QuantizeConfig
from kdist.sparsity.quantizers import MovingAverageQuantizer

_KEPT_ON_GRID = (
    keras.layers.Reshape, keras.layers.Flatten, keras.layers.Permute, keras.layers.Dropout,
    keras.layers.SpatialDropout1D, keras.layers.SpatialDropout2D,
    keras.layers.SpatialDropout3D, keras.layers.ActivityRegularization,
    keras.layers.Cropping1D, keras.layers.Cropping2D, keras.layers.Cropping3D,
    keras.layers.ZeroPadding1D, keras.layers.ZeroPadding2D, keras.layers.ZeroPadding3D,
    keras.layers.MaxPooling1D, keras.layers.MaxPooling2D, keras.layers.MaxPooling3D,
    keras.layers.GlobalMaxPooling1D, keras.layers.GlobalMaxPooling2D,
    keras.layers.GlobalMaxPooling3D, keras.layers.Softmax)

_REQUANTISED = (
    keras.layers.ReLU, keras.layers.LeakyReLU, keras.layers.Add, keras.layers.Concatenate,
    keras.layers.AveragePooling1D, keras.layers.AveragePooling2D,
    keras.layers.AveragePooling3D, keras.layers.GlobalAveragePooling1D,
    keras.layers.GlobalAveragePooling2D, keras.layers.GlobalAveragePooling3D,
    keras.layers.UpSampling1D, keras.layers.UpSampling2D, keras.layers.UpSampling3D)

_ACTIVATIONS_REQUANTISED = frozenset({"relu", "relu6", "leaky_relu", "swish", "silu", "gelu",
                                      "elu", "selu"})
_ACTIVATIONS_LEFT = frozenset({"linear", "softmax", "sigmoid", "tanh"})


def _output_quantizer(bits):
    return MovingAverageQuantizer(num_bits=bits, per_axis=False, symmetric=False,
                                  narrow_range=False)


@keras.saving.register_keras_serializable(package="kdist")
class NoQuantizeConfig(QuantizeConfig):
    """Quantises nothing: the layer keeps its input's grid."""

    def get_weights_and_quantizers(self, layer):
        return []

    def get_activations_and_quantizers(self, layer):
        return []

    def set_quantize_activations(self, layer, quantize_activations):
        pass

    def get_output_quantizers(self, layer):
        return []

    def get_config(self):
        return {}


@keras.saving.register_keras_serializable(package="kdist")
class OutputQuantizeConfig(NoQuantizeConfig):
    """Quantises only the layer's output (`bits` bits, moving-average range)."""

    def __init__(self, bits=8):
        self.bits = bits

    def get_output_quantizers(self, layer):
        if isinstance(layer, keras.layers.Activation):
            name = getattr(layer.activation, "__name__", type(layer.activation).__name__)
            if name in _ACTIVATIONS_LEFT:
                return []
            if name not in _ACTIVATIONS_REQUANTISED:
                raise ValueError(
                    f"Activation layer {layer.name}: {name!r} is not one that integer engines "
                    "run; annotate the layer with a QuantizeConfig of your own.")
        return [_output_quantizer(self.bits)]

    def get_config(self):
        return {"bits": self.bits}


def weightless_config(layer, bits=8):
    """The `QuantizeConfig` for a Keras layer without weights, or None if not known.

    >>> import keras
    >>> type(weightless_config(keras.layers.Flatten())).__name__
    'NoQuantizeConfig'
    >>> weightless_config(keras.layers.Add()).get_output_quantizers(keras.layers.Add())[0]
    ... # doctest: +ELLIPSIS
    <kdist.sparsity.quantizers.MovingAverageQuantizer object at ...>
    """
    kind = type(layer)
    if kind in _KEPT_ON_GRID:
        return NoQuantizeConfig()
    if kind in _REQUANTISED or kind is keras.layers.Activation:
        return OutputQuantizeConfig(bits)
    return None
