"""FPGA firmware from quantization-aware training, through hls4ml.

A model trained with `quantize(..., fixed_point=True)` computes on
fixed-point grids; `export_hls4ml` writes the hls4ml project that computes
the same numbers, its precisions read off the trained model:

    weights, bias   -> the narrowest exact type of their values
    accumulator     -> hls4ml's inferred exact type ("auto")
    layer output    -> ufixed/fixed<bits, I, RND_CONV, SAT> over the tracked range
    ReLU output     -> the same (the layer before it keeps the exact sum)
    Flatten, pooling, Dropout, plain ReLU -> the type of their input

`predict_hls4ml` runs the compiled C++ emulation (a C++ compiler, no vendor
tools); `compare_hls4ml` runs it against the Keras model on the same
fixed-point inputs and reports how many outputs agree bit for bit.
Softmax, sigmoid and tanh outputs come from hls4ml's lookup tables, so they
agree closely, not exactly; their inputs do.
"""

import warnings

import numpy as np

from kdist import _keras_private
from kdist.sparsity.fixed import FixedType, exact_type, range_type
from kdist.sparsity.quantization import QuantizeAware, export_quantized
from kdist.sparsity.wrapping import strip, wrappers_in

# Layers that move values without computing new ones: their output keeps
# the fixed-point type of their input.
_PASS_THROUGH = ("Flatten", "Reshape", "Dropout", "MaxPooling1D", "MaxPooling2D", "ReLU",
                 "ZeroPadding1D", "ZeroPadding2D", "Permute", "GlobalMaxPooling1D",
                 "GlobalMaxPooling2D")
_EXACT_ACTIVATIONS = ("relu", "linear")


def _hls4ml():
    try:
        import hls4ml
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError("export_hls4ml needs hls4ml: pip install 'kdist[fpga]'.") from error
    return hls4ml


def input_type(representative_data=None, bits=16):
    """The fixed-point type inputs reach the firmware in.

    From the range of `representative_data` when given, else hls4ml's
    default of 6 integer bits.
    """
    if representative_data is None:
        return FixedType(bits, 6, rounding=True)
    values = np.asarray(representative_data, dtype=np.float64)
    return range_type(values.min(), values.max(), bits)


def _producer(layer):
    """The name of the layer whose output `layer` takes (single-input layers)."""
    return _keras_private.producing_layer_name(layer.input)


def hls_config(model, inputs_type, base_config):
    """hls4ml's per-layer precisions for `model` (a QAT model, fixed-point).

    `base_config` is hls4ml's `config_from_keras_model(strip(model),
    granularity="name")`; the returned copy has every precision set.
    """
    exported = export_quantized(model)
    wrappers = {w.base_layer.name: w for w in wrappers_in(model, QuantizeAware)}
    loose = [name for name, w in wrappers.items() if not w.fixed_point]
    if loose:
        raise ValueError(f"Layers {loose} were not trained on fixed-point grids; train with "
                         "kdist.sparsity.quantize(model, bits, fixed_point=True) to export "
                         "to hls4ml.")
    plain = strip(model)
    layers = dict(base_config["LayerName"])
    out = {}

    def set_precision(name, **precision):
        if name not in layers and f"{name}_0" in layers:
            name = f"{name}_0"  # hls4ml renames layers whose names it reserves ("p", "t")
        if name not in layers:
            raise ValueError(f"hls4ml's configuration has no layer {name!r}; "
                             f"it has {sorted(layers)}.")
        layers[name] = dict(layers[name], Precision=dict(
            layers[name].get("Precision", {}), **{k: str(v) for k, v in precision.items()}))

    if len(plain.inputs) != 1:
        raise ValueError(f"export_hls4ml exports models with one input; {model.name!r} has "
                         f"{len(plain.inputs)}.")
    first = _keras_private.producing_layer_name(plain.inputs[0])
    out[first] = inputs_type
    set_precision(first, result=inputs_type)
    for layer in plain.layers:
        kind = type(layer).__name__
        if kind == "InputLayer":
            continue
        source = _producer(layer)
        if source is None or source not in out:
            raise ValueError(f"export_hls4ml follows single-input layers in order; "
                             f"{layer.name!r} takes its input from {source!r}.")
        if layer.name in wrappers:
            entry, wrapper = exported[layer.name], wrappers[layer.name]
            codes, scales = entry["kernel"]
            weights = dict(weight=exact_type(codes * scales), accum="auto")
            if entry["bias"] is not None:
                weights["bias"] = exact_type(entry["bias"])
            activation = getattr(layer.activation, "__name__", "linear")
            low_high = entry["output_range"]
            result = "auto" if low_high is None else range_type(*low_high, wrapper.bits)
            if activation == "linear":
                set_precision(layer.name, result=result, **weights)
            elif activation in _EXACT_ACTIVATIONS:
                set_precision(layer.name, result="auto", **weights)
                set_precision(f"{layer.name}_{activation}", result=result)
            else:  # a deferred activation: its input is quantised, it is hls4ml's table
                set_precision(layer.name, result=result, **weights)
                warnings.warn(
                    f"hls4ml computes {activation} of layer {layer.name!r} from lookup tables, "
                    "so the firmware's outputs will differ from the model's (by up to 0.5 for "
                    "a softmax over narrow inputs). For bit-exact firmware end the model "
                    "with a linear layer (train with from_logits=True) and take the argmax "
                    "or threshold the logits.", stacklevel=3)
            out[layer.name] = result
        elif kind in _PASS_THROUGH or (kind == "Activation" and getattr(
                layer.activation, "__name__", None) in _EXACT_ACTIVATIONS):
            out[layer.name] = out[source]
            set_precision(layer.name, result=out[source])
        else:
            raise ValueError(
                f"export_hls4ml cannot keep {kind} layer {layer.name!r} exact. It exports "
                "quantised Dense and Conv layers with ReLU or linear activations (a last "
                f"softmax or sigmoid too) and the layers {list(_PASS_THROUGH)}; convert "
                "kdist.sparsity.strip(model) with hls4ml directly for anything else.")
    return dict(base_config, LayerName=layers)


def export_hls4ml(model, output_dir, representative_data=None, input_bits=16,
                  backend="Vivado", io_type="io_parallel", compile=True, **converter_options):
    """An hls4ml model computing what `model` computes, bit for bit.

    Every precision is taken from training, and the project is written to
    `output_dir` and compiled for C++ emulation (a C++ compiler, no vendor
    tools). Needs the `fpga` extra (hls4ml). The precisions:

    - weights and bias: the narrowest exact type of their values
      (`kdist.sparsity.fixed.exact_type`);
    - accumulator: hls4ml's inferred exact type (`"auto"`);
    - a layer's output, and a ReLU's after it:
      `ufixed/fixed<bits, I, RND_CONV, SAT>` over its tracked range
      (`kdist.sparsity.fixed.range_type`);
    - Flatten, Reshape, Dropout, max pooling, padding, Permute, a plain ReLU:
      the type of their input.

    `predict_hls4ml(firmware, x)` runs the compiled emulation;
    `compare_hls4ml(model, firmware, x)` says how many outputs agree bit for
    bit. Softmax, sigmoid and tanh outputs come from hls4ml's lookup tables,
    so they agree closely, not exactly (with a warning); their inputs do.

    Args:
        model: trained with `kdist.sparsity.quantize(..., fixed_point=True)`
            (pruned too, if you like: zeros cost no multipliers).
        output_dir: where hls4ml writes the project (C++, build scripts).
        representative_data: inputs whose range sets the input type; without
            it inputs are `fixed<input_bits, 6>`.
        input_bits: width of the input type.
        backend: passed to hls4ml's `convert_from_keras_model`.
        io_type: passed to hls4ml's `convert_from_keras_model`.
        converter_options: more arguments of hls4ml's `convert_from_keras_model`
            (e.g. `part=`, `clock_period=`).
        compile: build the C++ emulation, so `predict` works at once.

    Returns:
        The hls4ml model (`.predict`, `.build`, `.write`).

    Raises:
        ImportError: hls4ml is not installed.
        ValueError: a layer was not trained with `fixed_point=True`; the model
            has several inputs, a layer with several inputs, or a layer
            kdist cannot keep exact (anything but quantised Dense and Conv
            layers with ReLU or linear activations, a last softmax or sigmoid,
            and the layers above).

    Example (needs hls4ml and a C++ compiler):

    >>> import keras, numpy as np, kdist
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="relu"),
    ...                           keras.layers.Dense(2)])
    >>> qmodel = kdist.sparsity.quantize(model, bits=6, fixed_point=True)
    >>> qmodel.compile("adam", "mse")
    >>> x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    >>> _ = qmodel.fit(x, x[:, :2], epochs=1, verbose=0)
    >>> import tempfile
    >>> firmware = kdist.sparsity.export_hls4ml(qmodel, tempfile.mkdtemp(), x)
    >>> kdist.sparsity.compare_hls4ml(qmodel, firmware, x)["bit_exact_fraction"]
    1.0
    """
    hls4ml = _hls4ml()
    plain = strip(model)
    base = hls4ml.utils.config_from_keras_model(plain, granularity="name", backend=backend)
    config = hls_config(model, input_type(representative_data, input_bits), base)
    firmware = hls4ml.converters.convert_from_keras_model(
        plain, hls_config=config, output_dir=str(output_dir), backend=backend,
        io_type=io_type, **converter_options)
    if compile:
        firmware.compile()
    return firmware


def _firmware_input_type(firmware):
    precision = firmware.get_input_variables()[0].type.precision
    return FixedType(precision.width, precision.integer, signed=precision.signed)


def predict_hls4ml(firmware, inputs):
    """The compiled firmware's outputs for float `inputs`, cast first to its
    input type (as the detector's digitiser would deliver them)."""
    on_grid = _firmware_input_type(firmware).cast(inputs).astype(np.float32)
    outputs = np.asarray(firmware.predict(np.ascontiguousarray(on_grid)))
    return outputs.reshape(len(on_grid), -1)


def compare_hls4ml(model, firmware, inputs):
    """How closely the compiled firmware reproduces `model` on `inputs`.

    Both run on `inputs` cast to the firmware's input type. Returns
    `{"max_abs_difference", "bit_exact_fraction", "outputs"}`.
    """
    on_grid = _firmware_input_type(firmware).cast(inputs).astype(np.float32)
    expected = np.asarray(model.predict(on_grid, verbose=0), dtype=np.float64)
    got = predict_hls4ml(firmware, on_grid).astype(np.float64).reshape(expected.shape)
    difference = np.abs(got - expected)
    return {"max_abs_difference": float(difference.max()),
            "bit_exact_fraction": float(np.mean(difference == 0)),
            "outputs": int(difference.size)}
