"""Generator and discriminator of the 3D calorimeter GAN (3DGAN), full size and small.

The layout follows the published 3DGAN for the CLIC electromagnetic
calorimeter: the generator multiplies a 200-dimensional latent vector by the
primary energy, expands it with a dense layer into a small 3D volume and grows
it through 3D convolutions (LeakyReLU, batch normalisation, upsampling) to
25x25x25 cells with a ReLU output, so that empty cells are exactly zero. The
discriminator is a stack of 3D convolutions with LeakyReLU, batch
normalisation and dropout, then average pooling and three heads: real/fake
(sigmoid), the regressed primary energy, and the sum of the cell energies.

`small=True` gives a lighter variant that trains about 20 times more showers
per second on a CPU (docs/performance.md), for CPU work and tests.

Units: the models see cell energies in GeV times `CELL_SCALE`, which brings
the typical occupied cell near 0.01-1 (smaller values starved the ReLU output
of gradient in trials), and the primary energy divided by `ENERGY_SCALE`.
"""

import keras
from keras import layers

LATENT = 200
CELLS = 25
ENERGY_SCALE = 100.0  # GeV
CELL_SCALE = 50.0     # per GeV


@keras.saving.register_keras_serializable(package="gan_calorimeter")
class CellSum(layers.Layer):
    """Sum of the cell energies of each shower: the discriminator's third head."""

    def call(self, showers):
        return keras.ops.sum(showers, axis=(1, 2, 3, 4))[:, None]

    def compute_output_shape(self, input_shape):
        return (input_shape[0], 1)


def generator(small=False, latent=LATENT):
    """The generator: [latent (latent,), energy (1,)] -> shower (25, 25, 25, 1)."""
    noise = keras.Input((latent,), name="latent")
    energy = keras.Input((1,), name="energy")
    x = layers.Multiply()([noise, energy])
    if small:
        x = layers.Dense(5 * 5 * 5 * 8)(x)
        x = layers.Reshape((5, 5, 5, 8))(x)
        x = layers.Conv3D(16, 3, padding="same", kernel_initializer="he_uniform")(x)
        x = layers.LeakyReLU(0.2)(x)
        x = layers.BatchNormalization()(x)
        x = layers.UpSampling3D(5)(x)
        x = layers.Conv3D(8, 3, padding="same", kernel_initializer="he_uniform")(x)
        x = layers.LeakyReLU(0.2)(x)
    else:
        x = layers.Dense(7 * 7 * 8 * 8)(x)
        x = layers.Reshape((7, 7, 8, 8))(x)
        x = layers.Conv3D(64, (6, 6, 8), padding="same", kernel_initializer="he_uniform")(x)
        x = layers.LeakyReLU(0.2)(x)
        x = layers.BatchNormalization()(x)
        x = layers.UpSampling3D(2)(x)                                  # 14, 14, 16
        x = layers.Conv3D(32, (5, 5, 5), padding="same", kernel_initializer="he_uniform")(x)
        x = layers.LeakyReLU(0.2)(x)
        x = layers.BatchNormalization()(x)
        x = layers.UpSampling3D(2)(x)                                  # 28, 28, 32
        x = layers.Conv3D(6, (4, 4, 8), kernel_initializer="he_uniform")(x)   # 25, 25, 25
        x = layers.LeakyReLU(0.2)(x)
        x = layers.BatchNormalization()(x)
    x = layers.Conv3D(1, 3, padding="same", use_bias=False, kernel_initializer="glorot_normal")(x)
    shower = layers.ReLU(name="shower")(x)
    return keras.Model([noise, energy], shower, name="generator_small" if small else "generator")


def discriminator(small=False):
    """The discriminator: shower -> [real/fake, energy, cell sum]."""
    shower = keras.Input((CELLS, CELLS, CELLS, 1), name="shower")
    if small:
        x = layers.Conv3D(8, 5, strides=2, padding="same")(shower)        # 13
        x = layers.LeakyReLU(0.2)(x)
        x = layers.Conv3D(8, 3, strides=2, padding="same")(x)             # 7
        x = layers.LeakyReLU(0.2)(x)
        x = layers.BatchNormalization()(x)
        x = layers.Dropout(0.2)(x)
        x = layers.AveragePooling3D(2)(x)                                  # 3
    else:
        x = layers.Conv3D(32, 5, padding="same")(shower)
        x = layers.LeakyReLU(0.2)(x)
        x = layers.Dropout(0.2)(x)
        for padding in (2, 2, 1):
            x = layers.ZeroPadding3D(padding)(x)
            x = layers.Conv3D(8, 5)(x)
            x = layers.LeakyReLU(0.2)(x)
            x = layers.BatchNormalization()(x)
            x = layers.Dropout(0.2)(x)
        x = layers.AveragePooling3D(2)(x)                                  # 11
    x = layers.Flatten()(x)
    fake = layers.Dense(1, activation="sigmoid", name="fake")(x)
    energy = layers.Dense(1, name="energy")(x)
    total = CellSum(name="ecal")(shower)
    return keras.Model(shower, [fake, energy, total],
                       name="discriminator_small" if small else "discriminator")
