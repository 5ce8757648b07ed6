"""Trains the small model for a fixed number of steps and reports the weights.

Single process (`--ranks 1`) sees the whole global batch each step; under
mpiexec each rank sees its slice of it, so the two must agree.
"""

import argparse

import keras
import tensorflow as tf

import kdist
from common import flat_weights, global_batches, report, small_model

parser = argparse.ArgumentParser()
parser.add_argument("--optimizer", default="sgd")
parser.add_argument("--lr", type=float, default=0.05)
parser.add_argument("--global-batch", type=int, default=16)
parser.add_argument("--steps", type=int, default=20, help="optimizer updates")
parser.add_argument("--compression", default="none")
parser.add_argument("--accumulate", type=int, default=1)
parser.add_argument("--seed-per-rank", action="store_true")
parser.add_argument("--jit", action="store_true", help="compile the train step with XLA")
parser.add_argument("--lazy", action="store_true", help="a model without Input")
parser.add_argument("--no-broadcast", action="store_true", help="leave out the broadcast callback")
args = parser.parse_args()

kdist.init()
model = small_model(seed=100 + (kdist.rank() if args.seed_per_rank else 0), lazy=args.lazy)
# Each update's global batch is cut into `accumulate` passes x `size` ranks.
x, y = global_batches(args.steps, args.global_batch)
local_batch = args.global_batch // (kdist.size() * args.accumulate)
x = x.reshape(args.steps, args.accumulate, kdist.size(), local_batch, -1)[:, :, kdist.rank()]
y = y.reshape(args.steps, args.accumulate, kdist.size(), local_batch)[:, :, kdist.rank()]
x, y = x.reshape(-1, x.shape[-1]), y.reshape(-1)
data = tf.data.Dataset.from_tensor_slices((x, y)).batch(local_batch)

inner = {"sgd": keras.optimizers.SGD, "adam": keras.optimizers.Adam}[args.optimizer](args.lr)
compression = {"none": kdist.Compression.none, "fp16": kdist.Compression.fp16,
               "topk": kdist.Compression.topk(0.3)}[args.compression]
opt = kdist.DistributedOptimizer(inner, compression=compression,
                                 backward_passes_per_step=args.accumulate,
                                 average_aggregated_gradients=True)
model.compile(optimizer=opt, jit_compile=args.jit,
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
# A lazy model has no weights before its first step (and evaluating would build it).
built = None if args.lazy else flat_weights(model)


class FirstStep(keras.callbacks.Callback):
    """The weights the first step starts from (after the broadcast)."""

    def on_train_batch_begin(self, batch, logs=None):
        if batch == 0:
            self.weights = flat_weights(self.model) if self.model.variables else None


first_step = FirstStep()
before = None if args.lazy else float(model.evaluate(x, y, verbose=0, batch_size=len(x)))
history = model.fit(data, epochs=1, verbose=0, shuffle=False,
                    callbacks=([] if args.no_broadcast else [
                        kdist.callbacks.BroadcastGlobalVariablesCallback(0)]) + [first_step])
after = float(model.evaluate(x, y, verbose=0, batch_size=len(x)))
report({"weights": flat_weights(model), "loss_before": before, "loss_after": after,
        "built": built, "first_step": first_step.weights,
        "iterations": int(opt.iterations.numpy()), "jit": bool(model.jit_compile),
        "native": kdist.size() > 1 and kdist.comm.native.load() is not None})
