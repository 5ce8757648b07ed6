"""Parameter-server training on a learnable task; each rank reports what it ends with.

Usage: ps_train.py MODE [--epochs E] [--submasters S] [--servers K] [--checkpoint DIR]
       [--stop-after E] [--die-on RANK] [--raise-on RANK] [--baseline]
       [--staleness-aware] [--record DIR] [--epoch-weights DIR]

With --record, every rank records its exchanges for `ps_reference` to replay;
with --epoch-weights, the master saves the central weights its callbacks see
at each epoch's end.
"""

import argparse
import os
import sys

import numpy as np

from common import flat_weights, report, write_report

parser = argparse.ArgumentParser()
parser.add_argument("mode")
parser.add_argument("--epochs", type=int, default=6)
parser.add_argument("--sync-every", type=int, default=1)
parser.add_argument("--submasters", type=int, default=0)
parser.add_argument("--servers", type=int, default=1)
parser.add_argument("--checkpoint")
parser.add_argument("--stop-after", type=int, help="end the job after this epoch (a crash)")
parser.add_argument("--early-stopping", action="store_true")
parser.add_argument("--logs", help="a directory for the master's CSVLogger and TensorBoard")
parser.add_argument("--die-on", type=int)
parser.add_argument("--raise-on", type=int)
parser.add_argument("--fault-tolerant", action="store_true")
parser.add_argument("--baseline", action="store_true")
parser.add_argument("--lr", type=float, default=0.05)
parser.add_argument("--elastic-force", type=float, default=0.5)
parser.add_argument("--jit", action="store_true", help="compile the steps with XLA")
parser.add_argument("--staleness-aware", action="store_true")
parser.add_argument("--record")
parser.add_argument("--messages", action="store_true", help="no shared-memory exchanges")
parser.add_argument("--epoch-weights")
args = parser.parse_args()

import keras  # noqa: E402

import kdist  # noqa: E402


def task(seed=3, rows=3072, inputs=10, classes=3):
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(inputs, classes))
    x = rng.normal(size=(rows + 1024, inputs)).astype("float32")
    y = np.argmax(x @ w + 0.3 * rng.normal(size=(len(x), classes)), axis=-1).astype("int64")
    return (x[:rows], y[:rows]), (x[rows:], y[rows:])


def build():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((10,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(3)])
    return model


def compile_(model):
    model.compile(optimizer=keras.optimizers.SGD(args.lr), jit_compile=args.jit,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])


(x, y), (xv, yv) = task()

if args.baseline:
    model = build()
    compile_(model)
    model.fit(x, y, batch_size=32, epochs=args.epochs, shuffle=False, verbose=0)
    write_report(0, {"val_accuracy": model.evaluate(xv, yv, verbose=0, return_dict=True)[
        "accuracy"]})
    sys.exit(0)

strategy = kdist.ps.ParameterServerStrategy(
    mode=args.mode, sync_every=args.sync_every, submasters=args.submasters, servers=args.servers,
    checkpoint_dir=args.checkpoint, elastic_force=args.elastic_force,
    fault_tolerant=args.fault_tolerant, staleness_aware=args.staleness_aware,
    shared_memory=not args.messages)


class Trouble(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch == 5 and kdist.rank() == args.die_on:
            os._exit(3)
        if batch == 5 and kdist.rank() == args.raise_on:
            raise RuntimeError("worker failed on purpose")


class Crash(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        if args.epoch_weights:
            np.save(os.path.join(args.epoch_weights, f"epoch-{epoch}.npy"),
                    np.array(flat_weights(self.model)))
        if epoch + 1 == args.stop_after:
            kdist.comm.abort(f"stopping after epoch {epoch + 1} on purpose")


with strategy.scope():
    model = build()
    compile_(model)

worker_callbacks = [Trouble()]
if args.record:
    import ps_record

    ps_record.install(args.record)
    if strategy.is_worker:
        ps_record.watch(model)
        worker_callbacks.append(ps_record.StepStarts())

callbacks = [Crash()]
if args.logs:
    callbacks += [keras.callbacks.CSVLogger(os.path.join(args.logs, "log.csv")),
                  keras.callbacks.TensorBoard(os.path.join(args.logs, "tensorboard"))]
if args.early_stopping:
    callbacks.append(keras.callbacks.EarlyStopping(monitor="val_loss", patience=0,
                                                   min_delta=10.0))
history = model.fit(x, y, batch_size=32, epochs=args.epochs, shuffle=False,
                    validation_data=(xv, yv), callbacks=callbacks,
                    worker_callbacks=worker_callbacks)
accuracy = model.evaluate(xv, yv, verbose=0, return_dict=True)["accuracy"]
report({"rank": kdist.rank(), "val_accuracy": accuracy, "weights": flat_weights(model),
        "jit": bool(model.jit_compile),
        "history": history.history if strategy.is_master else None,
        "epochs": list(getattr(history, "epoch", [])),
        "stats": strategy.stats if not strategy.is_worker else None})
