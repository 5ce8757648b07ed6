"""Ray Tune's population-based training beside kdist's, on pbt_toy.py's triangle wave.

    python benchmarks/ray_pbt.py [--seeds 10] [--population 8] [--max-epochs 20]
                                 [--interval 2] [--steps-per-epoch 10] [--venv DIR]

Ray Tune's wheel pins what TensorFlow's does not allow beside it, and the toy needs no
TensorFlow, so Ray runs in a virtual environment of its own, made once at `--venv`
(default `~/.cache/kdist/ray-tune`, with `ray[tune]` and numpy). There each seed runs
Ray's `PopulationBasedTraining` scheduler (the same population, interval, quantile
fraction 0.25, resample probability 0.25 and log-uniform learning rate from 1e-5 to 1e-1
as kdist's) on a function trainable that checkpoints the toy's progress every epoch and
continues from the checkpoint Ray hands it after an exploit. Then pbt_toy.py runs kdist's
PBT and PB2 with the same seeds in this environment.

The JSON gives, per method and seed, the true progress of the member whose last score is
best, and the epochs trained in all (Ray's asynchronous exploit can skip a member ahead
to its donor's epoch, so it may train fewer than population x max_epochs).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import pbt_toy  # noqa: E402  (the toy, its options; numpy only)
from _environments import make_environment  # noqa: E402


def ray_search(args, seed, ledger):
    """One search of Ray Tune's PBT: (true progress of the best member, epochs trained)."""
    import random

    import numpy as np
    from ray import tune
    from ray.tune.schedulers import PopulationBasedTraining

    steps = args.steps_per_epoch

    def trainable(config):
        state = {"progress": 0.0, "epoch": 0}
        checkpoint = tune.get_checkpoint()
        if checkpoint is not None:
            with checkpoint.as_directory() as directory:
                with open(os.path.join(directory, "state.json")) as f:
                    state = json.load(f)
        trial = tune.get_context().get_trial_id()
        rng = np.random.default_rng([seed, state["epoch"], zlib.crc32(trial.encode())])
        while state["epoch"] < args.max_epochs:
            state["progress"] = pbt_toy.train(state["progress"], config["learning_rate"],
                                              steps, rng)
            state["epoch"] += 1
            with open(ledger, "a") as f:
                f.write("1\n")
            score = state["progress"] + rng.normal(0.0, pbt_toy.SCORE_NOISE)
            with tempfile.TemporaryDirectory() as directory:
                with open(os.path.join(directory, "state.json"), "w") as f:
                    json.dump(state, f)
                tune.report({"score": score, "progress": state["progress"]},
                            checkpoint=tune.Checkpoint.from_directory(directory))

    random.seed(seed)
    np.random.seed(seed)
    rate = tune.loguniform(1e-5, 1e-1)
    scheduler = PopulationBasedTraining(
        time_attr="training_iteration", perturbation_interval=args.interval,
        hyperparam_mutations={"learning_rate": rate}, quantile_fraction=0.25,
        resample_probability=0.25)
    tuner = tune.Tuner(
        trainable, param_space={"learning_rate": rate},
        tune_config=tune.TuneConfig(scheduler=scheduler, num_samples=args.population,
                                    metric="score", mode="max"),
        run_config=tune.RunConfig(name=f"toy-{seed}", verbose=0,
                                  storage_path=os.path.dirname(ledger)))
    results = tuner.fit()
    best = results.get_best_result(metric="score", mode="max", scope="last")
    with open(ledger) as f:
        epochs = sum(1 for _ in f)
    return best.metrics["progress"], epochs


def inside(args):
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": HERE}})
    runs = []
    for seed in range(args.seeds):
        with tempfile.TemporaryDirectory() as directory:
            progress, epochs = ray_search(args, seed, os.path.join(directory, "ledger"))
        runs.append({"seed": seed, "progress": round(progress, 2), "epochs": epochs})
    print(json.dumps(runs))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    pbt_toy.add_search_arguments(parser)
    parser.add_argument("--venv", default=os.path.join(os.path.expanduser("~"), ".cache",
                                                       "kdist", "ray-tune"))
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inside:
        inside(args)
        return
    shared = pbt_toy.search_arguments(args)
    python = make_environment(args.venv, ["ray[tune]", "numpy"])
    done = subprocess.run([python, os.path.abspath(__file__), "--inside"] + shared,
                          capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"Ray Tune's run failed:\n{done.stderr[-4000:]}")
    ray_runs = json.loads(done.stdout.strip().splitlines()[-1])
    done = subprocess.run([sys.executable, os.path.join(HERE, "pbt_toy.py"), "--methods",
                           "kdist_pbt,kdist_pb2"] + shared, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"pbt_toy.py failed:\n{done.stderr[-4000:]}")
    kdist_runs = json.loads(done.stdout)["runs"]
    result = combine(ray_runs, kdist_runs, args.steps_per_epoch)
    print(json.dumps(dict({"benchmark": "ray_pbt", "seeds": args.seeds,
                           "budget_epochs": args.population * args.max_epochs}, **result),
                     indent=1))


def combine(ray_runs, kdist_runs, steps_per_epoch):
    """Ray's runs and pbt_toy.py's, in epochs, with each method's median and range."""
    runs = {"ray_pbt": ray_runs}
    for method, method_runs in kdist_runs.items():
        runs[method] = [{"seed": r["seed"], "progress": r["progress"],
                         "epochs": r["steps"] // steps_per_epoch} for r in method_runs]
    summary = {method: {"median_progress": statistics.median(r["progress"] for r in rs),
                        "range": [min(r["progress"] for r in rs),
                                  max(r["progress"] for r in rs)],
                        "median_epochs": statistics.median(r["epochs"] for r in rs)}
               for method, rs in runs.items()}
    return {"summary": summary, "runs": runs}


if __name__ == "__main__":
    main()
