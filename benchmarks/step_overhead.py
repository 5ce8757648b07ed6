"""A data-parallel step's overhead against the allreduce it wraps, measured side by side.

    kdist run -n 2 --no-prefix benchmarks/step_overhead.py [--optimizers sgd,adam]
        [--widths 512,2816] [--rounds 5] [--steps 60] [--timeline]

For each optimizer and MLP width (784-W-W-10: 670k parameters at 512, 10.2M at
2816; batch 64 per rank, one thread per rank) every rank runs `--rounds`
rounds of `--steps` triples, each part started together on all ranks (a
barrier before it):

- `plain`: one train step with the plain Keras optimizer, no communication
  (the compute floor; what sharing the machine costs is already in it);
- `kdist`: one train step with `kdist.DistributedOptimizer`;
- `raw`: one raw mpi4py `Allreduce` of the same gradient bytes.

A triple takes a few milliseconds, so whatever the machine does meanwhile
(another tenant, the host moving the virtual cores; see docs/lab/core_placement.md)
touches all three alike. Per round, overhead = median over the triples of
(kdist step - plain step), and its ratio to the median raw allreduce; the
medians over rounds are the figures. `slowest_rank_wait_ms` is the part of
the overhead no library removes: how much later than this rank the slowest
rank finishes its plain step, on average (a synchronous step waits for it).

With `--timeline` the kdist steps are recorded, and each phase of the fused
gradient reduction (`negotiate`: announcing it and waiting for the other
ranks; `pack`, `allreduce`, `unpack`, `scale`) is reported in ms per step;
recording costs a little, so the step times of such a run are not the
figures.

Rank 0 prints one JSON object per configuration.
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

SETTLE = 3  # steps at the start of each block that are not timed
TARGET = 1.2  # overhead / raw allreduce


def _words(text, allowed, name):
    words = [w for w in text.split(",") if w]
    unknown = [w for w in words if w not in allowed]
    if unknown or not words:
        raise SystemExit(f"--{name}: choose from {', '.join(allowed)}; got {text!r}")
    return words


def _interleaved(plain, distributed, x, y, flat, steps):
    """Per step: (plain ms, kdist ms, raw allreduce ms), each started together on all ranks."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    times = []
    for step in range(steps + SETTLE):
        rows = slice(64 * step, 64 * (step + 1))
        row = []
        for run in (lambda: plain.train_on_batch(x[rows], y[rows]),
                    lambda: distributed.train_on_batch(x[rows], y[rows]),
                    lambda: comm.Allreduce(MPI.IN_PLACE, flat)):
            comm.Barrier()
            start = time.perf_counter()
            run()
            row.append((time.perf_counter() - start) * 1e3)
        times.append(row)
    return np.array(times[SETTLE:])


def _phases(path):
    """Rank 0's in-graph spans per kdist step: {phase: median ms per step}."""
    with open(path) as stream:
        events = json.load(stream)["traceEvents"]
    spans = [e for e in events if e.get("ph") == "X" and e["pid"] == 0 and e["tid"] == 1]
    starts = np.array(sorted(e["ts"] for e in spans if e["name"] == "pack"))
    if starts.size == 0:
        return {}
    phases = {}
    for span in spans:
        # A phase may run several times in a step (one negotiation per collective,
        # one transfer per large tensor): each span counts for the step it falls in.
        step = max(0, int(np.searchsorted(starts, span["ts"], side="right")) - 1)
        phases.setdefault(span["name"], np.zeros(starts.size))[step] += span["dur"] / 1e3
    return {name: round(float(np.median(totals[SETTLE:])), 4)
            for name, totals in sorted(phases.items())}


def measure(optimizer_name, width, args, comm):
    import keras

    import kdist

    def make(distributed):
        model = build_mlp(width)
        inner = (keras.optimizers.SGD(0.01) if optimizer_name == "sgd"
                 else keras.optimizers.Adam(1e-4))
        model.compile(optimizer=kdist.DistributedOptimizer(inner) if distributed else inner,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    plain, distributed = make(False), make(True)
    x, y = synthetic_mnist_like(64 * (args.steps + SETTLE), seed=kdist.rank())
    parameters = sum(int(np.prod(v.shape)) for v in plain.trainable_variables)
    flat = np.ones(parameters, np.float32)
    path = None
    if args.timeline:
        directory = kdist.broadcast_object(tempfile.mkdtemp() if kdist.rank() == 0 else None)
        path = os.path.join(directory, f"timeline_{optimizer_name}_{width}.json")
    if path is not None:
        kdist.start_timeline(path)
    rounds = []
    for _ in range(args.rounds):
        plain_ms, kdist_ms, raw_ms = _interleaved(plain, distributed, x, y, flat,
                                                  args.steps).T
        overhead = float(np.median(kdist_ms - plain_ms))
        raw = float(np.median(raw_ms))
        # What a synchronous step must wait for: the slowest rank's compute.
        everyone = np.array(comm.allgather(plain_ms))
        wait = float(np.mean(everyone.max(axis=0) - plain_ms))
        rounds.append({"plain_ms": round(float(np.median(plain_ms)), 3),
                       "kdist_ms": round(float(np.median(kdist_ms)), 3),
                       "overhead_ms": round(overhead, 3),
                       "slowest_rank_wait_ms": round(wait, 3),
                       "raw_allreduce_ms": round(raw, 3),
                       "raw_allreduce_p10_p90_ms": [round(float(np.percentile(raw_ms, q)), 3)
                                                    for q in (10, 90)],
                       "overhead_to_raw": round(overhead / raw, 3)})
    if path is not None:
        kdist.stop_timeline()
        kdist.barrier()  # rank 0 has merged every rank's part of the timeline
    median = {key: round(float(np.median([r[key] for r in rounds])), 3)
              for key in ("plain_ms", "kdist_ms", "overhead_ms", "slowest_rank_wait_ms",
                          "raw_allreduce_ms", "overhead_to_raw")}
    result = {
        "benchmark": "step_overhead",
        "model": f"MLP 784-{width}-{width}-10 ({parameters:,} parameters)",
        "optimizer": optimizer_name,
        "ranks": kdist.size(),
        "gradient_megabytes": round(4 * parameters / 1e6, 3),
        "steps_per_round": args.steps,
        "median": median,
        "target_overhead_to_raw": TARGET,
        "rounds": rounds,
    }
    if path is not None and kdist.rank() == 0:
        result["phase_ms_per_step"] = _phases(path)
        result["timeline"] = path
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--optimizers", default="sgd,adam")
    parser.add_argument("--widths", default="512,2816")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--timeline", action="store_true")
    args = parser.parse_args()
    optimizers = _words(args.optimizers, ("sgd", "adam"), "optimizers")
    try:
        widths = [int(w) for w in args.widths.split(",") if w]
    except ValueError:
        parser.error(f"--widths takes whole numbers; got {args.widths!r}")
    if not widths or min(widths) < 1:
        parser.error("--widths takes positive whole numbers")
    if args.steps <= 2 * SETTLE or args.rounds < 1:
        parser.error(f"--steps must be more than {2 * SETTLE} and --rounds at least 1")
    one_thread()
    from mpi4py import MPI

    import kdist

    kdist.init()
    if kdist.size() < 2:
        parser.error("run it on 2 or more ranks: kdist run -n 2 benchmarks/step_overhead.py")
    for width in widths:
        for optimizer_name in optimizers:
            result = measure(optimizer_name, width, args, MPI.COMM_WORLD)
            if kdist.rank() == 0:
                print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
