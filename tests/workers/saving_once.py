"""Every rank saves to the same paths at once; rank 0 then loads every file.

argv: how the ranks train together ("strategy": MPIStrategy, "optimizer": a kdist
DistributedOptimizer), the directory, the number of rounds. Each rank counts the
files its model wrote itself (temporary files included), so the test can tell who
wrote. The first `fit` is interrupted at its third epoch; the second resumes from
the backup.
"""

import os
import sys

import keras
import numpy as np

import kdist
from workers.common import flat_weights, report

mode, directory, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
kdist.init()
written = []


class CountingModel(keras.Sequential):
    """Counts the files this rank's model writes."""

    def save(self, filepath, *args, **kwargs):
        written.append(os.fspath(filepath))
        return super().save(filepath, *args, **kwargs)

    def save_weights(self, filepath, *args, **kwargs):
        written.append(os.fspath(filepath))
        return super().save_weights(filepath, *args, **kwargs)


class Interrupt(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        if epoch == 2:
            raise RuntimeError("interrupted")


def build():
    keras.utils.set_random_seed(kdist.rank())  # different until the first broadcast
    model = CountingModel([keras.Input((16,)), keras.layers.Dense(32, activation="relu"),
                           keras.layers.Dense(1)])
    if mode == "strategy":
        with kdist.distribute.MPIStrategy().scope():
            model = CountingModel([keras.Input((16,)),
                                   keras.layers.Dense(32, activation="relu"),
                                   keras.layers.Dense(1)])
            model.compile(keras.optimizers.Adam(0.01), "mse")
    else:
        model.compile(kdist.DistributedOptimizer(keras.optimizers.Adam(0.01)), "mse")
    return model


model = build()
x = np.random.default_rng(1).normal(size=(64, 16)).astype("float32")
y = x[:, :1] * 2.0
batch = 16 * (kdist.size() if mode == "strategy" else 1)
callbacks = [
    keras.callbacks.ModelCheckpoint(os.path.join(directory, "plain-{epoch}.keras")),
    kdist.callbacks.ModelCheckpoint(os.path.join(directory, "kdist-{epoch}.weights.h5"),
                                    save_weights_only=True),
    kdist.callbacks.BackupAndRestore(os.path.join(directory, "backup"),
                                     delete_checkpoint=False),
]
if kdist.rank() == 0:  # Horovod's convention: a checkpoint on rank 0 alone
    callbacks.append(keras.callbacks.ModelCheckpoint(os.path.join(directory,
                                                                  "rank0-{epoch}.keras")))
# Every rank keeps its saving callbacks; the agreement says which rank writes each file.
try:
    model.fit(x, y, batch_size=batch, epochs=4, verbose=0, shuffle=False,
              callbacks=kdist.callbacks.Agreement().around(callbacks + [Interrupt()]))
except RuntimeError as error:
    assert "interrupted" in str(error), error
history = model.fit(x, y, batch_size=batch, epochs=4, verbose=0, shuffle=False,
                    callbacks=kdist.callbacks.Agreement().around(callbacks))
by_fit = len(written)
for i in range(rounds):
    kdist.callbacks.save_model(model, os.path.join(directory, f"round-{i}.keras"))
    kdist.callbacks.save_model(model, os.path.join(directory, "latest.keras"))
    kdist.callbacks.save_weights(model, os.path.join(directory, "latest.weights.h5"))
kdist.callbacks.save_model(model, os.path.join(directory, f"rank-{kdist.rank()}.keras"))
kdist.barrier()
loaded, unreadable = [], []
if kdist.rank() == 0:
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if os.path.isdir(path):
            continue
        try:
            if name.endswith(".weights.h5"):
                model.load_weights(path)
            else:
                keras.saving.load_model(path, custom_objects={"CountingModel": CountingModel})
            loaded.append(name)
        except Exception as error:  # the test names each file that does not load
            unreadable.append(f"{name}: {error!r}"[:300])
report({"by_fit": by_fit, "written": len(written), "epochs": history.epoch,
        "loaded": loaded, "unreadable": unreadable, "weights": flat_weights(model)[:50],
        "left": sorted(n for n in os.listdir(directory) if n.startswith(".kdist-"))})
