"""Small stand-ins for what the documentation's code blocks take as given.

README.md and docs/ show fragments of a user's script: `build_model()`,
`dataset`, `x, y`, a generator and a discriminator. `docs_runner.py` runs
every block with these names defined first, on data small enough that each
block takes seconds. A block that defines a name itself uses its own.
"""

import keras
import numpy as np
import tensorflow as tf

import kdist
from kdist import sparsity

hvd = kdist  # as the Horovod-style blocks import it

FEATURES, CLASSES, ROWS = 20, 2, 256

_rng = np.random.default_rng(0)
x = _rng.normal(size=(ROWS, FEATURES)).astype("float32")
y = (x[:, 0] + x[:, 1] > 0).astype("int64")
x_val = xv = x_test = x[:64]
y_val = yv = y_test = y[:64]
dataset = tf.data.Dataset.from_tensor_slices((x, y))  # unbatched, as a loader gives it


train = dataset.batch(64)


def make_dataset():
    return dataset


def build_model(hp=None):
    """A classifier with a softmax head; as a hypermodel (given `hp`) it picks its width
    and comes compiled, as keras-tuner expects."""
    units = hp.Int("units", 8, 32, step=8) if hp is not None else 16
    built = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(units, "relu"),
                              keras.layers.Dense(CLASSES, activation="softmax")])
    if hp is not None:
        built.compile(optimizer="adam", loss="sparse_categorical_crossentropy",
                      metrics=["accuracy"])
    return built


def build_and_compile_cnn_model():
    model = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Conv2D(4, 3, activation="relu"),
                              keras.layers.Flatten(), keras.layers.Dense(10)])
    model.compile(optimizer=keras.optimizers.SGD(0.001), metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


multi_worker_dataset = tf.data.Dataset.from_tensor_slices(
    (_rng.normal(size=(64, 8, 8, 1)).astype("float32"), _rng.integers(0, 10, 64))).repeat().batch(8)

# A model with a logits head named "logits", as the sparsity guide prunes it.
model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(32, activation="relu"),
                          keras.layers.Dense(CLASSES, name="logits")])
model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
model.optimizer.build(model.trainable_variables)
schedule = sparsity.PolynomialDecay(0.0, 0.5, begin_step=0, end_step=100)

# A conditional GAN on 8-cell "showers" whose total follows the energy. The
# `discriminator` has two auxiliary heads (energy and total), for blocks that
# give two aux_losses; `make_discriminator()` builds one without.
LATENT = 4
energies = _rng.uniform(10.0, 100.0, (128, 1)).astype("float32")
showers = (energies / 8.0 * _rng.uniform(0.5, 1.5, (128, 8))).astype("float32")


def make_generator():
    noise, energy = keras.Input((LATENT,)), keras.Input((1,))
    hidden = keras.layers.Dense(16, activation="relu")(
        keras.layers.Concatenate()([noise, keras.layers.Rescaling(0.01)(energy)]))
    return keras.Model([noise, energy], keras.layers.Dense(8, activation="relu")(hidden))


def make_discriminator(aux_heads=()):
    shower = keras.Input((8,))
    hidden = keras.layers.Dense(16, activation="relu")(keras.layers.Rescaling(0.1)(shower))
    fake = keras.layers.Dense(1, activation="sigmoid", name="fake")(hidden)
    heads = [keras.layers.Dense(1, name=name)(hidden) for name in aux_heads]
    return keras.Model(shower, [fake] + heads if heads else fake)


generator, discriminator = make_generator(), make_discriminator(("energy", "total"))
global_batches = tf.data.Dataset.from_tensor_slices((showers, energies)).batch(32)

# For the elastic guide, and the tfmot guide's pruning flow.
lr, total_epochs = 0.01, 2
end_step, logdir = 100, "logs"
