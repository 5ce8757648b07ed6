"""Pruning and quantization-aware training for Keras 3 models.

>>> import keras, kdist
>>> model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16),
...                           keras.layers.Dense(1)])
>>> model = kdist.sparsity.prune(model, kdist.sparsity.PolynomialDecay(0.0, 0.8, 0, 1000))
>>> model.compile("adam", "mse")  # then fit with callbacks=[kdist.sparsity.UpdatePruning()]
>>> final = kdist.sparsity.strip(model)

How the parts fit:

- Pruning: `prune` wraps layers in `PruneLowMagnitude`; a `PruningSchedule`
  (`ConstantSparsity`, `PolynomialDecay`) says when and how much; the `UpdatePruning`
  callback moves the masks, which `magnitude_mask`, `block_mask` and `n_of_m_mask` compute.
- Quantization-aware training: `quantize` wraps layers in `QuantizeAware` (kdist's
  scheme); `quantize_annotate_layer` or `quantize_annotate_model`, then `quantize_apply`,
  quantise chosen layers; `SyncQuantizeRanges` keeps output ranges equal on
  data-parallel ranks.
- Choosing per layer: a `QuantizeConfig` with `Quantizer`s, applied by
  `QuantizeWithConfig`; `QuantizeRegistry` gives each Keras layer its default config.
- Inputs and outputs: `quantize_inputs` (a `QuantizeLayer` after each input),
  `fix_input_output_range`, `remove_input_range`.
- Back to plain layers: `strip`.
- Export: `export_quantized` (integer codes and scales), `export_tflite` and `run_tflite`,
  `keras_int8`, and `export_hls4ml` with `FixedType` for FPGA firmware.
- Reports: `sparsity_of`, `pruned_layers`, `PruningSummaries`.

`PruneLowMagnitude` and `QuantizeAware` are `KernelWrapper`s: each calls its layer with a
transformed kernel, and they nest. Every kdist layer, schedule and quantizer is registered
with Keras, so a model saved with `model.save` loads with `keras.models.load_model` in any
process that has imported kdist.

tf_keras (Keras 2) models are handed to tensorflow-model-optimization (extra `tfmot`) by
`prune`, `strip`, `quantize` (8 bits, per channel, activations quantised) and the
`UpdatePruning` callback; the other functions take Keras 3 models only. `kdist.tfmot`
gives tfmot's own import paths for Keras 3 models.
"""

from kdist._exports import declare as _declare

_EXPORTS = {
    "quantize_annotate_layer": "kdist.sparsity.annotation",
    "quantize_annotate_model": "kdist.sparsity.annotation",
    "quantize_apply": "kdist.sparsity.annotation",
    "QuantizeAnnotate": "kdist.sparsity.annotation",
    "PruningSummaries": "kdist.sparsity.callbacks",
    "sparsity_of": "kdist.sparsity.callbacks",
    "SyncQuantizeRanges": "kdist.sparsity.callbacks",
    "UpdatePruning": "kdist.sparsity.callbacks",
    "QuantizeAwareActivation": "kdist.sparsity.configured",
    "QuantizeConfig": "kdist.sparsity.configured",
    "QuantizeWithConfig": "kdist.sparsity.configured",
    "export_tflite": "kdist.sparsity.export",
    "keras_int8": "kdist.sparsity.export",
    "run_tflite": "kdist.sparsity.export",
    "tflite_dtypes": "kdist.sparsity.export",
    "FixedType": "kdist.sparsity.fixed",
    "compare_hls4ml": "kdist.sparsity.hls",
    "export_hls4ml": "kdist.sparsity.hls",
    "predict_hls4ml": "kdist.sparsity.hls",
    "fix_input_output_range": "kdist.sparsity.inputs",
    "quantize_inputs": "kdist.sparsity.inputs",
    "QuantizeLayer": "kdist.sparsity.inputs",
    "remove_input_range": "kdist.sparsity.inputs",
    "block_mask": "kdist.sparsity.patterns",
    "magnitude_mask": "kdist.sparsity.patterns",
    "n_of_m_mask": "kdist.sparsity.patterns",
    "PrunableLayer": "kdist.sparsity.pruning",
    "prune": "kdist.sparsity.pruning",
    "pruned_layers": "kdist.sparsity.pruning",
    "PruneLowMagnitude": "kdist.sparsity.pruning",
    "export_quantized": "kdist.sparsity.quantization",
    "fake_quantize": "kdist.sparsity.quantization",
    "quantize": "kdist.sparsity.quantization",
    "quantize_array": "kdist.sparsity.quantization",
    "QuantizeAware": "kdist.sparsity.quantization",
    "AllValuesQuantizer": "kdist.sparsity.quantizers",
    "FixedQuantizer": "kdist.sparsity.quantizers",
    "LastValueQuantizer": "kdist.sparsity.quantizers",
    "MovingAverageQuantizer": "kdist.sparsity.quantizers",
    "Quantizer": "kdist.sparsity.quantizers",
    "KernelQuantizeConfig": "kdist.sparsity.registry",
    "QuantizeRegistry": "kdist.sparsity.registry",
    "ConstantSparsity": "kdist.sparsity.schedules",
    "PolynomialDecay": "kdist.sparsity.schedules",
    "PruningSchedule": "kdist.sparsity.schedules",
    "KernelWrapper": "kdist.sparsity.wrapping",
    "strip": "kdist.sparsity.wrapping",
}

__all__, __getattr__, __dir__ = _declare(__name__, _EXPORTS)
