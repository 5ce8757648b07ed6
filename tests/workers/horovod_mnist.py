"""Horovod's TF2-Keras MNIST example with only its import and Keras-2 spellings changed.

The data are scikit-learn's 8x8 digits (no download). The model has no Input,
so Keras builds it in the first train step, after the callbacks start.
"""

import os
import sys

import numpy as np
import tensorflow as tf

import kdist as hvd  # was: import horovod.tensorflow.keras as hvd
from common import digits_dataset, flat_weights, report


def main(checkpoints):
    hvd.init()

    gpus = tf.config.experimental.list_physical_devices("GPU")
    for gpu in gpus:
        tf.config.experimental.set_memory_growth(gpu, True)
    if gpus:
        tf.config.experimental.set_visible_devices(gpus[hvd.local_rank()], "GPU")

    dataset, digits = digits_dataset(shuffle_seed=hvd.rank())

    mnist_model = tf.keras.Sequential([
        tf.keras.layers.Conv2D(8, [3, 3], activation="relu"),
        tf.keras.layers.Conv2D(16, [3, 3], activation="relu"),
        tf.keras.layers.MaxPooling2D(pool_size=(2, 2)),
        tf.keras.layers.Dropout(0.25),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(32, activation="relu"),
        tf.keras.layers.Dropout(0.5),
        tf.keras.layers.Dense(10, activation="softmax"),
    ])

    scaled_lr = 0.001 * hvd.size()
    opt = tf.optimizers.Adam(scaled_lr)
    opt = hvd.DistributedOptimizer(opt, backward_passes_per_step=1,
                                   average_aggregated_gradients=True)
    mnist_model.compile(loss=tf.losses.SparseCategoricalCrossentropy(), optimizer=opt,
                        metrics=["accuracy"])

    callbacks = [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        hvd.callbacks.MetricAverageCallback(),
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr, warmup_epochs=1,
                                                 verbose=1),
    ]
    if hvd.rank() == 0:
        callbacks.append(tf.keras.callbacks.ModelCheckpoint(
            os.path.join(checkpoints, "checkpoint-{epoch}.h5")))
    verbose = 1 if hvd.rank() == 0 else 0
    mnist_model.fit(dataset, steps_per_epoch=40 // hvd.size(), callbacks=callbacks, epochs=2,
                    verbose=verbose)

    held_out = digits.images[-200:, ..., None] / 16.0
    accuracy = float(np.mean(np.argmax(mnist_model.predict(held_out, verbose=0), -1)
                             == digits.target[-200:]))
    report({"weights": flat_weights(mnist_model), "accuracy": accuracy})


if __name__ == "__main__":
    main(sys.argv[1])
