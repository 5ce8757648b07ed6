"""tfmot's three Keras guides, run twice from the same starting weights: with
`import kdist.tfmot as tfmot` on Keras 3, and with tensorflow-model-optimization
itself on tf_keras. Each guide's steps are written once (`pruning_guide`,
`qat_guide`, `pqat_guide`) and given the two `tfmot`/`keras` module pairs, so
the only difference between the runs is the import.

    python benchmarks/tfmot_guides.py [--seeds 3] [--rows 12000] [--baseline-epochs 4]

The guides train on MNIST; with no network here, the images are made from
scikit-learn's bundled 8x8 digits, scaled to 28x28, shifted by up to 3 pixels
and noised (`make_digits`). The model is the guides' own: Reshape, Conv2D(12, 3x3,
ReLU), MaxPooling2D, Flatten, Dense(10). A Keras 3 baseline is trained per seed
for `--baseline-epochs` epochs and its weights start every run of both libraries.

- pruning guide: `prune_low_magnitude` with `PolynomialDecay(0.5 -> 0.8)` over
  2 epochs at batch 128 (validation split 0.1), `UpdatePruningStep` and
  `PruningSummaries`, then `strip_pruning`;
- QAT guide: `quantize_model`, one epoch on the first 1,000 images at batch 500,
  then tfmot's TFLite recipe (`Optimize.DEFAULT`);
- pruning-preserving QAT guide: `ConstantSparsity(0.5, frequency=100)` for
  3 epochs, `strip_pruning`, `quantize_annotate_model`, `quantize_apply` with
  `experimental.combine.Default8BitPrunePreserveQuantizeScheme()`, one epoch, TFLite.

Reported per guide and library (means over seeds): the kernels' sparsity as the
guides print it (zeros over all entries of the weights named `kernel`), test
accuracy of the Keras model and of the TFLite model, and kdist minus tfmot.
`same_sparsity` allows 0.005; `accuracy_within_0.01` compares the means.
Prints one JSON object.
"""

import argparse
import contextlib
import json
import math
import os
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402

VALIDATION = 0.1


def make_digits(rows, seed):
    """MNIST-shaped images (28x28 floats in [0, 1]) and labels, from sklearn's digits."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(digits.images), rows)
    # Each 8x8 pixel becomes 3x3, and the 24x24 digit sits at a random place in 28x28.
    big = np.kron(digits.images[picks] / 16.0, np.ones((3, 3)))
    images = np.zeros((rows, 28, 28), "float32")
    shifts = rng.integers(0, 5, (rows, 2))
    for i, (dy, dx) in enumerate(shifts):
        images[i, dy:dy + 24, dx:dx + 24] = big[i]
    images = np.clip(images + rng.normal(0, 0.1, images.shape), 0, 1).astype("float32")
    return images, digits.target[picks].astype("int64")


def guide_model(keras):
    return keras.Sequential([
        keras.layers.InputLayer(input_shape=(28, 28)),
        keras.layers.Reshape(target_shape=(28, 28, 1)),
        keras.layers.Conv2D(filters=12, kernel_size=(3, 3), activation="relu"),
        keras.layers.MaxPooling2D(pool_size=(2, 2)),
        keras.layers.Flatten(),
        keras.layers.Dense(10)])


def compile_(model, keras):
    model.compile(optimizer="adam", metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))


def baseline(keras, weights):
    model = guide_model(keras)
    model.set_weights(weights)
    compile_(model, keras)
    return model


def kernel_sparsity(model):
    """Zeros over entries of every weight named kernel, as the guides count them (not
    the quantizers' `kernel_min` and `kernel_max`)."""
    kernels = [np.asarray(w) for w in model.weights
               if w.name.split("/")[-1].split(":")[0] == "kernel"]
    return float(sum((k == 0).sum() for k in kernels) / sum(k.size for k in kernels))


def keras_accuracy(model, test):
    return float(model.evaluate(*test, verbose=0)[1])


def tflite_accuracy(model, test):
    import tensorflow as tf

    converter = tf.lite.TFLiteConverter.from_keras_model(model)
    converter.optimizations = [tf.lite.Optimize.DEFAULT]
    with contextlib.redirect_stdout(sys.stderr):  # the converter talks on stdout
        flat = converter.convert()
    interpreter = tf.lite.Interpreter(model_content=flat)
    interpreter.allocate_tensors()
    given = interpreter.get_input_details()[0]["index"]
    taken = interpreter.get_output_details()[0]["index"]
    right = 0
    for image, label in zip(*test):
        interpreter.set_tensor(given, image[None])
        interpreter.invoke()
        right += int(np.argmax(interpreter.get_tensor(taken)) == label)
    return right / len(test[1])


def pruning_guide(tfmot, keras, weights, train, test, log_dir):
    model = baseline(keras, weights)
    batch_size, epochs = 128, 2
    images = len(train[0]) * (1 - VALIDATION)
    end_step = math.ceil(images / batch_size) * epochs
    schedule = tfmot.sparsity.keras.PolynomialDecay(
        initial_sparsity=0.50, final_sparsity=0.80, begin_step=0, end_step=end_step)
    pruned = tfmot.sparsity.keras.prune_low_magnitude(model, pruning_schedule=schedule)
    compile_(pruned, keras)
    pruned.fit(*train, batch_size=batch_size, epochs=epochs, validation_split=VALIDATION,
               verbose=0, callbacks=[tfmot.sparsity.keras.UpdatePruningStep(),
                                     tfmot.sparsity.keras.PruningSummaries(log_dir=log_dir)])
    accuracy = keras_accuracy(pruned, test)
    stripped = tfmot.sparsity.keras.strip_pruning(pruned)
    return {"sparsity": kernel_sparsity(stripped), "accuracy": accuracy}


def qat_guide(tfmot, keras, weights, train, test):
    quantized = tfmot.quantization.keras.quantize_model(baseline(keras, weights))
    compile_(quantized, keras)
    quantized.fit(train[0][:1000], train[1][:1000], batch_size=500, epochs=1,
                  validation_split=VALIDATION, verbose=0)
    return {"accuracy": keras_accuracy(quantized, test),
            "tflite_accuracy": tflite_accuracy(quantized, test)}


def pqat_guide(tfmot, keras, weights, train, test):
    pruned = tfmot.sparsity.keras.prune_low_magnitude(
        baseline(keras, weights), pruning_schedule=tfmot.sparsity.keras.ConstantSparsity(
            0.5, begin_step=0, frequency=100))
    compile_(pruned, keras)
    pruned.fit(*train, batch_size=128, epochs=3, validation_split=VALIDATION, verbose=0,
               callbacks=[tfmot.sparsity.keras.UpdatePruningStep()])
    stripped = tfmot.sparsity.keras.strip_pruning(pruned)
    annotated = tfmot.quantization.keras.quantize_annotate_model(stripped)
    pqat = tfmot.quantization.keras.quantize_apply(
        annotated, tfmot.experimental.combine.Default8BitPrunePreserveQuantizeScheme())
    compile_(pqat, keras)
    pqat.fit(*train, batch_size=128, epochs=1, validation_split=VALIDATION, verbose=0)
    return {"pruned_sparsity": kernel_sparsity(stripped), "sparsity": kernel_sparsity(pqat),
            "accuracy": keras_accuracy(pqat, test), "tflite_accuracy": tflite_accuracy(pqat, test)}


def run_guides(tfmot, keras, weights, seed, train, test):
    keras.utils.set_random_seed(seed)
    with tempfile.TemporaryDirectory() as log_dir:
        return {"pruning": pruning_guide(tfmot, keras, weights, train, test, log_dir),
                "qat": qat_guide(tfmot, keras, weights, train, test),
                "pqat": pqat_guide(tfmot, keras, weights, train, test)}


def summarise(runs):
    table = {}
    for guide in runs[0]["kdist"]:
        row = {}
        for metric in runs[0]["kdist"][guide]:
            means = {lib: float(np.mean([run[lib][guide][metric] for run in runs]))
                     for lib in ("kdist", "tfmot")}
            row[metric] = dict(means, kdist_minus_tfmot=means["kdist"] - means["tfmot"])
        row["same_sparsity"] = ("sparsity" not in row
                                or abs(row["sparsity"]["kdist_minus_tfmot"]) <= 0.005)
        row["accuracy_within_0.01"] = all(
            abs(row[m]["kdist_minus_tfmot"]) <= 0.01 for m in ("accuracy", "tflite_accuracy")
            if m in row)
        table[guide] = row
    return table


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--rows", type=int, default=12000, help="training images")
    parser.add_argument("--test-rows", type=int, default=2000)
    parser.add_argument("--baseline-epochs", type=int, default=4)
    args = parser.parse_args()
    if args.seeds < 1 or args.rows < 1100 or args.test_rows < 1 or args.baseline_epochs < 1:
        parser.error("--seeds, --test-rows and --baseline-epochs must be positive and "
                     "--rows at least 1100 (the QAT guide trains on 1,000 images)")

    import keras
    import tf_keras

    import kdist.tfmot
    from kdist.sparsity.bridge import tfmot as load_tfmot

    real_tfmot = load_tfmot()  # without leaving TF_USE_LEGACY_KERAS set for Keras 3
    runs = []
    started = time.perf_counter()
    for seed in range(args.seeds):
        train = make_digits(args.rows, 2 * seed)
        test = make_digits(args.test_rows, 2 * seed + 1)
        keras.utils.set_random_seed(seed)
        model = baseline(keras, guide_model(keras).get_weights())
        model.fit(*train, epochs=args.baseline_epochs, validation_split=VALIDATION, verbose=0)
        weights = model.get_weights()
        runs.append({
            "seed": seed, "baseline_accuracy": keras_accuracy(model, test),
            "kdist": run_guides(kdist.tfmot, keras, weights, seed, train, test),
            "tfmot": run_guides(real_tfmot, tf_keras, weights, seed, train, test)})
    print(json.dumps({"seeds": args.seeds, "rows": args.rows, "test_rows": args.test_rows,
                      "baseline_epochs": args.baseline_epochs, "runs": runs,
                      "summary": summarise(runs),
                      "seconds": round(time.perf_counter() - started, 1)}, indent=1))


if __name__ == "__main__":
    main()
