"""TFLite flatbuffers from pruned and quantised models, int8 end to end.

A model trained with `quantize()` carries fake-quantisation ops whose
ranges the TFLite converter takes over; the model's input range comes from a
few rows of representative data. With `int8=True` the flatbuffer takes and
returns int8 tensors, as microcontrollers and integer accelerators need;
`run_tflite` converts float data in and out with the flatbuffer's scales.
"""

import contextlib
import io

import numpy as np

from kdist._files import write_atomically


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
        representative_data: inputs to calibrate with (an array, or an
            iterable of batches or `(x, y)` pairs; up to 200 rows are used).
            Needed with `int8=True`.
        int8: integer-only operators with int8 inputs and outputs; with False,
            int8 weights and float activations (dynamic-range quantisation).

    Example:

    >>> import keras, kdist
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
    with contextlib.redirect_stdout(io.StringIO()):  # Keras's "Saved artifact at ..." listing
        flatbuffer = converter.convert()
    if path is not None:
        write_atomically(path, lambda stream: stream.write(flatbuffer), suffix=".tflite")
    return flatbuffer


def _interpreter(flatbuffer):
    import tensorflow as tf

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
