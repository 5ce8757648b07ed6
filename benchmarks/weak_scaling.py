"""Weak scaling of `model.fit` with kdist's DistributedOptimizer.

    python benchmarks/weak_scaling.py [--ranks 2] [--rounds 3] [--steps 400]

The 784-512-512-10 MLP (670k parameters), batch 64 per rank, one thread per
rank, synthetic data. In one run, alternating so that machine noise hits all
alike, it times:
- `single`: one process, plain Keras optimizer;
- `side_by_side`: N independent processes with no communication (the floor:
  what sharing the machine costs before any allreduce);
- `kdist`: N ranks with `kdist.DistributedOptimizer` (its C++ allreduce op);
- `kdist_py_function`: the same with `KDIST_NATIVE_OPS=0` (MPI called from a
  py-function op, the path used when the C++ op cannot be built).
Every process is bound to one core (mpiexec binds its ranks the same way).
Efficiency = single ms/step / kdist ms/step (1.0 is perfect weak scaling).
Prints one JSON object.
"""

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def worker(args):
    from _mlp import build_mlp, one_thread, synthetic_mnist_like

    if args.cpu is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {args.cpu})
    one_thread()
    import keras

    import kdist

    kdist.init()
    model = build_mlp()
    x, y = synthetic_mnist_like(64 * args.steps, seed=kdist.rank())
    optimizer = keras.optimizers.Adam(1e-3)
    if args.mode.startswith("kdist"):
        optimizer = kdist.DistributedOptimizer(optimizer)
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    class StepTimes(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.times = []

        def on_train_batch_end(self, batch, logs=None):
            self.times.append(time.perf_counter())

    timer = StepTimes()
    model.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0, callbacks=[timer])
    steps = np.diff(timer.times)[50:]
    ms = float(np.median(steps)) * 1e3
    if kdist.rank() == 0:
        print("RESULT " + json.dumps({"ms_per_step": ms}))


def launch(mode, ranks, steps):
    from kdist.cli import mpiexec_command

    command = [sys.executable, "-u", os.path.abspath(__file__), "--worker", "--mode", mode,
               "--steps", str(steps)]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    if mode == "kdist_py_function":
        env["KDIST_NATIVE_OPS"] = "0"
    if ranks == 1 or mode == "side_by_side":
        env = {k: v for k, v in env.items() if not k.startswith(("OMPI_", "PMIX_", "PMI_"))}
        argv = command + (["--cpu", "0"] if ranks == 1 else [])
    else:
        argv, mpi_env = mpiexec_command(ranks, command)
        argv[1:1] = ["-x", "KDIST_NATIVE_OPS"] if "KDIST_NATIVE_OPS" in env else []
        env.update({k: v for k, v in mpi_env.items() if k.startswith("OMPI_ALLOW")})
    if mode == "side_by_side":
        # Independent processes, each its own world of one (no MPI at all), each on its
        # own core as mpiexec places ranks.
        procs = [subprocess.Popen(command + ["--cpu", str(i % (os.cpu_count() or 1))],
                                  env=env, stdout=subprocess.PIPE, text=True)
                 for i in range(ranks)]
        outputs = [p.communicate()[0] for p in procs]
        out = outputs[0]
    else:
        out = subprocess.run(argv, env=env, stdout=subprocess.PIPE, text=True,
                             check=True).stdout
    line = next(line for line in out.splitlines() if line.startswith("RESULT "))
    return json.loads(line[7:])["ms_per_step"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="single", help=argparse.SUPPRESS)
    parser.add_argument("--cpu", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    samples = {"single": [], "side_by_side": [], "kdist": [], "kdist_py_function": []}
    for _ in range(args.rounds):
        samples["single"].append(launch("single", 1, args.steps))
        samples["side_by_side"].append(launch("side_by_side", args.ranks, args.steps))
        samples["kdist"].append(launch("kdist", args.ranks, args.steps))
        samples["kdist_py_function"].append(launch("kdist_py_function", args.ranks,
                                                   args.steps))
    ms = {k: float(np.median(v)) for k, v in samples.items()}
    print(json.dumps({
        "benchmark": "weak_scaling",
        "model": "MLP 784-512-512-10 (669,706 parameters), Adam",
        "ranks": args.ranks,
        "batch_per_rank": 64,
        "threads_per_rank": 1,
        "each_process_bound_to_one_core": True,
        "ms_per_step": {k: round(v, 3) for k, v in ms.items()},
        "samples_ms": {k: [round(x, 3) for x in v] for k, v in samples.items()},
        "efficiency": round(ms["single"] / ms["kdist"], 3),
        "efficiency_py_function": round(ms["single"] / ms["kdist_py_function"], 3),
        "floor_without_communication": round(ms["single"] / ms["side_by_side"], 3),
        "efficiency_against_floor": round(ms["side_by_side"] / ms["kdist"], 3),
        "target_efficiency": 0.90,
    }, indent=2))


if __name__ == "__main__":
    main()
