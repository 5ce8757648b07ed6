"""Memory and kdist's per-model state over many `fit` calls in one process.

    kdist run -n 2 --no-prefix benchmarks/lifetime.py [--calls 1000]

The same small model is fitted `--calls` times (1 and 2 batches on the two
ranks, so every call ends with a join), with the broadcast and metric
callbacks. Prints the resident memory after a fifth of the calls and at the
end, the growth between them per call, and how many reducers and bucket plans
the optimizer holds (both must stay at 1). Rank 0 prints one JSON object.
"""

import argparse
import gc
import json
import time

import numpy as np


def resident_megabytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=1000)
    args = parser.parse_args()
    import keras

    import kdist

    kdist.init()
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((12,)), keras.layers.Dense(32, activation="tanh"),
                              keras.layers.Dense(4)])
    model.compile(optimizer=kdist.DistributedOptimizer(keras.optimizers.SGD(0.01)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = np.random.default_rng(kdist.rank()).normal(size=(16 * (1 + kdist.rank() % 2), 12))
    y = np.zeros(len(x), "int64")
    callbacks = [kdist.callbacks.BroadcastGlobalVariablesCallback(0),
                 kdist.callbacks.MetricAverageCallback()]
    early, memory, started = args.calls // 5, {}, time.monotonic()
    for call in range(1, args.calls + 1):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=callbacks)
        if call in (early, args.calls):
            gc.collect()
            memory[call] = resident_megabytes()
    reducers = model.optimizer._reducers
    if kdist.rank() == 0:
        print(json.dumps({
            "benchmark": "lifetime", "ranks": kdist.size(), "fit_calls": args.calls,
            "resident_mb": {str(k): round(v, 1) for k, v in memory.items()},
            "growth_kb_per_call": round((memory[args.calls] - memory[early]) * 1024
                                        / (args.calls - early), 2),
            "seconds_per_call": round((time.monotonic() - started) / args.calls, 3),
            "reducers": len(reducers), "bucket_plans": sum(len(r.plans) for r in reducers.values()),
        }, indent=2))


if __name__ == "__main__":
    main()
