"""Where a data-parallel step's extra time goes, phase by phase, from kdist's timeline.

    kdist run -n 2 --no-prefix benchmarks/step_overhead.py [--steps 300] [--optimizer sgd]

Trains the 784-512-512-10 MLP (batch 64 per rank, one thread per rank) with
`DistributedOptimizer` while a timeline records, then a raw mpi4py allreduce of
the same gradient bytes as the floor. Rank 0 prints one JSON object: the median
step time, the median time per step of each phase of the fused gradient
reduction (`negotiate`: every rank announcing it, mostly waiting for the other
rank; `pack`, `allreduce`, `unpack`, `scale`), their sum, and the raw allreduce,
each with its ratio to the raw allreduce.
"""

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _mlp import build_mlp, one_thread, synthetic_mnist_like  # noqa: E402

WARMUP = 50


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd")
    args = parser.parse_args()
    if args.steps <= WARMUP:
        parser.error(f"--steps must be more than the {WARMUP} warm-up steps")
    one_thread()
    import keras
    from mpi4py import MPI

    import kdist

    kdist.init()
    if kdist.size() < 2:
        parser.error("run it on 2 or more ranks: kdist run -n 2 benchmarks/step_overhead.py")
    directory = kdist.broadcast_object(tempfile.mkdtemp() if kdist.rank() == 0 else None)
    path = os.path.join(directory, "timeline.json")
    model = build_mlp()
    inner = keras.optimizers.SGD(0.01) if args.optimizer == "sgd" else keras.optimizers.Adam()
    model.compile(optimizer=kdist.DistributedOptimizer(inner),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = synthetic_mnist_like(64 * args.steps, seed=kdist.rank())
    marks = []

    class Clock(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            marks.append(time.perf_counter())

    kdist.start_timeline(path)
    model.fit(x, y, batch_size=64, epochs=1, verbose=0, shuffle=False, callbacks=[Clock()])
    kdist.stop_timeline()
    step_ms = float(np.median(np.diff(marks)[WARMUP:])) * 1e3

    nbytes = 4 * sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    flat = np.ones(nbytes // 4, np.float32)
    raw = []
    for i in range(WARMUP + 200):
        MPI.COMM_WORLD.Barrier()
        start = time.perf_counter()
        MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, flat)
        if i >= WARMUP:
            raw.append(time.perf_counter() - start)
    raw_ms = float(np.median(raw)) * 1e3
    kdist.barrier()  # rank 0 has merged the timeline once every rank is here
    if kdist.rank() != 0:
        return
    with open(path) as stream:
        events = json.load(stream)["traceEvents"]
    phases = {}
    for event in events:
        # Rank 0's in-graph track: the fused gradient reductions of the train steps.
        if event.get("ph") == "X" and event["pid"] == 0 and event["tid"] == 1:
            phases.setdefault(event["name"], []).append(event)
    steps = len(phases.get("pack", []))
    per_step = {}
    for name, spans in phases.items():
        # One value per step: a phase may run several times in a step (one
        # negotiation per collective, one allreduce per large tensor).
        totals = np.zeros(steps)
        starts = np.array([s["ts"] for s in phases["pack"]])
        for span in spans:
            index = max(0, int(np.searchsorted(starts, span["ts"], side="right")) - 1)
            totals[index] += span["dur"] / 1e3
        per_step[name] = round(float(np.median(totals[WARMUP:])), 4)
    collective = round(sum(per_step.values()), 4)
    print(json.dumps({
        "benchmark": "step_overhead",
        "optimizer": args.optimizer,
        "ranks": kdist.size(),
        "gradient_megabytes": round(nbytes / 1e6, 3),
        "step_ms": round(step_ms, 4),
        "phase_ms_per_step": per_step,
        "collective_ms_per_step": collective,
        "raw_allreduce_ms": round(raw_ms, 4),
        "ratio_to_raw": {**{k: round(v / raw_ms, 3) for k, v in per_step.items()},
                         "collective": round(collective / raw_ms, 3)},
        "timeline": path,
    }, indent=1))


if __name__ == "__main__":
    main()
