"""Accuracy after pruning and quantization-aware training: kdist (Keras 3) against
tensorflow-model-optimization (tf_keras) and HGQ2 (Keras 3, where installed) on the
same task, architecture, schedule, starting weights and epochs.

    python benchmarks/sparsity.py [--seeds 3] [--epochs 8] [--sparsities 0.5,0.8,0.9]
                                  [--bits 8,6,4]

The task is made here: 10-class classification from scikit-learn's
`make_classification` (64 features, 24,000 rows, 4,000 held out). A 64-256-256-10
ReLU MLP is first trained dense with Keras 3; its weights start every variant.
Each variant is then fine-tuned for `--epochs` epochs with Adam (1e-3, batch 128):

- `dense`: no pruning (the reference for both libraries, trained in each);
- `pruned@s`: PolynomialDecay(0 -> s, power 3) over the first 70% of the steps,
  masks updated every 20 steps, every Dense layer but the last pruned;
- `qat{b}`: b-bit quantization-aware training of the whole model (kdist:
  float per-channel scales; tfmot: its default 8-bit scheme, and its experimental
  n-bit scheme (`DefaultNBitQuantizeScheme`) at other widths; HGQ2: QDense
  layers with fixed, untrained widths: b bits with 0 integer bits for weights
  and biases, 3 for activations, saturating, as a QKeras user would set them);
- `fixed{b}`: kdist's fixed-point QAT (`fixed_point=True`), what
  `export_hls4ml` turns into firmware bit for bit.

`weight_bytes` is what the kernels and biases take at their trained width,
counting nonzero weights only (what an FPGA spends multipliers on): 4 bytes a
float, b/8 bytes a b-bit weight.

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


def weight_bytes(arrays, bits=32):
    """Bytes of the nonzero entries of `arrays` at `bits` bits each."""
    return int(sum(np.count_nonzero(a) for a in arrays) * bits / 8)


def _kernels_and_biases(model):
    return [w for w in model.get_weights() if w.ndim <= 2 and w.size > 1]


def run_kdist(weights, seed, train, test, epochs, sparsities, widths):
    import keras

    from kdist import sparsity

    steps = epochs * (len(train[0]) // BATCH + (len(train[0]) % BATCH > 0))
    results, seconds, sizes = {}, {}, {}

    def fine_tune(name, transform, callbacks=(), bits=32):
        model = keras3_model(keras, seed)
        model.set_weights(weights)
        model = transform(model)
        compile_(model, keras)
        started = time.perf_counter()
        model.fit(*train, batch_size=BATCH, epochs=epochs, verbose=0,
                  callbacks=list(callbacks))
        seconds[name] = time.perf_counter() - started
        plain = sparsity.strip(model)
        quantized = name.startswith(("qat", "fixed"))
        results[name] = accuracy(model if quantized else plain, test)
        sizes[name] = weight_bytes(_kernels_and_biases(plain), bits)

    fine_tune("dense", lambda m: m)
    for s in sparsities:
        schedule = sparsity.PolynomialDecay(0.0, s, 0, int(RAMP * steps), frequency=FREQUENCY)
        fine_tune(f"pruned@{s}", lambda m: sparsity.prune(m, schedule, skip=["logits"]),
                  [sparsity.UpdatePruning()])
    for b in widths:
        fine_tune(f"qat{b}", lambda m: sparsity.quantize(m, bits=b), bits=b)
        fine_tune(f"fixed{b}", lambda m: sparsity.quantize(m, bits=b, fixed_point=True), bits=b)
    return results, seconds, sizes


def hgq2_model(seed, bits):
    import keras
    from hgq.config import LayerConfigScope, QuantizerConfigScope
    from hgq.layers import QDense

    keras.utils.set_random_seed(seed)
    # HGQ's KBI quantizer counts the sign apart: b0 + 1 bits in all.
    with QuantizerConfigScope(place=("weight", "bias"), q_type="kbi", b0=bits - 1, i0=0,
                              trainable=False, overflow_mode="SAT_SYM"), \
            QuantizerConfigScope(place="datalane", q_type="kbi", b0=bits - 1, i0=3,
                                 trainable=False, overflow_mode="SAT"), \
            LayerConfigScope(enable_ebops=False, beta0=0.0):
        return keras.Sequential([keras.layers.Input((64,)),
                                 QDense(256, activation="relu", name="hidden1"),
                                 QDense(256, activation="relu", name="hidden2"),
                                 QDense(10, name="logits")])


def run_hgq2(weights, seed, train, test, epochs, widths):
    import keras

    results, seconds, sizes = {}, {}, {}
    for b in widths:
        model = hgq2_model(seed, b)
        for layer, (kernel, bias) in zip(model.layers, zip(weights[::2], weights[1::2])):
            layer.kernel.assign(kernel)
            layer.bias.assign(bias)
        compile_(model, keras)
        started = time.perf_counter()
        model.fit(*train, batch_size=BATCH, epochs=epochs, verbose=0)
        seconds[f"qat{b}"] = time.perf_counter() - started
        results[f"qat{b}"] = accuracy(model, test)
        sizes[f"qat{b}"] = weight_bytes(
            [keras.ops.convert_to_numpy(layer.qkernel) for layer in model.layers], b)
    return results, seconds, sizes


def run_tfmot(weights, seed, train, test, epochs, sparsities, widths):
    import tf_keras

    from kdist.sparsity.bridge import tfmot as load_tfmot

    tfmot = load_tfmot()  # without leaving TF_USE_LEGACY_KERAS set for later imports
    prune = tfmot.sparsity.keras
    steps = epochs * (len(train[0]) // BATCH + (len(train[0]) % BATCH > 0))
    results, seconds, sizes = {}, {}, {}

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
        bits = int(name[3:]) if name.startswith("qat") else 32
        sizes[name] = weight_bytes([w for w in model.get_weights()
                                    if w.ndim in (1, 2) and w.size > 10], bits)

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
    quantization = tfmot.quantization.keras

    def n_bits(bits):
        # tfmot's experimental scheme for other widths: weights and activations in `bits`.
        scheme = quantization.experimental.default_n_bit.DefaultNBitQuantizeScheme(
            num_bits_weight=bits, num_bits_activation=bits)
        return lambda m: quantization.quantize_apply(quantization.quantize_annotate_model(m),
                                                     scheme)

    for b in widths:
        fine_tune(f"qat{b}", quantization.quantize_model if b == 8 else n_bits(b))
    return results, seconds, sizes


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--pretrain-epochs", type=int, default=10)
    parser.add_argument("--sparsities", default="0.5,0.8,0.9")
    parser.add_argument("--bits", default="8,6,4")
    parser.add_argument("--rows", type=int, default=0,
                        help="use only this many training rows (a quick smoke run)")
    args = parser.parse_args()
    sparsities = [float(s) for s in args.sparsities.split(",")]
    widths = [int(b) for b in args.bits.split(",")]
    try:
        import hgq  # noqa: F401
        libraries = ("kdist", "tfmot", "hgq2")
    except ImportError:
        libraries = ("kdist", "tfmot")

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
        run = {"seed": seed, "pretrained": accuracy(base, test), "seconds": {},
               "weight_bytes": {}}
        measured = {"kdist": run_kdist(weights, seed, train, test, args.epochs, sparsities,
                                       widths),
                    "tfmot": run_tfmot(weights, seed, train, test, args.epochs, sparsities,
                                       widths)}
        if "hgq2" in libraries:
            measured["hgq2"] = run_hgq2(weights, seed, train, test, args.epochs, widths)
        for lib, (results, seconds, sizes) in measured.items():
            run[lib], run["seconds"][lib], run["weight_bytes"][lib] = results, seconds, sizes
        runs.append(run)

    def mean_drop(lib, name):
        # HGQ2 has no dense run of its own: its reference is kdist's (same weights, Keras 3).
        reference = "kdist" if lib == "hgq2" else lib
        return float(np.mean([100 * (r[reference]["dense"] - r[lib][name]) for r in runs]))

    summary = {}
    for s in sparsities:
        name = f"pruned@{s}"
        ours, theirs = mean_drop("kdist", name), mean_drop("tfmot", name)
        summary[name] = {"kdist_drop_points": ours, "tfmot_drop_points": theirs,
                         "kdist_minus_tfmot": ours - theirs, "target_met": ours <= theirs + 0.5}
    qat = mean_drop("kdist", "qat8")
    summary["qat8"] = {"kdist_drop_points": qat, "tfmot_drop_points": mean_drop("tfmot", "qat8"),
                       "target_met": qat <= 0.5}
    # One row per variant, one column per library that has it.
    table = {}
    for lib in libraries:
        dense_time = {r["seed"]: r["seconds"]["kdist" if lib == "hgq2" else lib]["dense"]
                      for r in runs}
        for name in runs[0][lib]:
            table.setdefault(name, {})[lib] = {
                "accuracy": round(float(np.mean([r[lib][name] for r in runs])), 4),
                "drop_points": round(mean_drop(lib, name), 2),
                "step_time_ratio": round(float(np.mean(
                    [r["seconds"][lib][name] / dense_time[r["seed"]] for r in runs])), 2),
                "weight_bytes": runs[0]["weight_bytes"][lib][name]}
    summary["table"] = table
    print(json.dumps({"benchmark": "sparsity", "seeds": args.seeds, "epochs": args.epochs,
                      "summary": summary, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
