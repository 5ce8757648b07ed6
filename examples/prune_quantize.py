"""Makes the digit classifier small and integer: prune it, then train it for 8 bits.

    python examples/prune_quantize.py                        # 1 process
    kdist run -n 2 examples/prune_quantize.py                # 2 ranks, data parallel

1. trains a 64-256-256-10 MLP dense;
2. prunes its hidden layers to `--sparsity` (PolynomialDecay over most of the
   pruning epochs) while training on, then strips the wrappers;
3. fine-tunes the pruned model with 8-bit quantization-aware training (its zeros
   stay zeros, its activation ranges agree across ranks) and writes the integer
   weights and their scales to `--export`;
4. with 8 bits, also writes a TFLite model that is int8 end to end next to it and
   reports that model's test accuracy.

Each rank trains on its own share of the images; gradients are averaged with
`kdist.DistributedOptimizer`, so every rank computes the same masks.
"""

import argparse
import os

import keras
import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import kdist
from kdist import sparsity


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10, help="for each of the 3 phases")
    parser.add_argument("--sparsity", type=float, default=0.9)
    parser.add_argument("--bits", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--export", default="digits_int.npz")
    return parser.parse_args()


def fit(model, data, epochs, batch_size, callbacks=()):
    model.compile(optimizer=kdist.DistributedOptimizer(keras.optimizers.Adam(1e-3)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    model.fit(*data, batch_size=batch_size, epochs=epochs, verbose=0,
              callbacks=[kdist.callbacks.BroadcastGlobalVariablesCallback(0),
                         kdist.callbacks.MetricAverageCallback(), *callbacks])


def main():
    args = parse_args()
    kdist.init()
    rank, size = kdist.rank(), kdist.size()
    digits = load_digits()
    x = (digits.images.reshape(-1, 64) / 16.0).astype("float32")
    x_train, x_test, y_train, y_test = train_test_split(
        x, digits.target.astype("int64"), test_size=0.25, random_state=0,
        stratify=digits.target)
    mine = (x_train[rank::size], y_train[rank::size])

    def report(stage, model):
        accuracy = np.mean(np.argmax(model.predict(x_test, verbose=0), -1) == y_test)
        if rank == 0:
            print(f"{stage}: test accuracy {accuracy:.3f}", flush=True)

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)),
                              keras.layers.Dense(256, activation="relu", name="hidden1"),
                              keras.layers.Dense(256, activation="relu", name="hidden2"),
                              keras.layers.Dense(10, name="logits")])
    fit(model, mine, args.epochs, args.batch_size)
    report("dense", model)

    steps = args.epochs * -(-len(mine[0]) // args.batch_size)
    schedule = sparsity.PolynomialDecay(0.0, args.sparsity, begin_step=0,
                                        end_step=int(0.7 * steps), frequency=10)
    pruned = sparsity.prune(model, schedule, skip=["logits"])
    fit(pruned, mine, args.epochs, args.batch_size, [sparsity.UpdatePruning()])
    pruned = sparsity.strip(pruned)
    report(f"pruned to {args.sparsity:.0%}", pruned)

    quantized = sparsity.quantize(pruned, bits=args.bits)
    # Every rank keeps the same activation ranges, hence the same integer model.
    fit(quantized, mine, args.epochs, args.batch_size, [sparsity.SyncQuantizeRanges()])
    report(f"{args.bits}-bit", quantized)
    if rank == 0:
        exported = sparsity.export_quantized(quantized, path=args.export)
        for name, entry in exported.items():
            codes, scales = entry["kernel"]
            print(f"{name}: {codes.dtype} {codes.shape}, {np.mean(codes == 0):.0%} zeros, "
                  f"{len(scales)} scales", flush=True)
        print(f"integer weights written to {args.export}")
        if args.bits == 8:
            path = os.path.splitext(args.export)[0] + ".tflite"
            flatbuffer = sparsity.export_tflite(quantized, path, representative_data=x_train)
            outputs = sparsity.run_tflite(flatbuffer, x_test)
            print(f"int8 TFLite model ({len(flatbuffer)} bytes) written to {path}: test "
                  f"accuracy {np.mean(np.argmax(outputs, -1) == y_test):.3f}", flush=True)


if __name__ == "__main__":
    main()
