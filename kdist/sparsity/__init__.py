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

from typing import TYPE_CHECKING as _TYPE_CHECKING

from kdist._lazy import lazy_attributes as _lazy_attributes

# Names load on first use: `import kdist.sparsity` (and registering kdist's classes
# with Keras when it is imported) costs only the modules a script reaches.
_LAZY = {
    "AllValuesQuantizer": "kdist.sparsity.quantizers",
    "ConstantSparsity": "kdist.sparsity.schedules",
    "FixedQuantizer": "kdist.sparsity.quantizers",
    "FixedType": "kdist.sparsity.fixed",
    "KernelWrapper": "kdist.sparsity.wrapping",
    "LastValueQuantizer": "kdist.sparsity.quantizers",
    "MovingAverageQuantizer": "kdist.sparsity.quantizers",
    "PolynomialDecay": "kdist.sparsity.schedules",
    "PrunableLayer": "kdist.sparsity.pruning",
    "PruneLowMagnitude": "kdist.sparsity.pruning",
    "PruningSchedule": "kdist.sparsity.schedules",
    "PruningSummaries": "kdist.sparsity.callbacks",
    "QuantizeAnnotate": "kdist.sparsity.annotation",
    "QuantizeAware": "kdist.sparsity.quantization",
    "QuantizeAwareActivation": "kdist.sparsity.configured",
    "KernelQuantizeConfig": "kdist.sparsity.registry",
    "QuantizeLayer": "kdist.sparsity.inputs",
    "QuantizeRegistry": "kdist.sparsity.registry",
    "QuantizeConfig": "kdist.sparsity.configured",
    "QuantizeWithConfig": "kdist.sparsity.configured",
    "Quantizer": "kdist.sparsity.quantizers",
    "SyncQuantizeRanges": "kdist.sparsity.callbacks",
    "UpdatePruning": "kdist.sparsity.callbacks",
    "block_mask": "kdist.sparsity.patterns",
    "compare_hls4ml": "kdist.sparsity.hls",
    "export_hls4ml": "kdist.sparsity.hls",
    "export_quantized": "kdist.sparsity.quantization",
    "export_tflite": "kdist.sparsity.export",
    "fix_input_output_range": "kdist.sparsity.inputs",
    "fake_quantize": "kdist.sparsity.quantization",
    "keras_int8": "kdist.sparsity.export",
    "magnitude_mask": "kdist.sparsity.patterns",
    "n_of_m_mask": "kdist.sparsity.patterns",
    "predict_hls4ml": "kdist.sparsity.hls",
    "prune": "kdist.sparsity.pruning",
    "pruned_layers": "kdist.sparsity.pruning",
    "quantize": "kdist.sparsity.quantization",
    "quantize_annotate_layer": "kdist.sparsity.annotation",
    "quantize_annotate_model": "kdist.sparsity.annotation",
    "quantize_apply": "kdist.sparsity.annotation",
    "quantize_array": "kdist.sparsity.quantization",
    "quantize_inputs": "kdist.sparsity.inputs",
    "remove_input_range": "kdist.sparsity.inputs",
    "run_tflite": "kdist.sparsity.export",
    "sparsity_of": "kdist.sparsity.callbacks",
    "strip": "kdist.sparsity.wrapping",
    "tflite_dtypes": "kdist.sparsity.export",
}

if _TYPE_CHECKING:  # what documentation tools and type checkers read; never run
    from kdist.sparsity.annotation import (  # noqa: F401
        QuantizeAnnotate,
        quantize_annotate_layer,
        quantize_annotate_model,
        quantize_apply)
    from kdist.sparsity.callbacks import (  # noqa: F401
        PruningSummaries,
        SyncQuantizeRanges,
        UpdatePruning,
        sparsity_of)
    from kdist.sparsity.configured import (  # noqa: F401
        QuantizeAwareActivation,
        QuantizeConfig,
        QuantizeWithConfig)
    from kdist.sparsity.export import (  # noqa: F401
        export_tflite,
        keras_int8,
        run_tflite,
        tflite_dtypes)
    from kdist.sparsity.fixed import FixedType  # noqa: F401
    from kdist.sparsity.inputs import (  # noqa: F401
        QuantizeLayer,
        fix_input_output_range,
        quantize_inputs,
        remove_input_range)
    from kdist.sparsity.hls import compare_hls4ml, export_hls4ml, predict_hls4ml  # noqa: F401
    from kdist.sparsity.patterns import block_mask, magnitude_mask, n_of_m_mask  # noqa: F401
    from kdist.sparsity.pruning import (  # noqa: F401
        PrunableLayer,
        PruneLowMagnitude,
        prune,
        pruned_layers)
    from kdist.sparsity.quantization import (  # noqa: F401
        QuantizeAware,
        export_quantized,
        fake_quantize,
        quantize,
        quantize_array)
    from kdist.sparsity.quantizers import (  # noqa: F401
        AllValuesQuantizer,
        FixedQuantizer,
        LastValueQuantizer,
        MovingAverageQuantizer,
        Quantizer)
    from kdist.sparsity.registry import KernelQuantizeConfig, QuantizeRegistry  # noqa: F401
    from kdist.sparsity.schedules import (  # noqa: F401
        ConstantSparsity,
        PolynomialDecay,
        PruningSchedule)
    from kdist.sparsity.wrapping import KernelWrapper, strip  # noqa: F401

__all__ = [
    "AllValuesQuantizer", "ConstantSparsity", "FixedQuantizer", "FixedType",
    "KernelQuantizeConfig", "KernelWrapper", "LastValueQuantizer", "MovingAverageQuantizer", "PolynomialDecay", "PrunableLayer",
    "PruneLowMagnitude", "PruningSchedule", "PruningSummaries", "QuantizeAnnotate",
    "QuantizeAware", "QuantizeAwareActivation", "QuantizeConfig", "QuantizeLayer",
    "QuantizeRegistry", "QuantizeWithConfig", "Quantizer", "SyncQuantizeRanges", "UpdatePruning", "block_mask",
    "compare_hls4ml", "export_hls4ml", "export_quantized", "export_tflite", "fake_quantize",
    "fix_input_output_range", "keras_int8", "magnitude_mask", "n_of_m_mask", "predict_hls4ml",
    "prune", "pruned_layers", "quantize", "quantize_annotate_layer", "quantize_annotate_model",
    "quantize_apply", "quantize_array", "quantize_inputs", "remove_input_range", "run_tflite",
    "sparsity_of", "strip", "tflite_dtypes",
]

__getattr__, __dir__ = _lazy_attributes(__name__, _LAZY)
