"""Many fit calls in one process: memory and kdist's per-model state stay flat."""

import gc
import sys
import time

import keras
import numpy as np

import kdist
from common import report, small_model

CALLS = int(sys.argv[1])
kdist.init()


def resident_megabytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


model = small_model(seed=1)
model.compile(optimizer=kdist.DistributedOptimizer(keras.optimizers.SGD(0.01)),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
x = np.random.default_rng(kdist.rank()).normal(size=(16 * (1 + kdist.rank()), 12))
y = np.zeros(len(x), "int64")
callbacks = [kdist.callbacks.BroadcastGlobalVariablesCallback(0),
             kdist.callbacks.MetricAverageCallback()]
memory, started = {}, time.monotonic()
for call in range(1, CALLS + 1):
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=callbacks)
    if call in (CALLS // 5, CALLS):
        gc.collect()
        memory[call] = resident_megabytes()
reducers = model.optimizer._reducers
report({"memory": memory, "seconds": time.monotonic() - started,
        "reducers": len(reducers), "plans": sum(len(r.plans) for r in reducers.values()),
        "iterations": int(model.optimizer.iterations)})
