"""Pruning and quantization-aware training for Keras 3 models.

>>> import keras, kdist
>>> model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16),
...                           keras.layers.Dense(1)])
>>> model = kdist.sparsity.prune(model, kdist.sparsity.PolynomialDecay(0.0, 0.8, 0, 1000))
>>> model.compile("adam", "mse")  # then fit with callbacks=[kdist.sparsity.UpdatePruning()]
>>> final = kdist.sparsity.strip(model)

tf_keras models are handed to tensorflow-model-optimization (extra `tfmot`);
`kdist.tfmot` gives tfmot's own import paths for Keras 3 models.
"""

from kdist.sparsity.annotation import (QuantizeAnnotate, quantize_annotate_layer,
                                       quantize_annotate_model, quantize_apply)
from kdist.sparsity.callbacks import (PruningSummaries, SyncQuantizeRanges, UpdatePruning,
                                      sparsity_of)
from kdist.sparsity.export import export_tflite, keras_int8, run_tflite, tflite_dtypes
from kdist.sparsity.fixed import FixedType
from kdist.sparsity.hls import compare_hls4ml, export_hls4ml, predict_hls4ml
from kdist.sparsity.patterns import block_mask, magnitude_mask, n_of_m_mask
from kdist.sparsity.pruning import PrunableLayer, PruneLowMagnitude, prune, pruned_layers
from kdist.sparsity.quantization import (QuantizeAware, export_quantized, fake_quantize,
                                         quantize, quantize_array)
from kdist.sparsity.schedules import ConstantSparsity, PolynomialDecay, PruningSchedule
from kdist.sparsity.wrapping import KernelWrapper, strip

__all__ = [
    "ConstantSparsity", "FixedType", "KernelWrapper", "PolynomialDecay", "PrunableLayer",
    "PruneLowMagnitude", "PruningSchedule", "PruningSummaries", "QuantizeAnnotate",
    "QuantizeAware", "SyncQuantizeRanges", "UpdatePruning", "block_mask", "compare_hls4ml",
    "export_hls4ml", "export_quantized", "export_tflite", "fake_quantize", "keras_int8",
    "magnitude_mask", "n_of_m_mask", "predict_hls4ml", "prune", "pruned_layers",
    "quantize", "quantize_annotate_layer", "quantize_annotate_model", "quantize_apply",
    "quantize_array", "run_tflite", "sparsity_of", "strip", "tflite_dtypes",
]
