"""Trains a few steps and makes one Python allreduce while a timeline records.

Usage: timeline.py {env,api} PATH

`env`: KDIST_TIMELINE names PATH and the file is written when the process
ends. `api`: kdist.start_timeline(PATH, mark_cycles=True) and stop_timeline().
Rank 1 reaches the Python allreduce half a second after rank 0.
"""

import sys
import time

import numpy as np

from common import report, small_model

mode, path = sys.argv[1], sys.argv[2]

import keras  # noqa: E402

import kdist  # noqa: E402

kdist.init()
if mode == "api":
    kdist.start_timeline(path, mark_cycles=True)
rng = np.random.default_rng(kdist.rank())
x, y = rng.normal(size=(24, 12)).astype("float32"), rng.integers(0, 4, size=24)
model = small_model()
model.compile(optimizer=kdist.DistributedOptimizer(keras.optimizers.SGD(0.1)),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
model.fit(x, y, batch_size=8, epochs=1, verbose=0,
          callbacks=[kdist.callbacks.BroadcastGlobalVariablesCallback(0)])
# The ranks line up first (fit's end takes each its own time, more so on a busy machine);
# then rank 1 comes to the probe a second late, which rank 0 spends negotiating.
kdist.allreduce(np.zeros(1), name="line up")
if kdist.rank() == 1:
    time.sleep(1.0)
kdist.allreduce(np.ones(5), name="probe")
written = kdist.stop_timeline() if mode == "api" else None
report({"written": written, "parameters": int(sum(np.prod(w.shape) for w in model.weights))})
