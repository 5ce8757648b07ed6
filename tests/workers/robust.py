"""Training jobs that go wrong on purpose: a rank fails, dies, differs or has less data."""

import argparse
import os
import signal

import keras
import tensorflow as tf

import kdist
from common import flat_weights, global_batches, report, small_model

parser = argparse.ArgumentParser()
parser.add_argument("case", choices=["raise", "kill", "mismatch", "uneven", "overflow",
                                     "mixed_uneven"])
args = parser.parse_args()

if args.case in ("overflow", "mixed_uneven"):
    kdist.precision.enable("mixed_float16")
kdist.init()
rank = kdist.rank()


class FailOnRankOne(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        if rank == 1 and batch == 3:
            if args.case == "raise":
                raise RuntimeError("injected failure on purpose")
            os.kill(os.getpid(), signal.SIGKILL)


model = small_model(seed=rank)
if args.case == "mismatch" and rank == 1:
    model = keras.Sequential([keras.Input((12,)), keras.layers.Dense(33),
                              keras.layers.Dense(16), keras.layers.Dense(4)])
x, y = global_batches(8, 16)
x, y = x.reshape(-1, 12), y.reshape(-1)
batches = 8
if args.case in ("uneven", "mixed_uneven"):
    batches = 5 if rank == 0 else 8
if args.case in ("overflow", "mixed_uneven") and rank == 1:
    x[3 * 16:4 * 16] = 1e5  # beyond float16 range (65504): batch 3 overflows on this rank only
data = tf.data.Dataset.from_tensor_slices((x[:batches * 16], y[:batches * 16])).batch(16)

opt = kdist.DistributedOptimizer(keras.optimizers.SGD(0.05))
model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              metrics=["accuracy"])
callbacks = [kdist.callbacks.BroadcastGlobalVariablesCallback(0),
             kdist.callbacks.MetricAverageCallback()]
if args.case in ("raise", "kill"):
    callbacks.append(FailOnRankOne())
history = model.fit(data, epochs=2, verbose=0, shuffle=False, callbacks=callbacks)
out = {"weights": flat_weights(model), "loss": history.history["loss"]}
if args.case in ("overflow", "mixed_uneven"):
    out["scale"] = float(opt.dynamic_scale.numpy())
    out["initial_scale"] = float(opt.initial_scale)
    out["iterations"] = int(opt.iterations.numpy())
    out["optimizer"] = type(opt).__name__
report(out)
