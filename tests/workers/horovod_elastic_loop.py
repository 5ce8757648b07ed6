"""Horovod's elastic TF2 custom-loop pattern, with only the import changed: a
`tf.function` step with `DistributedGradientTape`, one step without the allreduce
before any state exists, `TensorFlowKerasState` with a batch counter, a commit after
every step, and a reset callback that rescales the learning rate.

The step is traced while the job has all its ranks; after one is lost it must keep
working with the survivors. Scikit-learn's 8x8 digits stand in for MNIST.

usage: horovod_elastic_loop.py [--lose-rank R] [--at-batch B] [--batches N]
"""

import argparse
import os
import signal

import numpy as np
import tensorflow as tf

import kdist as hvd  # was: import horovod.tensorflow as hvd
from common import digits_cnn, digits_dataset, flat_weights, report

parser = argparse.ArgumentParser()
parser.add_argument("--lose-rank", type=int, default=-1)
parser.add_argument("--at-batch", type=int, default=6)
parser.add_argument("--batches", type=int, default=24)
args = parser.parse_args()

hvd.init()
dataset, digits = digits_dataset(shuffle_seed=hvd.rank())

model = digits_cnn()
loss = tf.losses.SparseCategoricalCrossentropy()
lr = 0.001
opt = tf.optimizers.Adam(lr * hvd.size())


@tf.function
def training_step(images, labels, allreduce=True):
    with tf.GradientTape() as tape:
        loss_value = loss(labels, model(images, training=True))
    if allreduce:
        tape = hvd.DistributedGradientTape(tape)
    grads = tape.gradient(loss_value, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))
    return loss_value


for images, labels in dataset.take(1):
    training_step(images, labels, allreduce=False)


@tf.function
def sparse_average():
    # A sparse gradient's average divides by the number of ranks when it runs.
    rows = tf.IndexedSlices(tf.fill([1, 2], float(hvd.rank() + 1)), tf.constant([0]),
                           tf.constant([4, 2]))
    return tf.convert_to_tensor(hvd.allreduce(rows, op=hvd.Average))


sparse_average()  # traced while the job has all its ranks

sizes_at_reset = []


@hvd.elastic.run
def train(state):
    start = state.batch
    for index, (images, labels) in enumerate(dataset.skip(state.batch).take(
            args.batches - state.batch)):
        state.batch = start + index
        if hvd.rank() == args.lose_rank and state.batch == args.at_batch:
            os.kill(os.getpid(), signal.SIGKILL)
        training_step(images, labels)
        state.batch += 1
        state.commit()


def on_state_reset():
    sizes_at_reset.append(hvd.size())
    opt.learning_rate.assign(lr * hvd.size())


state = hvd.elastic.TensorFlowKerasState(model, opt, batch=0)
state.register_reset_callbacks([on_state_reset])
train(state)

images = digits.images[..., np.newaxis] / 16.0
accuracy = float(np.mean(np.argmax(model(images).numpy(), axis=1) == digits.target))
report({"weights": flat_weights(model), "size": hvd.size(), "batch": int(state.batch),
        "sizes_at_reset": sizes_at_reset, "accuracy": accuracy,
        "learning_rate": float(opt.learning_rate.numpy()),
        "sparse_average": sparse_average().numpy()[0].tolist()})
