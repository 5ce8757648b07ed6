"""Training throughput of the calorimeter GAN: showers per second, synchronous and asynchronous.

    python benchmarks/gan_throughput.py [--models small,full] [--ranks 1,2] [--steps 6]
                                        [--batch SHOWERS_PER_RANK]
                                        [--ps-modes downpour,easgd,gem] [--ps-ranks 2,3]

For each model of examples/gan_calorimeter (small and full 3DGAN), trains on
simulated showers (d_steps=1, g_steps=2, as the example), one thread per
rank, a fixed batch per trainer, and times the steps after two warm-up
steps:

- `showers_per_s`: synchronous data parallelism, `kdist.DistributedOptimizer`
  around both optimizers, on each of `--ranks`; every rank trains.
  `scaling` is the 2-rank rate over the 1-rank rate of the same model in the
  same run (2.0 is perfect).
- `ps`: the same GAN through `kdist.ps.ParameterServerStrategy` (the
  asynchronous loop: rank 0 holds both central models, every other rank is
  a worker) for each of `--ps-modes` on each of `--ps-ranks`. Showers per
  second sums the workers' own rates; the master's updates, busy fraction
  (applying updates), CPU fraction (its serving thread's CPU time over the
  wall time of `fit`: low when it waits without spinning) and staleness
  histogram come with it. `vs_sync` is the rate with two
  workers over the synchronous rate on two ranks (the PS run has one more
  process on the same cores).

`--ps-modes ""` leaves the parameter server out. Prints one JSON object.
"""

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(os.path.dirname(HERE), "examples", "gan_calorimeter")
BATCH = {"small": 16, "full": 8}
WARMUP = 2
PS_MODES = ["downpour", "easgd", "gem"]
PS_FIELDS = ["showers_per_s", "worker_showers_per_s", "updates", "master_busy", "master_cpu",
             "staleness_mean", "staleness_histogram"]


def worker(args):
    sys.path.insert(0, HERE)
    sys.path.insert(0, EXAMPLE)
    from _mlp import one_thread

    one_thread()
    import keras
    import numpy as np
    import tensorflow as tf

    import data
    import kdist
    import train

    small = args.model == "small"
    settings = train.parse(["--output", "unused", "--d-steps", "1", "--g-steps", "2"]
                           + (["--small"] if small else []))
    strategy = None
    if args.ps_mode:
        strategy = kdist.ps.ParameterServerStrategy(mode=args.ps_mode, shard=False)
        with strategy.scope():
            gan = train.build_gan(settings)
            train.compile_gan(gan, settings)
    else:
        gan = train.build_gan(settings)
        train.compile_gan(gan, settings,
                          kdist.DistributedOptimizer if kdist.size() > 1 else None)
    batch = args.batch or BATCH[args.model]
    energies = np.random.default_rng(kdist.rank()).uniform(10, 500, 4 * batch)
    rows = train.to_model_units(data.simulate(energies, seed=kdist.rank()), energies)
    dataset = tf.data.Dataset.from_tensor_slices(
        {"real": rows["real"], "condition": rows["condition"],
         "aux": (rows["condition"], rows["cell_sum"])}).repeat().batch(batch)
    marks = []

    class Clock(keras.callbacks.Callback):
        def on_train_batch_end(self, step, logs=None):
            marks.append(time.perf_counter())

    if strategy is not None:
        return ps_worker(args, strategy, gan, dataset, batch, Clock, marks)
    callbacks = [Clock()]
    if kdist.size() > 1:
        callbacks.insert(0, kdist.callbacks.BroadcastGlobalVariablesCallback(0))
    gan.fit(dataset, steps_per_epoch=WARMUP + args.steps, epochs=1, verbose=0, shuffle=False,
            callbacks=callbacks)
    seconds = marks[-1] - marks[WARMUP - 1]
    rate = args.steps * batch * kdist.size() / seconds
    if kdist.rank() == 0:
        print(json.dumps({"model": args.model, "ranks": kdist.size(), "batch_per_rank": batch,
                          "seconds_per_step": seconds / args.steps, "showers_per_s": rate}),
              flush=True)


def ps_worker(args, strategy, gan, dataset, batch, clock, marks):
    """One rank of the asynchronous run: workers time their own steps, rank 0
    serves; their rates and the master's statistics meet on rank 0."""
    started = time.perf_counter()
    gan.fit(dataset, steps_per_epoch=WARMUP + args.steps, epochs=1, verbose=0, shuffle=False,
            worker_callbacks=[clock()])
    wall = time.perf_counter() - started
    rate = args.steps * batch / (marks[-1] - marks[WARMUP - 1]) if strategy.is_worker else 0.0
    rates = strategy.comm.allgather_object(rate)
    if strategy.is_master:
        stats = strategy.stats
        print(json.dumps({"model": args.model, "mode": args.ps_mode, "ranks": len(rates),
                          "workers": strategy.num_workers, "batch_per_worker": batch,
                          "showers_per_s": sum(rates),
                          "worker_showers_per_s": rates[1:],
                          "updates": stats["updates"], "master_busy": stats["utilisation"],
                          "master_cpu": stats["cpu_seconds"] / wall,
                          "staleness_mean": stats["staleness_mean"],
                          "staleness_histogram": stats["staleness_histogram"]}), flush=True)


def launch(model, ranks, steps, batch=0, ps_mode=""):
    from kdist.cli import mpiexec_command

    command = [sys.executable, "-u", os.path.abspath(__file__), "--worker", "--model", model,
               "--steps", str(steps), "--batch", str(batch), "--ps-mode", ps_mode]
    argv, env = mpiexec_command(ranks, command)
    env = dict(env, TF_CPP_MIN_LOG_LEVEL="3")
    what = f"{model}{' through the ' + ps_mode + ' parameter server' if ps_mode else ''}"
    done = subprocess.run(argv, env=env, stdout=subprocess.PIPE, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"{what} on {ranks} rank(s) failed:\n{done.stdout[-3000:]}")
    for line in done.stdout.splitlines()[::-1]:
        if line.lstrip("[0123456789] ").startswith("{"):
            return json.loads(line[line.index("{"):])
    raise SystemExit(f"no result from {what} on {ranks} rank(s):\n{done.stdout[-3000:]}")


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="small,full")
    parser.add_argument("--ranks", default="1,2")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=0,
                        help="showers per rank and step (default: 16 small, 8 full)")
    parser.add_argument("--ps-modes", default="downpour,easgd,gem",
                        help="parameter-server modes to run; empty for none")
    parser.add_argument("--ps-ranks", default="2,3",
                        help="ranks of each parameter-server run (1 master, the rest workers)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", choices=sorted(BATCH), help=argparse.SUPPRESS)
    parser.add_argument("--ps-mode", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    models = args.models.split(",")
    unknown = sorted(set(models) - set(BATCH))
    if unknown:
        parser.error(f"unknown model(s) {unknown}; choose from {sorted(BATCH)}")
    modes = [m for m in args.ps_modes.split(",") if m]
    unknown = sorted(set(modes) - set(PS_MODES))
    if unknown:
        parser.error(f"unknown parameter-server mode(s) {unknown}; choose from {PS_MODES}")
    ranks = [int(r) for r in args.ranks.split(",")]
    ps_ranks = [int(r) for r in args.ps_ranks.split(",")] if modes else []
    if any(n < 2 for n in ps_ranks):
        parser.error("a parameter-server run needs at least 2 ranks (a master and a worker)")
    result = {"steps": args.steps, "cpu_count": os.cpu_count(), "models": {}}
    for model in models:
        runs = {str(n): launch(model, n, args.steps, args.batch) for n in ranks}
        entry = {"batch_per_rank": args.batch or BATCH[model],
                 "showers_per_s": {n: run["showers_per_s"] for n, run in runs.items()},
                 "seconds_per_step": {n: run["seconds_per_step"] for n, run in runs.items()}}
        if "1" in runs and "2" in runs:
            entry["scaling"] = runs["2"]["showers_per_s"] / runs["1"]["showers_per_s"]
        if modes:
            entry["ps"] = {}
        for mode in modes:
            entry["ps"][mode] = {}
            for n in ps_ranks:
                run = launch(model, n, args.steps, args.batch, mode)
                entry["ps"][mode][str(n - 1)] = {k: run[k] for k in PS_FIELDS}
            if "2" in entry["ps"][mode] and "2" in runs:
                entry["ps"][mode]["vs_sync"] = (entry["ps"][mode]["2"]["showers_per_s"]
                                                / runs["2"]["showers_per_s"])
        result["models"][model] = entry
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
