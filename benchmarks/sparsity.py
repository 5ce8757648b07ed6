"""Accuracy after pruning and quantization-aware training: kdist (Keras 3) against
tensorflow-model-optimization (tf_keras) on the same task, architecture, schedule,
starting weights and epochs.

    python benchmarks/sparsity.py [--seeds 3] [--epochs 8] [--sparsities 0.5,0.8,0.9]

The task is made here: 10-class classification from scikit-learn's
`make_classification` (64 features, 24,000 rows, 4,000 held out). A 64-256-256-10
ReLU MLP is first trained dense with Keras 3; its weights start every variant.
Each variant is then fine-tuned for `--epochs` epochs with Adam (1e-3, batch 128):

- `dense`: no pruning (the reference for both libraries, trained in each);
- `pruned@s`: PolynomialDecay(0 -> s, power 3) over the first 70% of the steps,
  masks updated every 20 steps, every Dense layer but the last pruned;
- `qat8`: 8-bit quantization-aware training of the whole model.

Test accuracy is taken after `strip`. `drop` is the dense fine-tune's accuracy
minus the variant's, in points, averaged over seeds. Targets: kdist's pruning
drop <= tfmot's + 0.5 points; kdist's 8-bit QAT no more than 0.5 points below
float. `step_time_ratio` is each variant's fine-tuning time over the dense
fine-tune's in the same library.
Prints one JSON object.
"""

import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402

BATCH, LR, FREQUENCY, RAMP = 128, 1e-3, 20, 0.7


def make_task(seed):
    from sklearn.datasets import make_classification

    x, y = make_classification(n_samples=24000, n_features=64, n_informative=40,
                               n_redundant=8, n_classes=10, n_clusters_per_class=2,
                               class_sep=1.2, flip_y=0.01, random_state=seed)
    x = ((x - x.mean(0)) / x.std(0)).astype("float32")
    return (x[:20000], y[:20000]), (x[20000:], y[20000:])


def keras3_model(lib, seed):
    lib.utils.set_random_seed(seed)
    return lib.Sequential([lib.layers.Input((64,)),
                           lib.layers.Dense(256, activation="relu", name="hidden1"),
                           lib.layers.Dense(256, activation="relu", name="hidden2"),
                           lib.layers.Dense(10, name="logits")])


def compile_(model, lib):
    model.compile(optimizer=lib.optimizers.Adam(LR), metrics=["accuracy"],
                  loss=lib.losses.SparseCategoricalCrossentropy(from_logits=True))


def accuracy(model, data):
    logits = model.predict(data[0], batch_size=1024, verbose=0)
    return float(np.mean(np.argmax(logits, -1) == data[1]))


def run_kdist(weights, seed, train, test, epochs, sparsities):
    import keras

    from kdist import sparsity

    steps = epochs * (len(train[0]) // BATCH + (len(train[0]) % BATCH > 0))
    results, seconds = {}, {}

    def fine_tune(name, transform, callbacks=()):
        model = keras3_model(keras, seed)
        model.set_weights(weights)
        model = transform(model)
        compile_(model, keras)
        started = time.perf_counter()
        model.fit(*train, batch_size=BATCH, epochs=epochs, verbose=0,
                  callbacks=list(callbacks))
        seconds[name] = time.perf_counter() - started
        results[name] = accuracy(model, test) if name.startswith("qat") else accuracy(
            sparsity.strip(model), test)

    fine_tune("dense", lambda m: m)
    for s in sparsities:
        schedule = sparsity.PolynomialDecay(0.0, s, 0, int(RAMP * steps), frequency=FREQUENCY)
        fine_tune(f"pruned@{s}", lambda m: sparsity.prune(m, schedule, skip=["logits"]),
                  [sparsity.UpdatePruning()])
    fine_tune("qat8", lambda m: sparsity.quantize(m, bits=8))
    return results, seconds


def run_tfmot(weights, seed, train, test, epochs, sparsities):
    import tf_keras

    from kdist.sparsity.bridge import tfmot as load_tfmot

    tfmot = load_tfmot()  # without leaving TF_USE_LEGACY_KERAS set for later imports
    prune = tfmot.sparsity.keras
    steps = epochs * (len(train[0]) // BATCH + (len(train[0]) % BATCH > 0))
    results, seconds = {}, {}

    def fine_tune(name, transform, callbacks=()):
        model = keras3_model(tf_keras, seed)
        model.set_weights(weights)
        model = transform(model)
        compile_(model, tf_keras)
        started = time.perf_counter()
        model.fit(*train, batch_size=BATCH, epochs=epochs, verbose=0,
                  callbacks=list(callbacks))
        seconds[name] = time.perf_counter() - started
        if name.startswith("pruned"):
            model = prune.strip_pruning(model)
        results[name] = accuracy(model, test)

    def pruned(schedule):
        def transform(model):
            return tf_keras.models.clone_model(model, clone_function=lambda layer: (
                layer if layer.name == "logits"
                else prune.prune_low_magnitude(layer, pruning_schedule=schedule)))

        return transform

    fine_tune("dense", lambda m: m)
    for s in sparsities:
        schedule = prune.PolynomialDecay(0.0, s, 0, int(RAMP * steps), frequency=FREQUENCY)
        fine_tune(f"pruned@{s}", pruned(schedule), [prune.UpdatePruningStep()])
    fine_tune("qat8", tfmot.quantization.keras.quantize_model)
    return results, seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--pretrain-epochs", type=int, default=10)
    parser.add_argument("--sparsities", default="0.5,0.8,0.9")
    parser.add_argument("--rows", type=int, default=0,
                        help="use only this many training rows (a quick smoke run)")
    args = parser.parse_args()
    sparsities = [float(s) for s in args.sparsities.split(",")]

    import logging

    import keras

    logging.getLogger("tensorflow").setLevel(logging.ERROR)  # retracing notices
    runs = []
    for seed in range(args.seeds):
        train, test = make_task(seed)
        if args.rows:
            train = (train[0][:args.rows], train[1][:args.rows])
        base = keras3_model(keras, seed)
        compile_(base, keras)
        base.fit(*train, batch_size=BATCH, epochs=args.pretrain_epochs, verbose=0)
        weights = base.get_weights()
        ours, our_time = run_kdist(weights, seed, train, test, args.epochs, sparsities)
        theirs, their_time = run_tfmot(weights, seed, train, test, args.epochs, sparsities)
        runs.append({"seed": seed, "pretrained": accuracy(base, test), "kdist": ours,
                     "tfmot": theirs, "seconds": {"kdist": our_time, "tfmot": their_time}})

    def mean_drop(lib, name):
        return float(np.mean([100 * (r[lib]["dense"] - r[lib][name]) for r in runs]))

    summary = {}
    for s in sparsities:
        name = f"pruned@{s}"
        ours, theirs = mean_drop("kdist", name), mean_drop("tfmot", name)
        summary[name] = {"kdist_drop_points": ours, "tfmot_drop_points": theirs,
                         "kdist_minus_tfmot": ours - theirs, "target_met": ours <= theirs + 0.5}
    qat = mean_drop("kdist", "qat8")
    summary["qat8"] = {"kdist_drop_points": qat, "tfmot_drop_points": mean_drop("tfmot", "qat8"),
                       "target_met": qat <= 0.5}
    summary["step_time_ratio"] = {
        lib: {name: float(np.mean([r["seconds"][lib][name] / r["seconds"][lib]["dense"]
                                   for r in runs])) for name in runs[0]["seconds"][lib]}
        for lib in ("kdist", "tfmot")}
    print(json.dumps({"benchmark": "sparsity", "seeds": args.seeds, "epochs": args.epochs,
                      "summary": summary, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
