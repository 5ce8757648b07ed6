"""Deterministic training with checkpoints; optionally crashes after an epoch."""

import argparse

import keras
import tensorflow as tf

import kdist
from common import flat_weights, global_batches, report, small_model

parser = argparse.ArgumentParser()
parser.add_argument("--checkpoints", required=True)
parser.add_argument("--epochs", type=int, default=4)
parser.add_argument("--crash-after-epoch", type=int, default=-1)
parser.add_argument("--lazy", action="store_true", help="a model without Input")
args = parser.parse_args()

tf.config.experimental.enable_op_determinism()
kdist.init()
model = small_model(seed=3, lazy=args.lazy)
x, y = global_batches(6, 16)
share = slice(kdist.rank(), None, kdist.size())
x, y = x[:, share].reshape(-1, 12), y[:, share].reshape(-1)
data = tf.data.Dataset.from_tensor_slices((x, y)).batch(16 // kdist.size())


class Crash(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        if epoch == args.crash_after_epoch:
            raise RuntimeError(f"simulated crash after epoch {epoch}")


checkpoint = kdist.callbacks.Checkpoint(args.checkpoints)
model.compile(optimizer=kdist.DistributedOptimizer(keras.optimizers.Adam(1e-2)),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
history = model.fit(data, epochs=args.epochs, verbose=0, shuffle=False,
                    callbacks=[kdist.callbacks.BroadcastGlobalVariablesCallback(0), checkpoint,
                               Crash()])
report({"weights": flat_weights(model), "resumed_from": checkpoint.resumed_from,
        "epochs_run": len(history.history["loss"]),
        "iterations": int(model.optimizer.iterations.numpy())})
