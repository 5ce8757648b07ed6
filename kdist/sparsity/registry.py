"""A `QuantizeConfig` for each Keras layer, as an 8-bit integer engine runs it.

`QuantizeRegistry().get_quantize_config(layer)` answers with:

- for a layer with a kernel (Dense, the convolutions, Conv2DTranspose): its
  kernel quantised symmetrically over its own range (`LastValueQuantizer`,
  narrow range; one range per output channel for convolutions), and its
  activation's output over a moving-average range (`KernelQuantizeConfig`);
- for a layer without weights: what `kdist.sparsity.weightless` says.

Wrapping a layer in `QuantizeWithConfig` with that config quantises it as
tensorflow-model-optimization's default 8-bit scheme does (kdist.tfmot
offers it under that scheme's registry name). Ranges start at [-6, 6]
until training moves them.
"""

import keras

from kdist.sparsity.configured import QuantizeConfig
from kdist.sparsity.quantizers import LastValueQuantizer, MovingAverageQuantizer
from kdist.sparsity.weightless import weightless_config

# The kernel a layer multiplies with, by layer class; convolutions get one range per
# output channel (their kernels' last axis).
_KERNELS = {
    keras.layers.Dense: ("kernel", False),
    keras.layers.Conv1D: ("kernel", True),
    keras.layers.Conv2D: ("kernel", True),
    keras.layers.Conv3D: ("kernel", True),
    keras.layers.Conv1DTranspose: ("kernel", False),
    keras.layers.Conv2DTranspose: ("kernel", False),
    keras.layers.Conv3DTranspose: ("kernel", False),
    keras.layers.DepthwiseConv1D: ("depthwise_kernel", False),
    keras.layers.DepthwiseConv2D: ("depthwise_kernel", False),
}


@keras.saving.register_keras_serializable(package="kdist")
class KernelQuantizeConfig(QuantizeConfig):
    """A layer's kernel (`weight`, per output channel if `per_axis`) and the output of
    its activation in `bits` bits.

    The weight is quantised symmetrically over its own range, narrow range
    (`LastValueQuantizer`); the activation's output over a moving-average
    range (`MovingAverageQuantizer`). Nothing else of the layer is quantised.

    Args:
        weight: the name of the layer's attribute holding the weight.
        per_axis: one range per output channel (the weight's last axis).
        bits: bits of both grids.
    """

    def __init__(self, weight="kernel", per_axis=False, bits=8):
        self.weight, self.per_axis, self.bits = str(weight), bool(per_axis), int(bits)

    def get_weights_and_quantizers(self, layer):
        return [(getattr(layer, self.weight),
                 LastValueQuantizer(self.bits, self.per_axis, True, True))]

    def get_activations_and_quantizers(self, layer):
        if getattr(layer, "activation", None) is None:
            return []
        return [(layer.activation, MovingAverageQuantizer(self.bits, False, False, False))]

    def set_quantize_activations(self, layer, quantize_activations):
        if quantize_activations:
            layer.activation = quantize_activations[0]

    def get_output_quantizers(self, layer):
        return []

    def get_config(self):
        return {"weight": self.weight, "per_axis": self.per_axis, "bits": self.bits}


class QuantizeRegistry:
    """The default `QuantizeConfig` of each Keras layer it knows.

    `get_quantize_config(layer)` answers with:

    - for Dense, the convolutions (Conv1D/2D/3D, their transposes,
      DepthwiseConv1D/2D): a `KernelQuantizeConfig`, the kernel quantised
      symmetrically over its own range (one range per output channel for
      Conv1D/2D/3D, one per kernel for the others), and the activation's
      output over a moving-average range;
    - for a layer without weights, what an integer engine needs: nothing
      for layers that move, drop or pick values (Reshape, Flatten, Permute,
      Dropout, cropping, padding, max pooling, Softmax), the output over a
      moving-average range for layers that compute new values (ReLU,
      LeakyReLU, Add, Concatenate, average pooling, upsampling, and an
      `Activation` layer after a ReLU-like function; none after linear,
      softmax, sigmoid or tanh).

    Wrapping a layer in `QuantizeWithConfig` with that config quantises it as
    tensorflow-model-optimization's default 8-bit scheme does; `kdist.tfmot`
    offers this registry as
    `quantization.keras.default_8bit.Default8BitQuantizeRegistry`. Ranges start
    at [-6, 6] until training moves them. The layer's exact class counts: a
    subclass of a Keras layer has no default config.

    Args:
        bits: bits of every grid.

    Example:

        >>> import keras
        >>> registry = QuantizeRegistry()
        >>> registry.supports(keras.layers.Dense(2)), registry.supports(keras.layers.LSTM(2))
        (True, False)
        >>> registry.get_quantize_config(keras.layers.Conv2D(2, 3)).get_config()
        {'weight': 'kernel', 'per_axis': True, 'bits': 8}
    """

    def __init__(self, bits=8):
        self.bits = int(bits)

    def supports(self, layer):
        """Whether this registry has a config for `layer` (its exact class)."""
        return type(layer) in _KERNELS or weightless_config(layer, self.bits) is not None

    def get_quantize_config(self, layer):
        """The config for `layer`.

        Raises:
            ValueError: a layer this registry has no config for (give it a
                `QuantizeConfig` of your own). The config of an `Activation`
                layer whose function integer engines do not run raises it
                when asked for its output quantizers.
        """
        kind = type(layer)
        if kind in _KERNELS:
            weight, per_axis = _KERNELS[kind]
            return KernelQuantizeConfig(weight, per_axis, self.bits)
        config = weightless_config(layer, self.bits)
        if config is None:
            raise ValueError(
                f"No default quantisation for {kind.__module__}.{kind.__name__} "
                f"({getattr(layer, 'name', layer)!r}): give the layer a QuantizeConfig of "
                "your own.")
        return config
