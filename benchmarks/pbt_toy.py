"""Population-based training where only a schedule works: a toy whose best learning rate
follows a triangle wave, at equal total steps for every method.

    python benchmarks/pbt_toy.py [--seeds 10] [--population 8] [--max-epochs 20]
                                 [--interval 2] [--steps-per-epoch 10]
                                 [--methods kdist_pbt,kdist_pb2,kt_random,kdist_bohb,
                                  best_constant,best_cosine]

The toy trains a "progress" p from 0. At each step with learning rate r, the rate that
helps most is ideal(p) = 10 ** (-4 + 2 * triangle(p / 25)), where triangle rises from 0 to
1 over one unit and falls back over the next: the best rate climbs from 1e-4 to 1e-2 while
p goes from 0 to 25, falls back by p = 50, and so on. With d = |log10(r / ideal(p))|,
a step adds (1 - d / 0.5) * U(0.5, 1.5) to p when d < 0.5, nothing when the rate is too
low, and takes d * U(0, 1) away when it is too high. A fixed rate therefore stops where
the ideal leaves it behind (about p = 11 at best); only a rate that follows p keeps
moving (about 1 per step). The score a method sees is p plus Gaussian noise (sd 1); the
table reports the true p of the best member or trial.

Every method gets population x max_epochs epochs of steps_per_epoch steps:

- `kdist_pbt`: `kdist.tune.PBTOracle` (rounds of `interval` epochs) driving the toy
  through a `keras_tuner.Tuner` whose `run_trial` continues the round's parent state;
- `kdist_pb2`: the same with `explore="pb2"`;
- `kt_random`: keras-tuner's random search, population trials of max_epochs at a fixed
  rate each;
- `kdist_bohb`: `kdist.tune.BOHBOracle`, max_epochs and factor 2, stopped at the same
  epochs in all; a promoted trial continues its parent's state, as Hyperband's does;
- `best_constant`: the best of 41 fixed rates on a log grid from 1e-5 to 1e-1 (found by
  hand, at 41 times the budget of one member);
- `best_cosine`: the best cosine decay (from r0 to r0 / 100 over the run) over the same
  grid of r0.

The last two are what a person tuning one training by hand would find; they are not
searches of equal cost. The JSON holds every run and the medians over seeds.
"""

import argparse
import contextlib
import io
import json
import math
import os
import statistics
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402

METHODS = ["kdist_pbt", "kdist_pb2", "kt_random", "kdist_bohb", "best_constant",
           "best_cosine"]
HALF_PERIOD = 100.0  # progress over which the ideal rate climbs (or falls) two decades
TOLERANCE = 0.5  # decades from the ideal rate within which a step makes progress
SCORE_NOISE = 1.0


def ideal_rate(progress):
    phase = (progress / HALF_PERIOD) % 2.0
    triangle = phase if phase <= 1.0 else 2.0 - phase
    return 10.0 ** (-4.0 + 2.0 * triangle)


def train(progress, rate, steps, rng):
    """`progress` after `steps` steps at `rate`."""
    for _ in range(steps):
        distance = abs(math.log10(rate / ideal_rate(progress)))
        if distance < TOLERANCE:
            progress += (1.0 - distance / TOLERANCE) * rng.uniform(0.5, 1.5)
        elif rate > ideal_rate(progress):
            progress = max(0.0, progress - distance * rng.uniform(0.0, 1.0))
    return progress


def _tuner_class():
    import keras_tuner as kt

    class ToyTuner(kt.Tuner):
        """Trains the toy in `run_trial`, from the state of the trial the oracle names as
        parent (`tuner/trial_id`: PBT's donor or own last round, BOHB's promoted trial)."""

        def __init__(self, oracle, args, seed, **kwargs):
            super().__init__(oracle=oracle, **kwargs)
            self.args = args
            self.progress = {}  # trial id -> true progress at its end
            self.rng = np.random.default_rng(seed)
            self.steps = 0

        def run_trial(self, trial, *unused_args, **unused_kwargs):
            values = trial.hyperparameters.values
            start = int(values.get("tuner/initial_epoch", 0))
            end = int(values.get("tuner/epochs", self.args.max_epochs))
            progress = self.progress.get(values.get("tuner/trial_id"), 0.0)
            steps = (end - start) * self.args.steps_per_epoch
            progress = train(progress, values["learning_rate"], steps, self.rng)
            self.steps += steps
            self.progress[trial.trial_id] = progress
            return {"score": progress + self.rng.normal(0.0, SCORE_NOISE)}

    return ToyTuner


def search(method, args, seed, directory):
    """(true progress of the best-scored trial, steps spent) for one search."""
    import keras_tuner as kt

    import kdist.tune

    space = kt.HyperParameters()
    space.Float("learning_rate", 1e-5, 1e-1, sampling="log")
    objective = kt.Objective("score", "max")
    budget = args.population * args.max_epochs
    common = dict(objective=objective, hyperparameters=space, seed=seed)
    if method in ("kdist_pbt", "kdist_pb2"):
        oracle = kdist.tune.PBTOracle(population_size=args.population,
                                      perturbation_interval=args.interval,
                                      max_epochs=args.max_epochs,
                                      explore="pb2" if method == "kdist_pb2" else None,
                                      **common)
    elif method == "kdist_bohb":
        oracle = kdist.tune.BOHBOracle(max_epochs=args.max_epochs, factor=2, budget=budget,
                                       **common)
    else:
        oracle = kt.oracles.RandomSearchOracle(max_trials=args.population, **common)
    tuner = _tuner_class()(oracle, args, seed, directory=directory, project_name=method)
    with contextlib.redirect_stdout(io.StringIO()):
        tuner.search()
    best = oracle.get_best_trials(1)[0]
    return tuner.progress[best.trial_id], tuner.steps


def cosine_rate(step, steps, start):
    """A cosine decay from `start` at step 0 to a hundredth of it at `steps`."""
    return start * (0.01 + 0.99 * 0.5 * (1 + math.cos(math.pi * step / steps)))


def by_hand(method, args, seed):
    """The best of a grid of fixed rates or cosine decays, each trained once."""
    steps = args.max_epochs * args.steps_per_epoch
    rng = np.random.default_rng(seed)
    best = 0.0
    for start in np.logspace(-5, -1, 41):
        progress = 0.0
        for step in range(steps):
            rate = cosine_rate(step, steps, start) if method == "best_cosine" else start
            progress = train(progress, rate, 1, rng)
        best = max(best, progress)
    return best, steps * 41


def add_search_arguments(parser):
    """The options that set a search's seeds and budget (ray_pbt.py takes them too)."""
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--population", type=int, default=8)
    parser.add_argument("--max-epochs", type=int, default=20)
    parser.add_argument("--interval", type=int, default=2)
    parser.add_argument("--steps-per-epoch", type=int, default=10)


def search_arguments(args):
    """`args`' search options as a command line."""
    return ["--seeds", str(args.seeds), "--population", str(args.population),
            "--max-epochs", str(args.max_epochs), "--interval", str(args.interval),
            "--steps-per-epoch", str(args.steps_per_epoch)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_search_arguments(parser)
    parser.add_argument("--methods", default=",".join(METHODS))
    args = parser.parse_args()
    methods = args.methods.split(",")
    for method in methods:
        if method not in METHODS:
            parser.error(f"unknown method {method!r}; choose from {METHODS}")
    if args.seeds < 1 or args.population < 2 or args.interval < 1 or args.max_epochs < 1:
        parser.error("--seeds and --interval must be at least 1, --population at least 2")
    runs = {method: [] for method in methods}
    for seed in range(args.seeds):
        for method in methods:
            started = time.perf_counter()
            if method.startswith("best_"):
                progress, steps = by_hand(method, args, seed)
            else:
                with tempfile.TemporaryDirectory() as directory:
                    progress, steps = search(method, args, seed, directory)
            runs[method].append({"seed": seed, "progress": round(progress, 2), "steps": steps,
                                 "seconds": round(time.perf_counter() - started, 2)})
    member_steps = args.max_epochs * args.steps_per_epoch
    summary = {method: {
        "median_progress": statistics.median(r["progress"] for r in method_runs),
        "range": [min(r["progress"] for r in method_runs),
                  max(r["progress"] for r in method_runs)],
        "median_steps": statistics.median(r["steps"] for r in method_runs)}
        for method, method_runs in runs.items()}
    print(json.dumps({"benchmark": "pbt_toy", "seeds": args.seeds,
                      "population": args.population, "max_epochs": args.max_epochs,
                      "interval": args.interval, "steps_per_member": member_steps,
                      "budget_steps": args.population * member_steps,
                      "summary": summary, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
