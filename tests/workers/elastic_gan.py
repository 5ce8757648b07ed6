"""Elastic training of a kdist.gan.GAN on 3 ranks; rank 1 is killed after its sixth batch."""

import os
import signal

import keras
import numpy as np

import kdist
import kdist.gan
from workers.common import flat_weights, report

kdist.init()
keras.utils.set_random_seed(kdist.rank())
generator = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(2)])
discriminator = keras.Sequential([keras.Input((2,)), keras.layers.Dense(8, activation="relu"),
                                  keras.layers.Dense(1, "sigmoid")])
gan = kdist.gan.GAN(generator, discriminator, seed=kdist.rank())
gan.compile(d_optimizer=kdist.DistributedOptimizer(keras.optimizers.Adam(1e-3)),
            g_optimizer=kdist.DistributedOptimizer(keras.optimizers.Adam(1e-3)))
state = kdist.elastic.KerasState(gan, epoch=0, batch=0)
resets = []
state.register_reset_callbacks([lambda: resets.append(kdist.size())])
data = np.random.default_rng(0).normal(size=(600, 2)).astype("float32")


class KillRankOne(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if kdist.rank() == 1 and not resets and batch == 5:
            os.kill(os.getpid(), signal.SIGKILL)


callbacks = [kdist.elastic.CommitStateCallback(state, batches_per_commit=2),
             kdist.elastic.UpdateBatchStateCallback(state),
             kdist.elastic.UpdateEpochStateCallback(state), KillRankOne()]


@kdist.elastic.run
def train(state):
    rows = len(data) // kdist.size()
    gan.fit(data[kdist.rank() * rows:(kdist.rank() + 1) * rows], batch_size=16,
            epochs=2 - state.epoch, callbacks=callbacks, verbose=0)


train(state)
report({"size": kdist.size(), "resets": resets, "d": int(gan.d_optimizer.iterations.numpy()),
        "g": int(gan.g_optimizer.iterations.numpy()), "w": float(np.sum(flat_weights(gan)))})
