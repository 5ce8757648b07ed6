"""Helpers for scripts that tests run on several ranks."""

import gc
import json
import os

import numpy as np


def report(obj):
    """Hands a JSON object back to the test that launched this rank."""
    import kdist

    write_report(kdist.rank(), obj)


def write_report(index, obj):
    """Writes process `index`'s report atomically where the test collects it."""
    directory = os.environ["KDIST_TEST_REPORTS"]
    path = os.path.join(directory, f"rank-{index}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f)
    os.replace(path + ".tmp", path)


def settle_imports():
    """Hides what the imports made from the garbage collector, as conftest.py does for
    the test process: keras-tuner collects garbage twice a trial, about 0.3 s each."""
    gc.collect()
    gc.freeze()


def flat_weights(model):
    return np.concatenate([np.asarray(w, dtype=np.float64).reshape(-1)
                           for w in model.get_weights()]).tolist()


def small_model(seed=0, inputs=12, classes=4, lazy=False):
    """A small classifier; `lazy` leaves out the Input, so Keras builds it in the first step."""
    import keras

    keras.utils.set_random_seed(seed)
    return keras.Sequential(([] if lazy else [keras.Input((inputs,))]) + [
        keras.layers.Dense(32, activation="tanh"),
        keras.layers.Dense(16, activation="tanh"),
        keras.layers.Dense(classes),
    ])


def global_batches(steps, global_batch, inputs=12, classes=4, seed=7):
    """The same data on every rank: `steps` batches of `global_batch` rows."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(steps, global_batch, inputs)).astype("float32")
    w = rng.normal(size=(inputs, classes))
    y = np.argmax(x @ w + 0.5 * rng.normal(size=(steps, global_batch, classes)), axis=-1)
    return x, y.astype("int64")


def digits_dataset(shuffle_seed, batch=32):
    """Scikit-learn's 8x8 digits (shipped, no download) as Horovod's MNIST examples feed
    theirs: repeated, shuffled with `shuffle_seed`, batched. Returns (dataset, digits)."""
    import tensorflow as tf
    from sklearn.datasets import load_digits

    digits = load_digits()
    dataset = tf.data.Dataset.from_tensor_slices(
        (tf.cast(digits.images[..., tf.newaxis] / 16.0, tf.float32),
         tf.cast(digits.target, tf.int64)))
    return dataset.repeat().shuffle(1000, seed=shuffle_seed).batch(batch), digits


def digits_cnn(dropout=None):
    """The small CNN of Horovod's MNIST examples, for 8x8 digits, without an `Input`:
    Keras builds it in its first step, as those examples' models are built."""
    import tensorflow as tf

    layers = [tf.keras.layers.Conv2D(8, [3, 3], activation="relu"),
              tf.keras.layers.MaxPooling2D(pool_size=(2, 2))]
    if dropout is not None:
        layers.append(tf.keras.layers.Dropout(dropout))
    layers += [tf.keras.layers.Flatten(), tf.keras.layers.Dense(32, activation="relu"),
               tf.keras.layers.Dense(10, activation="softmax")]
    return tf.keras.Sequential(layers)
