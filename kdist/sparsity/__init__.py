"""Pruning and quantization-aware training for Keras 3 models.

>>> import keras, kdist
>>> model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16),
...                           keras.layers.Dense(1)])
>>> model = kdist.sparsity.prune(model, kdist.sparsity.PolynomialDecay(0.0, 0.8, 0, 1000))
>>> model.compile("adam", "mse")  # then fit with callbacks=[kdist.sparsity.UpdatePruning()]
>>> final = kdist.sparsity.strip(model)

tf_keras models are handed to tensorflow-model-optimization (extra `tfmot`).
"""

from kdist.sparsity.callbacks import UpdatePruning, sparsity_of
from kdist.sparsity.pruning import PruneLowMagnitude, magnitude_mask, prune, pruned_layers
from kdist.sparsity.quantization import (QuantizeAware, export_quantized, fake_quantize,
                                         quantize, quantize_array)
from kdist.sparsity.schedules import ConstantSparsity, PolynomialDecay, PruningSchedule
from kdist.sparsity.wrapping import KernelWrapper, strip

__all__ = [
    "ConstantSparsity", "KernelWrapper", "PolynomialDecay", "PruneLowMagnitude",
    "PruningSchedule", "QuantizeAware", "UpdatePruning", "export_quantized", "fake_quantize",
    "magnitude_mask", "prune", "pruned_layers", "quantize", "quantize_array", "sparsity_of",
    "strip",
]
