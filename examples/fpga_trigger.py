"""A trigger classifier for an FPGA: pruned and trained in fixed point on many
ranks, exported to hls4ml firmware that computes the same numbers.

    python examples/fpga_trigger.py                         # 1 process
    kdist run -n 2 examples/fpga_trigger.py                 # 2 ranks, data parallel

The task stands in for jet tagging at a collider trigger: 16 features per jet,
5 classes (made here with scikit-learn; no download). The network is the small
16-64-32-32-5 ReLU MLP that fits in a few microseconds of FPGA latency.

1. trains it in float;
2. prunes it to `--sparsity` while training it on `--bits`-bit fixed-point grids
   (`quantize(..., fixed_point=True)`), with the same masks and output ranges on
   every rank;
3. on rank 0, writes the hls4ml project to `--output-dir`, compiles its C++
   emulation and checks it against the Keras model on the test jets.

Needs the `fpga` extra (hls4ml) and a C++ compiler; no FPGA vendor tools.
"""

import argparse

import keras
import numpy as np
from sklearn.datasets import make_classification

import kdist
from kdist import sparsity


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=8, help="for each of the 2 phases")
    parser.add_argument("--bits", type=int, default=6)
    parser.add_argument("--sparsity", type=float, default=0.5)
    parser.add_argument("--batch-size", type=int, default=64, help="per rank")
    parser.add_argument("--rows", type=int, default=20000)
    parser.add_argument("--output-dir", default="trigger_hls4ml")
    return parser.parse_args()


def jets(rows):
    x, y = make_classification(n_samples=rows, n_features=16, n_informative=12,
                               n_redundant=2, n_classes=5, n_clusters_per_class=2,
                               class_sep=1.5, random_state=7)
    x = ((x - x.mean(0)) / x.std(0)).astype("float32")
    split = int(0.8 * rows)
    return (x[:split], y[:split]), (x[split:], y[split:])


def fit(model, data, epochs, batch_size, callbacks=()):
    model.compile(optimizer=kdist.DistributedOptimizer(keras.optimizers.Adam(2e-3)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(*data, batch_size=batch_size, epochs=epochs, verbose=0,
              callbacks=[kdist.callbacks.BroadcastGlobalVariablesCallback(0), *callbacks])


def main():
    args = parse_args()
    kdist.init()
    rank, size = kdist.rank(), kdist.size()
    (x_train, y_train), (x_test, y_test) = jets(args.rows)
    mine = (x_train[rank::size], y_train[rank::size])

    def accuracy(outputs):
        return float(np.mean(np.argmax(outputs, -1) == y_test))

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((16,)),
                              keras.layers.Dense(64, activation="relu", name="fc1"),
                              keras.layers.Dense(32, activation="relu", name="fc2"),
                              keras.layers.Dense(32, activation="relu", name="fc3"),
                              keras.layers.Dense(5, name="logits")])
    fit(model, mine, args.epochs, args.batch_size)
    if rank == 0:
        print(f"float: test accuracy {accuracy(model.predict(x_test, verbose=0)):.3f}",
              flush=True)

    steps = args.epochs * -(-len(mine[0]) // args.batch_size)
    schedule = sparsity.PolynomialDecay(0.0, args.sparsity, begin_step=0,
                                        end_step=int(0.6 * steps), frequency=20)
    pruned = sparsity.prune(model, schedule, skip=["logits"])
    trigger = sparsity.quantize(pruned, bits=args.bits, fixed_point=True)
    fit(trigger, mine, args.epochs, args.batch_size,
        [sparsity.UpdatePruning(log_sparsity=False), sparsity.SyncQuantizeRanges()])
    if rank != 0:
        return
    expected = trigger.predict(x_test, verbose=0)
    zeros = np.mean(list(sparsity.sparsity_of(trigger).values()))
    print(f"{args.bits}-bit fixed point, {zeros:.0%} pruned: test accuracy "
          f"{accuracy(expected):.3f}", flush=True)

    firmware = sparsity.export_hls4ml(trigger, args.output_dir, representative_data=x_train)
    for layer in firmware.get_layers():
        print(f"  {layer.name:10s} {layer.get_output_variable().type.precision}")
    check = sparsity.compare_hls4ml(trigger, firmware, x_test)
    print(f"firmware in {args.output_dir}: {check['bit_exact_fraction']:.2%} of "
          f"{check['outputs']} outputs bit-exact, largest difference "
          f"{check['max_abs_difference']:g}", flush=True)
    print(f"firmware: test accuracy {accuracy(sparsity.predict_hls4ml(firmware, x_test)):.3f}",
          flush=True)


if __name__ == "__main__":
    main()
