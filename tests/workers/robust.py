"""Training jobs that go wrong on purpose: a rank fails, dies, differs or has less data.

Rank r trains on half r of every global batch of 32 rows. `reference` runs
without MPI and trains one process the way two ranks with uneven data must:
on the whole global batch while both ranks have data, then on rank 1's half
alone; it reports the weights after each global step and each epoch's loss
as the two ranks' averaged metric must read.
"""

import argparse
import os
import signal

import keras
import numpy as np
import tensorflow as tf

import kdist
from common import flat_weights, global_batches, report, small_model

parser = argparse.ArgumentParser()
parser.add_argument("case", choices=["raise", "kill", "mismatch", "uneven", "overflow",
                                     "mixed_uneven", "reference"])
parser.add_argument("--agreement", action="store_true",
                    help="pass the callbacks through kdist.callbacks.Agreement().around")
args = parser.parse_args()

STEPS, EPOCHS, LOCAL = 8, 2, 16
SHORT = 5  # rank 0's batches per epoch when data are uneven


def data(case):
    """The global batches; in the overflow cases rank 1's half of batch 3 exceeds float16."""
    x, y = global_batches(STEPS, 2 * LOCAL)
    if case in ("overflow", "mixed_uneven"):
        x[3, LOCAL:] = 1e5  # beyond float16 range (65504)
    return x, y


def reference(case):
    """One process doing what two ranks with uneven data must do together."""
    keras.mixed_precision.set_global_policy(
        "mixed_float16" if case == "mixed_uneven" else "float32")
    x, y = data(case)
    model = small_model(seed=0)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss=loss)
    after, losses = [], []
    for _ in range(EPOCHS):
        per_rank = [[], []]
        for step in range(STEPS):
            for r in (0, 1):
                if r == 1 or step < SHORT:
                    rows = slice(r * LOCAL, (r + 1) * LOCAL)
                    per_rank[r].append(float(loss(y[step, rows], model(x[step, rows]))))
            rows = slice(0, 2 * LOCAL) if step < SHORT else slice(LOCAL, 2 * LOCAL)
            model.train_on_batch(x[step, rows], y[step, rows])
            after.append(flat_weights(model))
        losses.append(float(np.mean([np.mean(p) for p in per_rank])))
    return {"after_step": after, "loss": losses}


if args.case == "reference":
    from common import write_report

    write_report(0, {case: reference(case) for case in ("uneven", "mixed_uneven")})
    raise SystemExit(0)

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
x, y = data(args.case)
x = x[:, rank * LOCAL:(rank + 1) * LOCAL].reshape(-1, 12)
y = y[:, rank * LOCAL:(rank + 1) * LOCAL].reshape(-1)
batches = STEPS
if args.case in ("uneven", "mixed_uneven") and rank == 0:
    batches = SHORT
dataset = tf.data.Dataset.from_tensor_slices((x[:batches * LOCAL], y[:batches * LOCAL]))
dataset = dataset.batch(LOCAL)


class BeforeEpochEnd(keras.callbacks.Callback):
    """This rank's weights at each epoch's end, as the first callback of the list sees them:
    before the callbacks below sync them without kdist's agreement, after the agreement
    (which runs before every callback of the list) synced them with it (--agreement)."""

    def __init__(self):
        super().__init__()
        self.weights = []

    def on_epoch_end(self, epoch, logs=None):
        self.weights.append(flat_weights(self.model))


opt = kdist.DistributedOptimizer(keras.optimizers.SGD(0.05))
model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              metrics=["accuracy"])
before_epoch_end = BeforeEpochEnd()
callbacks = [before_epoch_end, kdist.callbacks.BroadcastGlobalVariablesCallback(0),
             kdist.callbacks.MetricAverageCallback()]
if args.case in ("raise", "kill"):
    callbacks.append(FailOnRankOne())
if args.agreement:
    callbacks = kdist.callbacks.Agreement().around(callbacks)
history = model.fit(dataset, epochs=EPOCHS, verbose=0, shuffle=False, callbacks=callbacks)
out = {"weights": flat_weights(model), "loss": history.history["loss"],
       "before_epoch_end": before_epoch_end.weights}
if args.case in ("overflow", "mixed_uneven"):
    out["scale"] = float(opt.dynamic_scale.numpy())
    out["initial_scale"] = float(opt.initial_scale)
    out["iterations"] = int(opt.iterations.numpy())
    out["optimizer"] = type(opt).__name__
report(out)
