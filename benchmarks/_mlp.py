"""The benchmark model: a 784-512-512-10 MLP (670k parameters) on synthetic data."""

import numpy as np


def build_mlp(width=512):
    """784-width-width-10: 670k parameters at the default width, 10.2M at 2816."""
    import keras

    keras.utils.set_random_seed(0)
    return keras.Sequential([
        keras.Input((784,)),
        keras.layers.Dense(width, activation="relu"),
        keras.layers.Dense(width, activation="relu"),
        keras.layers.Dense(10),
    ])


def synthetic_mnist_like(rows, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.random((rows, 784), dtype=np.float32)
    y = rng.integers(0, 10, rows).astype("int64")
    return x, y


def one_thread():
    """One intra-op and one inter-op thread, set before TensorFlow starts."""
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
