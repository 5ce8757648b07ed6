"""Size, CPU latency and accuracy of integer models exported by kdist: TFLite
float, dynamic-range (int8 weights) and int8 end to end, from a dense, a
quantization-aware and a pruned-then-quantization-aware model; and Keras's
own int8 layers (`sparsity.keras_int8`) from the quantization-aware model.

    python benchmarks/tflite_export.py [--epochs 4] [--rows 0] [--calls 2000]

The task and the 64-256-256-10 MLP are those of benchmarks/sparsity.py.
The float model is trained for `--epochs`; the QAT variant fine-tunes it for
one more epoch in 8 bits; the pruned variant prunes it to 80 % over one epoch,
strips it and then fine-tunes it in 8 bits for another (its zeros kept).
Latency is one row per `invoke()` on one thread, the median of 5 turns of
`--calls` calls, taken in turns across models so that a change in the core's
speed hits them all. Sizes are of the flatbuffer and of its gzip, whose
ratio shows what pruning's zeros save. Ratios are against the float TFLite
model of the dense network, in the same run. The Keras models are timed the
same way, one row per call of a `tf.function`, and sized by the bytes of
their weights; their ratios are against the float Keras model. Prints one JSON object.
"""

import argparse
import contextlib
import gzip
import json
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
from sparsity import BATCH, accuracy, compile_, keras3_model, make_task  # noqa: E402


def _invoke_time(flatbuffer, rows, calls):
    import tensorflow as tf

    interpreter = tf.lite.Interpreter(model_content=flatbuffer, num_threads=1)
    interpreter.allocate_tensors()
    given = interpreter.get_input_details()[0]
    value = rows[:1]
    if given["dtype"] == np.int8:
        scale, zero = given["quantization"]
        value = np.clip(np.rint(value / scale + zero), -128, 127).astype(np.int8)
    interpreter.set_tensor(given["index"], value)
    started = time.perf_counter()
    for _ in range(calls):
        interpreter.invoke()
    return (time.perf_counter() - started) / calls


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--rows", type=int, default=0,
                        help="use only this many training rows (a quick smoke run)")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import keras

    from kdist import sparsity

    train, test = make_task(args.seed)
    if args.rows:
        train = (train[0][:args.rows], train[1][:args.rows])
    dense = keras3_model(keras, args.seed)
    compile_(dense, keras)
    dense.fit(*train, batch_size=BATCH, epochs=args.epochs, verbose=0)

    qat = sparsity.quantize(sparsity.strip(dense))
    compile_(qat, keras)
    qat.fit(*train, batch_size=BATCH, epochs=1, verbose=0)

    steps = len(train[0]) // BATCH
    pruned = sparsity.prune(dense, sparsity.PolynomialDecay(
        0.0, 0.8, 0, max(1, int(0.7 * steps)), frequency=max(1, steps // 10)), skip=["logits"])
    compile_(pruned, keras)
    pruned.fit(*train, batch_size=BATCH, epochs=1, verbose=0,
               callbacks=[sparsity.UpdatePruning(log_sparsity=False)])
    pruned_qat = sparsity.quantize(sparsity.strip(pruned))
    compile_(pruned_qat, keras)
    pruned_qat.fit(*train, batch_size=BATCH, epochs=1, verbose=0)

    calibration = train[0][:200]
    with contextlib.redirect_stdout(sys.stderr):  # the converter's own messages
        exports = _export(dense, qat, pruned_qat, calibration)
    keras_accuracy = {"dense": accuracy(dense, test), "qat": accuracy(qat, test),
                      "pruned_qat": accuracy(pruned_qat, test)}
    times = {name: [] for name in exports}
    for _ in range(5):
        for name, flatbuffer in exports.items():
            times[name].append(_invoke_time(flatbuffer, test[0], args.calls))
    base = exports["dense/float"]
    base_time = statistics.median(times["dense/float"])
    models = {}
    for name, flatbuffer in exports.items():
        outputs = sparsity.run_tflite(flatbuffer, test[0])
        dtypes = [np.dtype(d).name for d in sparsity.tflite_dtypes(flatbuffer)]
        models[name] = {
            "io": dtypes,
            "bytes": len(flatbuffer), "gzip_bytes": len(gzip.compress(flatbuffer)),
            "size_ratio": round(len(flatbuffer) / len(base), 3),
            "gzip_ratio": round(len(gzip.compress(flatbuffer)) / len(gzip.compress(base)), 3),
            "latency_us": round(1e6 * statistics.median(times[name]), 2),
            "latency_ratio": round(statistics.median(times[name]) / base_time, 3),
            "accuracy": round(float(np.mean(np.argmax(outputs, -1) == test[1])), 4),
            "keras_accuracy": round(keras_accuracy[name.split("/")[0]], 4),
        }
    kernel = sparsity.strip(pruned_qat).layers[0].get_weights()[0]
    print(json.dumps({"epochs": args.epochs, "train_rows": len(train[0]),
                      "pruned_hidden_sparsity": round(float(np.mean(kernel == 0)), 3),
                      "models": models,
                      "keras": _keras_models(dense, qat, test, args.calls)}, indent=1))


def _keras_models(dense, qat, test, calls):
    import keras
    import tensorflow as tf

    from kdist import sparsity

    variants = {"dense/float": sparsity.strip(dense),
                "qat/keras_int8": sparsity.keras_int8(qat)}
    row = tf.constant(test[0][:1])
    functions = {name: tf.function(lambda x, m=model: m(x, training=False))
                 for name, model in variants.items()}
    times = {name: [] for name in variants}
    for _ in range(5):
        for name, function in functions.items():
            function(row)
            started = time.perf_counter()
            for _ in range(calls):
                function(row)
            times[name].append((time.perf_counter() - started) / calls)
    # The bytes of the weights themselves: a weights file also holds the optimizer's.
    sizes = {name: sum(keras.ops.convert_to_numpy(v).nbytes for v in model.weights)
             for name, model in variants.items()}
    report = {}
    for name, model in variants.items():
        outputs = model.predict(test[0], verbose=0)
        report[name] = {
            "weight_bytes": sizes[name],
            "size_ratio": round(sizes[name] / sizes["dense/float"], 3),
            "latency_us": round(1e6 * statistics.median(times[name]), 2),
            "latency_ratio": round(statistics.median(times[name])
                                   / statistics.median(times["dense/float"]), 3),
            "accuracy": round(float(np.mean(np.argmax(outputs, -1) == test[1])), 4)}
    return report


def _export(dense, qat, pruned_qat, calibration):
    import tensorflow as tf

    from kdist import sparsity

    return {
        "dense/float": tf.lite.TFLiteConverter.from_keras_model(dense).convert(),
        "dense/dynamic": sparsity.export_tflite(dense, int8=False),
        "dense/int8": sparsity.export_tflite(dense, representative_data=calibration),
        "qat/int8": sparsity.export_tflite(qat, representative_data=calibration),
        "pruned_qat/int8": sparsity.export_tflite(pruned_qat, representative_data=calibration),
    }


if __name__ == "__main__":
    main()
