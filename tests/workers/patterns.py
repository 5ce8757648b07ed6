"""Step patterns whose collectives differ from one allreduce per step, with uneven data.

Rank r holds `BATCHES[r]` batches of 16 rows. Under mpiexec each rank trains on
its own batches (kdist joins the rank that runs out and copies the last rank's
state at each epoch's end); `--reference` replays the same steps on one
process, each step on the rows of the ranks that still had a batch. Both must
end with the same weights.
"""

import argparse
import gc
import weakref

import keras
import numpy as np
import tensorflow as tf

import kdist
import kdist.gan
from common import flat_weights, report

parser = argparse.ArgumentParser()
parser.add_argument("--reference", action="store_true", help="one process replays the steps")
args = parser.parse_args()

BATCH, RANKS = 16, 2
BATCHES = [4, 6]  # rank 0 runs out first
rank = 0 if args.reference else kdist.rank()
rng = np.random.default_rng(5)
ROWS = [rng.normal(size=(n * BATCH, 3)).astype("float32") for n in BATCHES]
LABELS = [(r[:, :1] - r[:, 1:2] > 0).astype("float32") for r in ROWS]
LATENT = [rng.normal(size=(len(r), 3, 2)).astype("float32") for r in ROWS]


def steps():
    """Per global step, the (start, stop) rows of every rank that still has a batch."""
    for step in range(max(BATCHES)):
        yield [(r, step * BATCH, (step + 1) * BATCH) for r in range(RANKS) if step < BATCHES[r]]


def replay(train_one, arrays):
    """`train_one` on each global step's concatenated rows (the reference)."""
    for members in steps():
        train_one(*[np.concatenate([a[r][start:stop] for r, start, stop in members])
                    for a in arrays])


def optimizer(lr=0.1):
    opt = keras.optimizers.SGD(lr)
    return opt if args.reference else kdist.DistributedOptimizer(opt)


def callbacks():
    if args.reference:
        return []
    return [kdist.callbacks.BroadcastGlobalVariablesCallback(0),
            kdist.callbacks.MetricAverageCallback()]


def classifier(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="tanh"),
                             keras.layers.Dense(1)])


out = {}

# A GAN with more generator than discriminator steps: three reductions per batch.
keras.utils.set_random_seed(1)
generator = keras.Sequential([keras.Input((2,)), keras.layers.Dense(8, "tanh"),
                              keras.layers.Dense(3)])
discriminator = keras.Sequential([keras.Input((3,)), keras.layers.Dense(8, "tanh"),
                                  keras.layers.Dense(1, "sigmoid")])
gan = kdist.gan.GAN(generator, discriminator, d_steps=1, g_steps=2)
gan.compile(d_optimizer=optimizer(0.05), g_optimizer=optimizer(0.05))
for _ in range(2):  # epochs
    if args.reference:
        replay(lambda real, latent: gan.train_on_batch({"real": real, "latent": latent}),
               [ROWS, LATENT])
    else:
        gan.fit({"real": ROWS[rank], "latent": LATENT[rank]}, batch_size=BATCH, shuffle=False,
                verbose=0, callbacks=callbacks())
out["gan"] = flat_weights(gan)
out["gan_updates"] = [int(gan.d_optimizer.iterations), int(gan.g_optimizer.iterations)]

# Several fits in a row, with evaluate and predict between them.
model = classifier(2)
model.compile(optimizer=optimizer(), loss=keras.losses.BinaryCrossentropy(from_logits=True))
for _ in range(2):
    if args.reference:
        replay(model.train_on_batch, [ROWS, LABELS])
    else:
        model.fit(ROWS[rank], LABELS[rank], batch_size=BATCH, shuffle=False, verbose=0,
                  callbacks=callbacks())
    model.evaluate(ROWS[rank], LABELS[rank], verbose=0)
    model.predict(ROWS[rank][:5], verbose=0)
out["fits_in_a_row"] = flat_weights(model)

# K-fold: a new model and a new distributed optimizer for every fold.
folds, fold_optimizers = [], []
for fold in range(3):
    model = classifier(10 + fold)
    model.compile(optimizer=optimizer(), loss=keras.losses.BinaryCrossentropy(from_logits=True))
    fold_optimizers.append(weakref.ref(model.optimizer))
    if args.reference:
        replay(model.train_on_batch, [ROWS, LABELS])
    else:
        model.fit(ROWS[rank], LABELS[rank], batch_size=BATCH, shuffle=False, verbose=0,
                  callbacks=callbacks())
    folds.append(flat_weights(model))
out["folds"] = folds
del model
gc.collect()
out["fold_optimizers_alive"] = sum(ref() is not None for ref in fold_optimizers)

# Two models in one custom loop: A updates every step, B every other step.
a, b = classifier(20), classifier(21)
opt_a, opt_b = optimizer(), optimizer()
loss = keras.losses.BinaryCrossentropy(from_logits=True)


@tf.function
def train_step(x, y, model, opt):
    with tf.GradientTape() as tape:
        value = loss(y, model(x, training=True))
    opt.apply(tape.gradient(value, model.trainable_variables), model.trainable_variables)


def two_models(x, y, step):
    train_step(x, y, a, opt_a)
    if step % 2 == 0:
        train_step(x, y, b, opt_b)


if args.reference:
    for step, members in enumerate(steps()):
        two_models(*[np.concatenate([arr[r][start:stop] for r, start, stop in members])
                     for arr in (ROWS, LABELS)], step)
else:
    for step in range(BATCHES[rank]):
        rows = slice(step * BATCH, (step + 1) * BATCH)
        two_models(ROWS[rank][rows], LABELS[rank][rows], step)
    last = kdist.join()
    kdist.broadcast_variables(a.variables + b.variables, root_rank=last)
out["two_models"] = flat_weights(a) + flat_weights(b)
report(out)
