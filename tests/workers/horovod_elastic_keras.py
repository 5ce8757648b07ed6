"""Horovod's elastic TF2-Keras MNIST example, its import changed and its data small.

What matters is the example's order of things: every rank builds its model (no
Input, each with its own initial weights), trains one step with the distributed
optimizer before any state exists, then creates the elastic state, whose sync at
the start of `run` gives every rank rank 0's weights. Scikit-learn's 8x8 digits
stand in for MNIST (no download); the model is smaller to fit a CPU test.

usage: horovod_elastic_keras.py [--steps N] [--epochs E]
"""

import argparse

import numpy as np
import tensorflow as tf

import kdist as hvd  # was: import horovod.tensorflow.keras as hvd
from common import digits_cnn, digits_dataset, flat_weights, report

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=24)
parser.add_argument("--epochs", type=int, default=3)
args = parser.parse_args()

hvd.init()

dataset, digits = digits_dataset(shuffle_seed=hvd.rank())

# No seed: each rank starts from weights of its own, as in the example.
model = digits_cnn(dropout=0.25)

scaled_lr = 0.001 * hvd.size()
opt = hvd.DistributedOptimizer(tf.optimizers.Adam(scaled_lr), backward_passes_per_step=1,
                               average_aggregated_gradients=True)
model.compile(loss=tf.losses.SparseCategoricalCrossentropy(), optimizer=opt,
              metrics=["accuracy"])

# One step before the state exists: the model and the optimizer get built.
model.fit(dataset, steps_per_epoch=1, epochs=1, callbacks=None, verbose=0)

state = hvd.elastic.KerasState(model, batch=0, epoch=0)


def on_state_reset():
    tf.keras.backend.set_value(state.model.optimizer.lr, 0.001 * hvd.size())
    state.model.fit(dataset, steps_per_epoch=1, epochs=1, callbacks=None, verbose=0)


state.register_reset_callbacks([on_state_reset])

callbacks = [
    hvd.elastic.UpdateEpochStateCallback(state),
    hvd.elastic.UpdateBatchStateCallback(state),
    hvd.elastic.CommitStateCallback(state),
]


@hvd.elastic.run
def train(state):
    return state.model.fit(dataset, steps_per_epoch=args.steps // hvd.size(),
                           epochs=args.epochs - state.epoch, callbacks=callbacks, verbose=0)


history = train(state)
images = digits.images[..., np.newaxis] / 16.0
accuracy = float(np.mean(np.argmax(model.predict(images, verbose=0), axis=1) == digits.target))
report({"weights": flat_weights(model), "accuracy": accuracy, "epoch": state.epoch,
        "epochs_run": len(history.history["loss"])})
