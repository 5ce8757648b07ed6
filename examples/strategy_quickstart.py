"""The digit classifier again, written the tf.distribute way: one strategy line.

    python examples/strategy_quickstart.py                  # 1 process
    kdist run -n 2 examples/strategy_quickstart.py          # 2 MPI ranks: MPIStrategy
    kdist launch -n 2 examples/strategy_quickstart.py       # 2 TensorFlow workers

`kdist.distribute.auto()` picks the strategy from how the script was started.
The dataset is batched with the global batch size and is the same on every
process; the strategy gives each replica its share, starts every replica from
the same weights and reports metrics over all of them.
"""

import argparse

import keras
import tensorflow as tf
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import kdist


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=32, help="per replica")
    parser.add_argument("--learning-rate", type=float, default=1e-3, help="for one replica")
    return parser.parse_args()


def main():
    args = parse_args()
    strategy = kdist.distribute.auto()
    replicas = strategy.num_replicas_in_sync
    digits = load_digits()
    x = (digits.images.reshape(-1, 64) / 16.0).astype("float32")
    x_train, x_test, y_train, y_test = train_test_split(
        x, digits.target.astype("int64"), test_size=0.2, random_state=0, stratify=digits.target)
    global_batch = args.batch_size * replicas
    # The same seed everywhere: every process must read the same global batches.
    train = (tf.data.Dataset.from_tensor_slices((x_train, y_train))
             .shuffle(2048, seed=1, reshuffle_each_iteration=True)
             .batch(global_batch))
    test = tf.data.Dataset.from_tensor_slices((x_test, y_test)).batch(global_batch)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    train, test = train.with_options(options), test.with_options(options)

    with strategy.scope():
        model = keras.Sequential([
            keras.Input((64,)),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.BatchNormalization(synchronized=True),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(10),
        ])
        model.compile(optimizer=keras.optimizers.Adam(args.learning_rate * replicas),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])

    first = kdist.rank() == 0 and _is_chief()
    if first:
        print(f"{type(strategy).__name__}: {replicas} replica(s), global batch {global_batch}, "
              f"{len(x_train)} images.")
    # The dataset shuffles itself; Keras's own shuffle does not apply to datasets.
    model.fit(train, epochs=args.epochs, validation_data=test, shuffle=False,
              verbose=2 if first else 0)
    loss, accuracy = model.evaluate(test, verbose=0)
    if first:
        print(f"test accuracy {accuracy:.3f}, loss {loss:.3f}")


def _is_chief():
    """Task 0 of a TensorFlow cluster (always true without TF_CONFIG)."""
    import json
    import os

    config = json.loads(os.environ.get("TF_CONFIG", "{}") or "{}")
    return config.get("task", {}).get("index", 0) == 0


if __name__ == "__main__":
    main()
