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
per second on a CPU (docs/lab/gan_throughput.md), for CPU work and tests.
`generator(coordinates=True)` lets the generator's last convolutions see each
cell's position (`CellCoordinates`), which narrows the shower core;
`discriminator(log_cells=True)` shows the discriminator log cell energies
(`LogCells`). docs/gan.md gives what each does to the calorimeter metrics.

Units: the models see cell energies in GeV times `CELL_SCALE`, which brings
the typical occupied cell near 0.01-1 (smaller values starved the ReLU output
of gradient in trials), and the primary energy divided by `ENERGY_SCALE`.
"""

import math

import keras
import numpy as np
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


@keras.saving.register_keras_serializable(package="gan_calorimeter")
class CellCoordinates(layers.Layer):
    """Appends each cell's position along x, y and depth, from -1 to 1, as 3 channels.

    Convolutions do not know where they are. After the small generator's
    five-fold nearest-neighbour upsampling, the cells of one block all start
    from the same values, and two 3x3x3 convolutions cannot make a shower core
    narrower than a block. With its position as input (as in CoordConv) a
    convolution can.
    """

    def call(self, x):
        sizes = tuple(x.shape[1:4])
        lines = []
        for axis, size in enumerate(sizes):
            shape = [1, 1, 1]
            shape[axis] = size
            line = keras.ops.reshape(keras.ops.linspace(-1.0, 1.0, size), shape)
            lines.append(keras.ops.broadcast_to(line, sizes))
        grid = keras.ops.cast(keras.ops.stack(lines, axis=-1)[None], x.dtype)
        grid = keras.ops.broadcast_to(grid, (keras.ops.shape(x)[0],) + sizes + (3,))
        return keras.ops.concatenate([x, grid], axis=-1)

    def compute_output_shape(self, input_shape):
        return tuple(input_shape[:-1]) + (input_shape[-1] + 3,)


@keras.saving.register_keras_serializable(package="gan_calorimeter")
class EveryOther(layers.Layer):
    """Keeps every other cell along x, y and depth, starting with the first."""

    def call(self, x):
        return x[:, ::2, ::2, ::2, :]

    def compute_output_shape(self, input_shape):
        return (input_shape[0],) + tuple(None if n is None else (n + 1) // 2
                                         for n in input_shape[1:4]) + (input_shape[4],)


@keras.saving.register_keras_serializable(package="gan_calorimeter")
class LogCells(layers.Layer):
    """What the discriminator sees with `log_cells=True`: log(1 + cells / unit) / 7.

    On a linear scale a core cell outweighs a single-hit cell a thousand times,
    so the discriminator cannot see whether the halo around the core is
    occupied. On this scale one hit (`unit`, in model units: the simulator's
    mean hit of 0.2 MeV times `CELL_SCALE`) reads log(2) / 7, about 0.1, and
    the hottest cells, near 10, about 1.
    """

    def __init__(self, unit=0.01, **kwargs):
        super().__init__(**kwargs)
        if not unit > 0:
            raise ValueError(f"unit must be > 0; got {unit!r}.")
        self.unit = float(unit)

    def call(self, showers):
        return keras.ops.log1p(showers / self.unit) / 7.0

    def get_config(self):
        return {**super().get_config(), "unit": self.unit}


@keras.saving.register_keras_serializable(package="gan_calorimeter")
class Log(layers.Layer):
    """The natural logarithm: primary energies span a factor 50."""

    def call(self, x):
        return keras.ops.log(x)


def gaussian_nll(target, params):
    """Negative log-likelihood of `target` under Normal(params[:, 0], exp(params[:, 1]))."""
    mean, log_sigma = params[:, 0:1], params[:, 1:2]
    return keras.ops.mean(log_sigma + 0.5 * keras.ops.square((target - mean)
                                                             * keras.ops.exp(-log_sigma)))


def total_energy(hidden=32):
    """The network of the total deposited energy: energy (1,) -> (mean, log sigma).

    It models log(deposited / primary), in model units, as a Gaussian whose
    mean and width depend on the primary energy, which is how a sampling
    calorimeter's response and resolution behave. It is fitted by maximum
    likelihood (`gaussian_nll`) on the real showers' totals before the GAN
    trains, then frozen: the energy of a shower is then right by construction,
    and the adversarial game only has to learn where the energy goes.
    """
    energy = keras.Input((1,), name="energy")
    x = Log(name="log_energy")(energy)
    x = layers.Dense(hidden, activation="tanh")(x)
    params = layers.Dense(2, name="log_deposit")(x)
    return keras.Model(energy, params, name="total_energy")


@keras.saving.register_keras_serializable(package="gan_calorimeter")
class SampleTotal(layers.Layer):
    """Total deposited energy in model units: energy * exp(mean + sigma * noise[:, 0]).

    The first latent coordinate (a standard normal draw) is the fluctuation of
    the total, so a generated shower's energy is reproducible from its latent.
    """

    def call(self, inputs):
        energy, params, noise = inputs
        mean, log_sigma = params[:, 0:1], params[:, 1:2]
        return energy * keras.ops.exp(mean + keras.ops.exp(log_sigma) * noise[:, 0:1])

    def compute_output_shape(self, input_shapes):
        return (input_shapes[0][0], 1)


@keras.saving.register_keras_serializable(package="gan_calorimeter")
class Deposit(layers.Layer):
    """Spreads a total energy over the cells: [logits per cell, total] -> shower.

    The fractions of the total are a softmax of the convolutions' logits over
    all cells: positive everywhere and never without gradient (a ReLU output
    can die), and a logit difference is a ratio of energies, the scale on
    which a shower's core and halo differ by orders of magnitude. Cells whose
    share falls below a learned threshold are emptied (soft thresholding,
    `relu(cell - threshold)`, so the threshold gets a gradient) and the rest
    are scaled back to the total.

    The threshold starts at `initial_threshold` (model units; one ionisation
    hit is about 0.01) and is kept as `log(threshold) / LOG_SCALE`, so that
    an optimizer step of 1e-3 moves it by 2 %: stored as its plain log, it
    moved by 1 % in an epoch of training.
    """

    LOG_SCALE = 20.0

    def __init__(self, initial_threshold=0.003, **kwargs):
        super().__init__(**kwargs)
        if not initial_threshold > 0:
            raise ValueError(f"initial_threshold must be > 0; got {initial_threshold!r}.")
        self.initial_threshold = float(initial_threshold)

    def build(self, input_shapes):
        self.log_threshold = self.add_weight(
            name="log_threshold", shape=(), initializer=keras.initializers.Constant(
                math.log(self.initial_threshold) / self.LOG_SCALE))
        # The log of the mean shower's cell fractions, added to the logits: set from the
        # data before training (`set_mean_shape`), so that the convolutions start from
        # the average shower and learn how a shower departs from it. Zero: no prior.
        self.mean_shape = self.add_weight(name="mean_shape", shape=tuple(input_shapes[0][1:]),
                                          initializer="zeros", trainable=False)

    def set_mean_shape(self, fractions, floor=1e-7):
        """Sets the prior from the mean cell fractions (cells, cells, cells) of real showers."""
        fractions = np.asarray(fractions, "float64").reshape(tuple(self.mean_shape.shape))
        if fractions.min() < 0 or not np.isclose(fractions.sum(), 1.0, atol=1e-3):
            raise ValueError("fractions must be non-negative and sum to 1.")
        self.mean_shape.assign(np.log(fractions + floor).astype("float32"))

    @property
    def threshold(self):
        """The threshold in model units."""
        return keras.ops.exp(self.log_threshold * self.LOG_SCALE)

    def call(self, inputs):
        logits, total = inputs
        axes = (1, 2, 3, 4)
        shape = keras.ops.shape(logits)
        flat = keras.ops.reshape(logits + self.mean_shape, (shape[0], -1))
        fractions = keras.ops.reshape(keras.ops.softmax(flat, axis=-1), shape)
        total = keras.ops.reshape(total, (-1, 1, 1, 1, 1))
        kept = keras.ops.relu(total * fractions - self.threshold)
        return total * kept / keras.ops.maximum(keras.ops.sum(kept, axis=axes, keepdims=True),
                                                1e-12)

    def compute_output_shape(self, input_shapes):
        return input_shapes[0]

    def get_config(self):
        return {**super().get_config(), "initial_threshold": self.initial_threshold}


def generator(small=False, latent=LATENT, coordinates=False, split_energy=False):
    """The generator: [latent (latent,), energy (1,)] -> shower (25, 25, 25, 1).

    With `coordinates=True`, `CellCoordinates` follows the last upsampling.
    With `split_energy=True` the total deposited energy comes from its own
    network (`total_energy`, a layer named "total_energy" to fit before
    training) and the convolutions only share it out over the cells
    (`Deposit`); otherwise their ReLU output is the shower.
    """
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
        if coordinates:
            x = CellCoordinates()(x)
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
        if coordinates:
            x = CellCoordinates()(x)
        x = layers.Conv3D(6, (4, 4, 8), kernel_initializer="he_uniform")(x)   # 25, 25, 25
        x = layers.LeakyReLU(0.2)(x)
        x = layers.BatchNormalization()(x)
    if split_energy:
        logits = layers.Conv3D(1, 3, padding="same", kernel_initializer="glorot_normal")(x)
        total = SampleTotal(name="total")([energy, total_energy()(energy), noise])
        shower = Deposit(name="shower")([logits, total])
    else:
        x = layers.Conv3D(1, 3, padding="same", use_bias=False,
                          kernel_initializer="glorot_normal")(x)
        shower = layers.ReLU(name="shower")(x)
    return keras.Model([noise, energy], shower, name="generator_small" if small else "generator")


def discriminator(small=False, log_cells=False):
    """The discriminator: shower -> [real/fake, energy, cell sum].

    With `log_cells=True` its convolutions see `LogCells` of the shower, so that
    sparse low-energy cells count; the cell sum stays linear.
    """
    shower = keras.Input((CELLS, CELLS, CELLS, 1), name="shower")
    seen = LogCells()(shower) if log_cells else shower
    if small:
        # Conv3D(strides=2, padding="same") on an odd size, computed as a stride-1
        # convolution and every other cell: the same function, but TensorFlow's
        # CPU gradient of a strided 3D convolution is ten times slower.
        x = layers.Conv3D(8, 5, padding="same")(seen)
        x = EveryOther()(x)                                                # 13
        x = layers.LeakyReLU(0.2)(x)
        x = layers.Conv3D(8, 3, padding="same")(x)
        x = EveryOther()(x)                                                # 7
        x = layers.LeakyReLU(0.2)(x)
        x = layers.BatchNormalization()(x)
        x = layers.Dropout(0.2)(x)
        x = layers.AveragePooling3D(2)(x)                                  # 3
    else:
        x = layers.Conv3D(32, 5, padding="same")(seen)
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
