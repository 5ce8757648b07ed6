"""Ranks that share cores: 4 ranks on 2 cores against 2 ranks, in one run.

    python benchmarks/shared_cores.py [--rounds 3] [--steps 250]

The weak-scaling MLP (784-512-512-10, Adam, batch 64 per rank, one thread per
rank) under `fit`, each case launched afresh every round, in turns, so that
machine noise hits all alike:
- `two_ranks`: 2 ranks with `kdist.DistributedOptimizer`, one per core;
- `four_without_communication`: 4 independent processes, two per core (the
  floor: twice the compute per core and no allreduce);
- `four_ranks`: 4 ranks (`--oversubscribe`) with `DistributedOptimizer`;
- `four_ranks_yielding`: the same with Open MPI told to yield the core while it
  waits (`OMPI_MCA_mpi_yield_when_idle=1`) instead of polling.
`ratio_to_two_ranks` is each 4-process case's median step over the 2-rank one
(2.0 is the doubled compute alone); `communication_over_floor` is each 4-rank
case over `four_without_communication`, the part that sharing cores adds to the
allreduce. Prints one JSON object.
"""

import argparse
import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

CASES = {
    "two_ranks": ("kdist", 2, {}),
    "four_without_communication": ("side_by_side", 4, {}),
    "four_ranks": ("kdist", 4, {}),
    "four_ranks_yielding": ("kdist", 4, {"OMPI_MCA_mpi_yield_when_idle": "1"}),
}


def main():
    from weak_scaling import launch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=250)
    args = parser.parse_args()
    if args.steps <= 50:
        parser.error("--steps must be more than 50: the first 50 steps are not timed")
    samples = {name: [] for name in CASES}
    for _ in range(args.rounds):
        for name, (mode, ranks, env) in CASES.items():
            saved = {k: os.environ.get(k) for k in env}
            os.environ.update(env)
            try:
                samples[name].append(launch(mode, ranks, args.steps)["ms_per_step"])
            finally:
                for k, v in saved.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
    ms = {k: float(np.median(v)) for k, v in samples.items()}
    print(json.dumps({
        "benchmark": "shared_cores",
        "model": "MLP 784-512-512-10 (669,706 parameters), Adam, batch 64 per rank",
        "cores": os.cpu_count(),
        "ms_per_step": {k: round(v, 3) for k, v in ms.items()},
        "samples_ms": {k: [round(x, 3) for x in v] for k, v in samples.items()},
        "ratio_to_two_ranks": {k: round(v / ms["two_ranks"], 3) for k, v in ms.items()
                               if k != "two_ranks"},
        "communication_over_floor": {
            k: round(ms[k] / ms["four_without_communication"], 3)
            for k in ("four_ranks", "four_ranks_yielding")},
        "target_ratio": 2.2,
    }, indent=2))


if __name__ == "__main__":
    main()
