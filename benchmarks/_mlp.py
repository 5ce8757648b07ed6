"""The benchmark models: a 784-512-512-10 MLP (670k parameters) on synthetic data, and a
small convolutional net on synthetic 32x32 colour images."""

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


def build_convnet(width=32, dense=128):
    """Two pairs of 3x3 convolutions (`width`, then 2 x `width` filters), each pair
    followed by 2x2 pooling, then a `dense` layer and 10 outputs: 0.6M parameters at the
    defaults, most of them in the first dense layer, most of the compute in the
    convolutions (whose gradients backpropagation produces last)."""
    import keras

    keras.utils.set_random_seed(0)
    conv = keras.layers.Conv2D
    return keras.Sequential([
        keras.Input((32, 32, 3)),
        conv(width, 3, padding="same", activation="relu"),
        conv(width, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(),
        conv(2 * width, 3, padding="same", activation="relu"),
        conv(2 * width, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dense(dense, activation="relu"),
        keras.layers.Dense(10),
    ])


def synthetic_images(rows, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.random((rows, 32, 32, 3), dtype=np.float32)
    y = rng.integers(0, 10, rows).astype("int64")
    return x, y


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
