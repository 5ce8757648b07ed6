"""Data-parallel training of a digit classifier, written as a Horovod script.

    kdist run -n 2 examples/quickstart.py           # 2 ranks
    python examples/quickstart.py                   # 1 process, same script

Each rank trains on its shard of scikit-learn's bundled handwritten digits
(8x8 images, no download); gradients are averaged across ranks every step, so
the ranks stay identical. Only rank 0 prints progress.
"""

import argparse

import keras
import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import kdist as hvd


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--learning-rate", type=float, default=1e-3, help="for one rank")
    parser.add_argument("--checkpoints", default=None,
                        help="directory for checkpoints; rerunning resumes from it")
    return parser.parse_args()


def load_data():
    digits = load_digits()
    x = (digits.images.reshape(-1, 64) / 16.0).astype("float32")
    y = digits.target.astype("int64")
    return train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)


def build_model():
    return keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(256, activation="relu"),
        keras.layers.Dense(256, activation="relu"),
        keras.layers.Dense(10),
    ])


def main():
    args = parse_args()
    hvd.init()
    keras.utils.set_random_seed(1234 + hvd.rank())  # different init on purpose: broadcast fixes it
    x_train, x_test, y_train, y_test = load_data()
    train = (tf.data.Dataset.from_tensor_slices((x_train, y_train))
             .shard(hvd.size(), hvd.rank())
             .shuffle(2048, seed=hvd.rank())
             .batch(args.batch_size))
    model = build_model()
    scaled_lr = args.learning_rate * hvd.size()
    model.compile(
        optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(scaled_lr)),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    callbacks = [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        hvd.callbacks.MetricAverageCallback(),
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr, warmup_epochs=2),
    ]
    if args.checkpoints:
        callbacks.append(hvd.callbacks.Checkpoint(args.checkpoints))
    if hvd.rank() == 0:
        print(f"Training on {hvd.size()} rank(s), global batch {args.batch_size * hvd.size()}, "
              f"{len(x_train)} images.")
    # The dataset shuffles itself; Keras's own shuffle does not apply to datasets.
    model.fit(train, epochs=args.epochs, callbacks=callbacks, shuffle=False,
              validation_data=(x_test, y_test), verbose=1 if hvd.rank() == 0 else 0)
    loss, accuracy = model.evaluate(x_test, y_test, verbose=0)
    weights_sum = float(sum(np.sum(w) for w in model.get_weights()))
    same = hvd.allgather_object(round(weights_sum, 4))
    if hvd.rank() == 0:
        print(f"Test accuracy {accuracy:.3f}; ranks hold identical weights: {len(set(same)) == 1}")


if __name__ == "__main__":
    main()
