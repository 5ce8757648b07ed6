"""Integer models from pruned and quantised ones: TFLite flatbuffers, int8 end
to end, and Keras's own int8 layers.

A model trained with `quantize()` carries fake-quantisation ops whose
ranges the TFLite converter takes over; the model's input range comes from a
few rows of representative data. With `int8=True` the flatbuffer takes and
returns int8 tensors, as microcontrollers and integer accelerators need;
`run_tflite` converts float data in and out with the flatbuffer's scales.
"""

import contextlib
import io
import warnings

import keras
import numpy as np

from kdist import _keras_private
from kdist._files import write_atomically
from kdist.sparsity.quantization import QuantizeAware
from kdist.sparsity.wrapping import strip, wrappers_in


def _rows(data, limit=200):
    """Yields single-row batches of `data` (an array, a list of arrays, or
    an iterable of batches) for the converter to calibrate with."""
    if hasattr(data, "shape") and hasattr(data, "dtype"):  # one array or tensor
        data = [data]
    given = 0
    for batch in data:
        inputs = batch[0] if isinstance(batch, (list, tuple)) and len(batch) == 2 else batch
        inputs = np.asarray(inputs, dtype=np.float32)
        for row in inputs:
            yield [row[None]]
            given += 1
            if given >= limit:
                return


def export_tflite(model, path=None, representative_data=None, int8=True):
    """A TFLite flatbuffer of `model` (bytes), written atomically to `path` if given.

    Args:
        model: a Keras 3 model: trained with `kdist.sparsity.quantize` (its
            ranges are used), pruned, stripped or plain.
        path: where to write the flatbuffer, or None.
        representative_data: inputs to calibrate with (an array, or an
            iterable of batches or `(x, y)` pairs; up to 200 rows are used).
            Needed with `int8=True`.
        int8: integer-only operators with int8 inputs and outputs; with False,
            int8 weights and float activations (dynamic-range quantisation).

    Returns:
        The flatbuffer's bytes; `run_tflite(flatbuffer, x)` runs it on float
        rows, `tflite_dtypes(flatbuffer)` gives its input and output types.

    Raises:
        ValueError: `int8=True` without `representative_data`.

    Example:

        >>> import keras, numpy as np, kdist
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        >>> x = np.random.default_rng(0).normal(size=(32, 4)).astype("float32")
        >>> flatbuffer = kdist.sparsity.export_tflite(model, representative_data=x)
        >>> kdist.sparsity.run_tflite(flatbuffer, x[:3]).shape
        (3, 2)
    """
    import tensorflow as tf

    if int8 and representative_data is None:
        raise ValueError("export_tflite(int8=True) needs representative_data: a few hundred "
                         "input rows fix the int8 scale of the model's input. Pass it, or "
                         "int8=False for float inputs and outputs.")
    converter = tf.lite.TFLiteConverter.from_keras_model(model)
    converter.optimizations = [tf.lite.Optimize.DEFAULT]
    if int8:
        converter.representative_dataset = lambda: _rows(representative_data)
        converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]
        converter.inference_input_type = tf.int8
        converter.inference_output_type = tf.int8
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        # Keras's "Saved artifact at ..." listing, and a notice about input
        # statistics that the representative data has just given.
        warnings.filterwarnings("ignore", message="Statistics for quantized inputs")
        flatbuffer = converter.convert()
    if path is not None:
        write_atomically(path, lambda stream: stream.write(flatbuffer), suffix=".tflite")
    return flatbuffer


def _interpreter(flatbuffer):
    import tensorflow as tf

    with warnings.catch_warnings():
        # TensorFlow points to LiteRT, a separate package with the same interpreter.
        warnings.filterwarnings("ignore", message=".*tf.lite.Interpreter is deprecated")
        interpreter = tf.lite.Interpreter(model_content=flatbuffer)
    interpreter.allocate_tensors()
    return interpreter


def tflite_dtypes(flatbuffer):
    """`(input dtype, output dtype)` of a flatbuffer's first input and output."""
    interpreter = _interpreter(flatbuffer)
    return (interpreter.get_input_details()[0]["dtype"],
            interpreter.get_output_details()[0]["dtype"])


def run_tflite(flatbuffer, x):
    """Runs a single-input flatbuffer on float rows `x`, row by row, and returns
    float outputs (int8 tensors are scaled in and out with their parameters)."""
    interpreter = _interpreter(flatbuffer)
    given, taken = interpreter.get_input_details()[0], interpreter.get_output_details()[0]
    outputs = []
    for row in np.asarray(x, dtype=np.float32):
        value = row[None]
        if given["dtype"] == np.int8:
            scale, zero = given["quantization"]
            value = np.clip(np.rint(value / scale + zero), -128, 127).astype(np.int8)
        interpreter.set_tensor(given["index"], value)
        interpreter.invoke()
        result = interpreter.get_tensor(taken["index"])
        if taken["dtype"] == np.int8:
            scale, zero = taken["quantization"]
            result = (result.astype(np.float32) - zero) * scale
        outputs.append(result[0])
    return np.stack(outputs)


def _has_int8_form(layer):
    return type(layer).quantize is not keras.layers.Layer.quantize


def keras_int8(model):
    """A copy of `model` with Keras's own int8 layers (`Model.quantize("int8")`).

    Trained with `kdist.sparsity.quantize(model)` (8 bits, one scale per
    output channel: the defaults), the copy's int8 kernels hold exactly the
    integer codes of `export_quantized`, so what quantization-aware training
    reached carries over; pruned zeros stay zero. Keras quantises each int8
    layer's inputs on the fly, row by row, where the trained model used its
    tracked ranges, so outputs agree closely rather than bit for bit. Keras
    has int8 forms of Dense, EinsumDense and Embedding only; other layers stay
    float. Layers trained on another grid (not 8 bits, one scale per tensor,
    or fixed point) are re-quantised by Keras, with a warning.

    Raises:
        TypeError: `model` is not a Keras 3 model.
        ValueError: the model has no Dense, EinsumDense or Embedding layer.

    Example:

        >>> import keras, kdist
        >>> model = kdist.sparsity.quantize(keras.Sequential([keras.Input((4,)),
        ...                                                   keras.layers.Dense(3)]))
        >>> int8 = kdist.sparsity.keras_int8(model)
        >>> [weight.dtype for weight in int8.layers[0].weights]
        ['float32', 'int8', 'float32']
    """
    if not isinstance(model, keras.Model):
        raise TypeError(f"keras_int8() takes a Keras 3 model; got {type(model).__name__}.")
    elsewhere = [w.base_layer.name for w in wrappers_in(model, QuantizeAware)
                 if w.bits != 8 or not w.per_channel or w.fixed_point]
    if elsewhere:
        warnings.warn(
            f"Layers {elsewhere} were trained on another grid than Keras's int8 (8 bits, a "
            "float scale per output channel); Keras re-quantises them and they lose what "
            "training on their own grid gained. Use export_hls4ml for fixed-point models.",
            stacklevel=2)
    if wrappers_in(model):
        plain = strip(model)
    else:
        plain = keras.models.clone_model(model)
        plain.set_weights(model.get_weights())
    if not any(_has_int8_form(layer)
               for layer in _keras_private.flatten_layers(plain, include_self=False)):
        raise ValueError("Keras has int8 forms of Dense, EinsumDense and Embedding layers "
                         f"only; model {model.name!r} has none.")
    with warnings.catch_warnings():  # Keras names every layer it leaves in float
        warnings.filterwarnings("ignore", message=".*does not have a `quantize` method")
        plain.quantize("int8")
    return plain
