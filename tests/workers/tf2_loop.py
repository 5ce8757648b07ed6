"""A custom TF2 training loop written as Horovod's TF2 examples write it.

`tf.function` step, `DistributedGradientTape`, and the first-batch pattern:
every rank starts from its own random weights and, after the first step,
broadcasts rank 0's model and optimizer state from inside the function.
The data are scikit-learn's 8x8 digits (no download). Argument: `xla` to
compile the step with XLA, `plain` otherwise.
"""

import sys

import numpy as np
import tensorflow as tf

import kdist as hvd
from common import digits_cnn, report

jit = sys.argv[1] == "xla"
hvd.init()
tf.keras.utils.set_random_seed(100 + hvd.rank())  # different initial weights on each rank

from sklearn.datasets import load_digits  # noqa: E402

digits = load_digits()
images = (digits.images[..., np.newaxis] / 16.0).astype("float32")
labels = digits.target.astype("int64")
dataset = tf.data.Dataset.from_tensor_slices((images, labels))
dataset = dataset.shard(hvd.size(), hvd.rank()).repeat().shuffle(500, seed=hvd.rank()).batch(32)

model = digits_cnn()  # no Input: built in the first step
loss = tf.losses.SparseCategoricalCrossentropy()
opt = tf.optimizers.Adam(0.002 * hvd.size())


@tf.function(jit_compile=jit)
def training_step(x, y, first_batch):
    with tf.GradientTape() as tape:
        probs = model(x, training=True)
        loss_value = loss(y, probs)
    tape = hvd.DistributedGradientTape(tape)
    grads = tape.gradient(loss_value, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))
    if first_batch:
        hvd.broadcast_variables(model.variables, root_rank=0)
        hvd.broadcast_variables(opt.variables, root_rank=0)
    return loss_value


losses = []
for batch, (x, y) in enumerate(dataset.take(60)):
    losses.append(float(training_step(x, y, batch == 0)))

weights = np.concatenate([np.asarray(w).ravel() for w in model.get_weights()])
digest = hvd.allgather(weights[np.newaxis].astype("float64"))
report({"first_loss": float(np.mean(losses[:5])), "last_loss": float(np.mean(losses[-5:])),
        "max_rank_difference": float(np.abs(digest[0] - digest[1]).max()),
        "iterations": int(opt.iterations.numpy()),
        "rank_op": int(hvd.rank_op()), "size_op": int(hvd.size_op())})
