"""Median regret of hyper-parameter search methods on standard test functions.

    python benchmarks/hpo.py [--seeds 10] [--problems branin,hartmann6,ackley10]
                             [--methods kdist_bayesian,kdist_genetic,kt_random,
                              kt_bayesian,optuna_tpe,optuna_tpe_no_liar]
                             [--trials-scale 1.0] [--all] [--batches 1,4,8]
                             [--pattern rounds|steady]

Each method minimises each function with its budget (Branin and Hartmann-6: 30
trials; 10-D Ackley: 200), once per seed. Regret is the best value found minus
the known minimum; the JSON gives every run's regret, the median over seeds
and the median seconds per run. The keras-tuner oracles (kdist's and
keras-tuner's own) run inside a `keras_tuner.Tuner` whose trials evaluate the
function; Optuna runs its TPE sampler, with its constant liar for running trials
(`optuna_tpe`) and without (`optuna_tpe_no_liar`). Every method sees the same box.

`--batches` runs every method once per batch size b: b proposals are asked
for at once (as b groups of a distributed search ask one oracle, each with
its own tuner id), then all b are evaluated and reported, until the budget
is spent. b = 1 is a sequential search. The batched numbers are under
`by_batch`; the top-level numbers are those of the first batch size. The
targets judge the sequential column (null when `--batches` leaves out 1).
`--pattern steady` keeps b trials running instead: the oldest one ends, and
its group asks for the next at once, as groups of a distributed search whose
trials take equally long do; every proposal after the first b is then made
while b - 1 others run.

Gaussian-process methods at 200 trials take minutes per run, and the 10-D
Ackley target concerns the genetic oracle, so they skip Ackley unless `--all`.
Targets: kdist Bayesian <= 0.02 on Branin and <= 0.10 on Hartmann-6; kdist
genetic on Ackley <= half of keras-tuner random's median regret.
"""

import argparse
import collections
import contextlib
import io
import json
import math
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402


def branin(x):
    x1, x2 = x
    b, c, t = 5.1 / (4 * math.pi ** 2), 5 / math.pi, 1 / (8 * math.pi)
    return (x2 - b * x1 ** 2 + c * x1 - 6) ** 2 + 10 * (1 - t) * math.cos(x1) + 10


_H_ALPHA = np.array([1.0, 1.2, 3.0, 3.2])
_H_A = np.array([[10, 3, 17, 3.5, 1.7, 8], [0.05, 10, 17, 0.1, 8, 14],
                 [3, 3.5, 1.7, 10, 17, 8], [17, 8, 0.05, 10, 0.1, 14]])
_H_P = 1e-4 * np.array([[1312, 1696, 5569, 124, 8283, 5886], [2329, 4135, 8307, 3736, 1004, 9991],
                        [2348, 1451, 3522, 2883, 3047, 6650], [4047, 8828, 8732, 5743, 1091, 381]])


def hartmann6(x):
    x = np.asarray(x, dtype=float)
    return float(-np.sum(_H_ALPHA * np.exp(-np.sum(_H_A * (x - _H_P) ** 2, axis=1))))


def ackley(x):
    x = np.asarray(x, dtype=float)
    d = x.size
    return float(-20 * np.exp(-0.2 * np.sqrt(np.sum(x ** 2) / d))
                 - np.exp(np.sum(np.cos(2 * np.pi * x)) / d) + 20 + math.e)


PROBLEMS = {
    "branin": (branin, [(-5.0, 10.0), (0.0, 15.0)], 0.397887, 30),
    "hartmann6": (hartmann6, [(0.0, 1.0)] * 6, -3.32237, 30),
    "ackley10": (ackley, [(-32.768, 32.768)] * 10, 0.0, 200),
}
METHODS = ["kdist_bayesian", "kdist_genetic", "kt_random", "kt_bayesian", "optuna_tpe",
           "optuna_tpe_no_liar"]
SLOW_ON_ACKLEY = {"kdist_bayesian", "kt_bayesian"}


def make_oracle(method, space, trials, seed):
    import keras_tuner as kt

    objective = kt.Objective("value", "min")
    common = dict(objective=objective, max_trials=trials, seed=seed, hyperparameters=space)
    if method == "kdist_bayesian":
        from kdist.tune import BayesianOracle

        return BayesianOracle(**common)
    if method == "kdist_genetic":
        from kdist.tune import GeneticOracle

        return GeneticOracle(**common)
    if method == "kt_random":
        return kt.oracles.RandomSearchOracle(**common)
    if method == "kt_bayesian":
        return kt.oracles.BayesianOptimizationOracle(**common)
    raise ValueError(f"unknown method {method!r}; choose from {METHODS}")


def run_keras_tuner(method, function, bounds, trials, seed, batch=1, steady=False):
    """Drives the oracle as `batch` tuners sharing it would: `batch` trials
    asked for (each by its own tuner id), then all evaluated and ended; with
    `steady`, the oldest running trial ends and its tuner asks again."""
    import keras_tuner as kt

    from kdist.tune import compat

    space = kt.HyperParameters()
    for i, (low, high) in enumerate(bounds):
        space.Float(f"x{i}", low, high)
    oracle = make_oracle(method, space, trials, seed)
    with tempfile.TemporaryDirectory() as directory, contextlib.redirect_stdout(io.StringIO()):
        compat.set_project_dir(oracle, directory, "run")

        def finish(trial):
            values = trial.hyperparameters.values
            value = function([values[f"x{i}"] for i in range(len(bounds))])
            oracle.update_trial(trial.trial_id, {"value": value})
            trial.status = "COMPLETED"
            oracle.end_trial(trial)

        # Groups whose last trial has ended ask again; in rounds all of a round's
        # trials end before anyone asks, in the steady pattern only the oldest.
        free, running = collections.deque(range(batch)), collections.deque()
        while True:
            while free:
                trial = oracle.create_trial(f"tuner{free[0]}")
                if trial.status != "RUNNING":
                    break
                running.append((free.popleft(), trial))
            if not running:
                break
            for _ in range(1 if steady else len(running)):
                tuner, trial = running.popleft()
                finish(trial)
                free.append(tuner)
    scores = [t.score for t in oracle.trials.values() if t.score is not None]
    if len(scores) != trials:
        raise RuntimeError(f"{method} ran {len(scores)} trials, not {trials}")
    return min(scores)


def run_optuna(function, bounds, trials, seed, batch=1, liar=True, steady=False):
    """TPE asked for `batch` points at once (with `steady`, `batch` kept
    running, the oldest told first). `liar` is Optuna's own answer to
    running trials (`constant_liar`: they are taken to have scored the worst
    value seen), on by default since Optuna 5."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sampler = optuna.samplers.TPESampler(seed=seed, constant_liar=liar)
    study = optuna.create_study(sampler=sampler)

    def ask():
        # TPE samples when a value is suggested: a point is drawn whole
        # before anything else is asked or told.
        trial = study.ask()
        return trial, [trial.suggest_float(f"x{i}", lo, hi) for i, (lo, hi) in enumerate(bounds)]

    asked, running = 0, collections.deque()
    while asked < trials or running:
        while asked < trials and len(running) < batch:
            running.append(ask())
            asked += 1
        for _ in range(1 if steady else len(running)):
            trial, point = running.popleft()
            study.tell(trial, function(point))
    return study.best_value


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--problems", default=",".join(PROBLEMS))
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--trials-scale", type=float, default=1.0,
                        help="multiply every budget (a quick smoke run)")
    parser.add_argument("--all", action="store_true",
                        help="also run the Gaussian-process methods on 10-D Ackley")
    parser.add_argument("--batches", default="1",
                        help="comma-separated numbers of proposals asked for at once")
    parser.add_argument("--pattern", choices=["rounds", "steady"], default="rounds",
                        help="rounds: b asked, then b told; steady: b kept running")
    args = parser.parse_args()
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        parser.error(f"--batches takes whole numbers; got {args.batches!r}")
    if any(b < 1 for b in batches):
        parser.error(f"--batches takes numbers of at least 1; got {args.batches!r}")
    steady = args.pattern == "steady"
    methods = args.methods.split(",")
    for method in methods:
        if method not in METHODS:
            parser.error(f"unknown method {method!r}; choose from {METHODS}")
    results = {}
    for name in args.problems.split(","):
        if name not in PROBLEMS:
            parser.error(f"unknown problem {name!r}; choose from {list(PROBLEMS)}")
        function, bounds, minimum, budget = PROBLEMS[name]
        trials = max(2, round(budget * args.trials_scale))
        by_batch = {}
        for batch in batches:
            column = {"regrets": {}, "median_regret": {}, "seconds": {}}
            for method in methods:
                if name == "ackley10" and method in SLOW_ON_ACKLEY and not args.all:
                    continue
                regrets, seconds = [], []
                for seed in range(args.seeds):
                    started = time.perf_counter()
                    if method.startswith("optuna_tpe"):
                        best = run_optuna(function, bounds, trials, seed, batch,
                                          liar=method == "optuna_tpe", steady=steady)
                    else:
                        best = run_keras_tuner(method, function, bounds, trials, seed, batch,
                                               steady)
                    seconds.append(time.perf_counter() - started)
                    regrets.append(best - minimum)
                # Progress on stderr: whole runs take up to an hour; stdout is the JSON.
                print(f"hpo.py: {name} b={batch} {method}: median regret "
                      f"{statistics.median(regrets):.4g} over {args.seeds} seeds, "
                      f"{sum(seconds):.0f} s", file=sys.stderr, flush=True)
                column["regrets"][method] = regrets
                column["median_regret"][method] = statistics.median(regrets)
                column["seconds"][method] = statistics.median(seconds)
            by_batch[str(batch)] = column
        results[name] = {"trials": trials, "minimum": minimum, **by_batch[str(batches[0])],
                         "by_batch": by_batch}

    def median(problem, method):
        # The targets are a sequential search's: one proposal at a time.
        sequential = results.get(problem, {}).get("by_batch", {}).get("1", {})
        return sequential.get("median_regret", {}).get(method)

    def target(value, bound):
        return None if value is None or bound is None else bool(value <= bound)

    random_ackley = median("ackley10", "kt_random")
    targets = {
        "kdist_bayesian_branin_le_0.02": target(median("branin", "kdist_bayesian"), 0.02),
        "kdist_bayesian_hartmann6_le_0.10": target(median("hartmann6", "kdist_bayesian"), 0.10),
        "kdist_genetic_ackley10_le_half_random": target(
            median("ackley10", "kdist_genetic"),
            None if random_ackley is None else random_ackley / 2),
    }
    print(json.dumps({"benchmark": "hpo", "seeds": args.seeds, "pattern": args.pattern,
                      "problems": results, "targets": targets}, indent=1))


if __name__ == "__main__":
    main()
