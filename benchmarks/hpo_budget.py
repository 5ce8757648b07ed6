"""Budget-aware search on a real Keras task: epochs needed to reach a validation accuracy.

    python benchmarks/hpo_budget.py [--seeds 3] [--first-seed 1] [--max-epochs 27]
                                    [--factor 3] [--threads 0]
                                    [--methods kdist_bohb,kt_hyperband,kt_random,
                                     optuna_hyperband]

A small CNN on scikit-learn's 8x8 digits (500 training and 500 validation
images, the same split for every method) with four hyper-parameters: conv
filters, dense units, dropout and a log-scaled learning rate. keras-tuner's
Hyperband sets the budget: its total epochs E over one iteration with
`max_epochs` and `factor`. Every other method gets the same E:

- `kdist_bohb`: `kdist.tune.BOHB` with the same `max_epochs` and `factor`;
- `kt_random`: keras-tuner's random search, E / max_epochs fully trained trials;
- `optuna_hyperband`: Optuna's TPE sampler with its Hyperband pruner
  (intermediate accuracy reported each epoch), stopped when E epochs are spent.

Training is repeatable: each model's weights and batch order are seeded
from its configuration and the run's seed, so two methods that try the same
configuration for the same epochs get the same accuracy, and the methods
differ only by what they choose to train.

Each trial's score is its best epoch's validation accuracy. For each run the
JSON gives the best accuracy, the epochs it took, and the epochs each method
needed to reach keras-tuner Hyperband's best accuracy of the same seed
(`epochs_to_hyperband_best`, null if never); the medians over seeds go in
`summary`, with each method's best accuracy after a quarter, half, three
quarters and all of E. Target: kdist BOHB reaches Hyperband's best in at
most half of Hyperband's epochs, and BOHB and Hyperband both beat random
search at equal epochs. Runs over other seeds made side by side (each with
`--first-seed`) are summarised as one with `--merge REPORT...`.
"""

import argparse
import contextlib
import io
import json
import os
import statistics
import tempfile
import time
import zlib

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402

METHODS = ["kt_hyperband", "kdist_bohb", "kt_random", "optuna_hyperband"]


def digits():
    from sklearn.datasets import load_digits

    data = load_digits()
    images = (data.images / 16.0).astype("float32")[..., None]
    order = np.random.default_rng(0).permutation(len(images))
    train, valid = order[:500], order[500:1000]
    return (images[train], data.target[train]), (images[valid], data.target[valid])


RUN_SEED = [0]


def seed_training(values):
    """Seeds Keras from a configuration (not its `tuner/*` budget) and the run's seed."""
    import keras

    config = sorted((k, v) for k, v in values.items() if not k.startswith("tuner/"))
    keras.utils.set_random_seed(zlib.crc32(repr((RUN_SEED[0], config)).encode()))


def build(hp):
    import keras

    seed_training(hp.values)
    model = keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(hp.Int("filters", 4, 64, step=4), 3, padding="same",
                            activation="relu"),
        keras.layers.MaxPooling2D(2),
        keras.layers.Flatten(),
        keras.layers.Dense(hp.Int("units", 16, 256, step=16), activation="relu"),
        keras.layers.Dropout(hp.Float("dropout", 0.0, 0.7)),
        keras.layers.Dense(10, activation="softmax")])
    model.compile(keras.optimizers.Adam(hp.Float("lr", 1e-5, 1.0, sampling="log")),
                  "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def trajectory(trials):
    """(cumulative epochs, best accuracy so far) after each trial, in the order they ran."""
    points, spent, best = [], 0, 0.0
    for trial in trials:
        values = trial.hyperparameters.values
        spent += values.get("tuner/epochs", values.get("epochs", 0)) - values.get(
            "tuner/initial_epoch", 0)
        if trial.score is not None and np.isfinite(trial.score):
            best = max(best, trial.score)
        points.append((int(spent), float(best)))
    return points


def run_keras_tuner(method, data, max_epochs, factor, budget, seed):
    import keras_tuner as kt

    import kdist.tune

    (x, y), validation = data
    objective = kt.Objective("val_accuracy", "max")
    with tempfile.TemporaryDirectory() as directory, contextlib.redirect_stdout(io.StringIO()):
        common = dict(objective=objective, seed=seed, directory=directory, project_name="run")
        if method == "kt_hyperband":
            tuner = kt.Hyperband(build, max_epochs=max_epochs, factor=factor, **common)
        elif method == "kdist_bohb":
            tuner = kdist.tune.BOHB(build, max_epochs=max_epochs, factor=factor,
                                    budget=budget, **common)
        else:
            epochs_per_trial = kt.HyperParameters()
            epochs_per_trial.Fixed("epochs", max_epochs)
            tuner = kt.RandomSearch(build, max_trials=max(1, budget // max_epochs),
                                    hyperparameters=epochs_per_trial, **common)
        tuner.search(x, y, validation_data=validation, epochs=max_epochs, batch_size=64,
                     verbose=0)
        trials = sorted(tuner.oracle.trials.values(), key=lambda t: (len(t.trial_id),
                                                                       t.trial_id))
        return trajectory(trials)


def run_optuna(data, max_epochs, factor, budget, seed):
    import keras
    import keras_tuner as kt
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    (x, y), (x_valid, y_valid) = data
    points, spent = [], [0]

    def objective(trial):
        hp = kt.HyperParameters()
        hp.values = {"filters": trial.suggest_int("filters", 4, 64, step=4),
                     "units": trial.suggest_int("units", 16, 256, step=16),
                     "dropout": trial.suggest_float("dropout", 0.0, 0.7),
                     "lr": trial.suggest_float("lr", 1e-5, 1.0, log=True)}
        model = build(hp)
        best = 0.0
        for epoch in range(max_epochs):
            if spent[0] >= budget:
                break
            history = model.fit(x, y, validation_data=(x_valid, y_valid), batch_size=64,
                                epochs=epoch + 1, initial_epoch=epoch, verbose=0)
            spent[0] += 1
            best = max(best, history.history["val_accuracy"][-1])
            trial.report(best, epoch)
            if trial.should_prune():
                break
        points.append((spent[0], float(max(best, points[-1][1] if points else 0.0))))
        keras.backend.clear_session()
        return best

    study = optuna.create_study(
        direction="maximize", sampler=optuna.samplers.TPESampler(seed=seed),
        pruner=optuna.pruners.HyperbandPruner(min_resource=1, max_resource=max_epochs,
                                              reduction_factor=factor))
    while spent[0] < budget:
        study.optimize(objective, n_trials=1)
    return points


def epochs_to_reach(points, accuracy):
    return next((spent for spent, best in points if best >= accuracy), None)


def best_at(points, epochs):
    """The best accuracy a run had found once it had spent `epochs`."""
    return max([best for spent, best in points if spent <= epochs], default=0.0)


def summarise(runs, budget):
    """Medians over seeds per method, the accuracy each had at a quarter, half,
    three quarters and all of the budget, and the targets."""
    checkpoints = [budget // 4, budget // 2, 3 * budget // 4, budget]
    summary = {}
    for method, method_runs in runs.items():
        reached = [r["epochs_to_hyperband_best"] for r in method_runs]
        summary[method] = {
            "median_best_accuracy": statistics.median(r["best_accuracy"] for r in method_runs),
            "median_best_at_epochs": {
                str(epochs): statistics.median(best_at(r["trajectory"], epochs)
                                               for r in method_runs)
                for epochs in checkpoints},
            "median_epochs": statistics.median(r["epochs"] for r in method_runs),
            "reached_hyperband_best": sum(e is not None for e in reached),
            "median_epochs_to_hyperband_best": (
                statistics.median(e if e is not None else float("inf") for e in reached)),
            "median_seconds": statistics.median(r["seconds"] for r in method_runs)}

    def share(method):
        entry = summary.get(method)
        if entry is None or not np.isfinite(entry["median_epochs_to_hyperband_best"]):
            return None
        return entry["median_epochs_to_hyperband_best"] / budget

    def beats_random(method):
        """Higher median accuracy than random search at each checkpoint."""
        if "kt_random" not in summary or method not in summary:
            return None
        ours, random = (summary[m]["median_best_at_epochs"] for m in (method, "kt_random"))
        return {epochs: bool(ours[epochs] > random[epochs]) for epochs in ours}

    targets = {
        "bohb_reaches_hyperband_best_in_half_the_epochs": (
            None if share("kdist_bohb") is None else bool(share("kdist_bohb") <= 0.5)),
        "bohb_beats_random_at_epochs": beats_random("kdist_bohb"),
        "hyperband_beats_random_at_epochs": beats_random("kt_hyperband"),
    }
    for entry in summary.values():
        value = entry["median_epochs_to_hyperband_best"]
        entry["median_epochs_to_hyperband_best"] = value if np.isfinite(value) else None
    return summary, targets


def merged(paths):
    """One report from the reports of runs over other seeds (run side by side)."""
    reports = []
    for path in paths:
        with open(path) as stream:
            reports.append(json.load(stream))
    settings = {(r["max_epochs"], r["factor"], r["budget_epochs"]) for r in reports}
    if len(settings) != 1:
        raise SystemExit(f"the reports differ in max_epochs, factor or budget: {settings}")
    runs = {}
    for report in reports:
        for method, method_runs in report["runs"].items():
            runs.setdefault(method, []).extend(method_runs)
    seeds = sorted({run["seed"] for method_runs in runs.values() for run in method_runs})
    return dict(reports[0], seeds=seeds, runs=runs)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    # keras-tuner reads a seed of 0 as no seed, so its Hyperband would not repeat.
    parser.add_argument("--first-seed", type=int, default=1)
    parser.add_argument("--threads", type=int, default=0,
                        help="TensorFlow's threads per operation (0: its default)")
    parser.add_argument("--max-epochs", type=int, default=27)
    parser.add_argument("--factor", type=int, default=3)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--merge", nargs="+", metavar="REPORT",
                        help="summarise these reports (runs over other seeds) as one; "
                             "nothing is trained")
    args = parser.parse_args()
    if args.merge:
        report = merged(args.merge)
        report["summary"], report["targets"] = summarise(report["runs"],
                                                         report["budget_epochs"])
        print(json.dumps(report, indent=1))
        return
    methods = args.methods.split(",")
    for method in methods:
        if method not in METHODS:
            parser.error(f"unknown method {method!r}; choose from {METHODS}")
    if "kt_hyperband" not in methods:
        methods.insert(0, "kt_hyperband")  # it sets the budget and the accuracy to reach

    if args.threads:
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(args.threads)
        tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    from kdist.tune.bohb import iteration_epochs

    budget = iteration_epochs(args.max_epochs, args.factor)
    data = digits()
    runs = {method: [] for method in methods}
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        RUN_SEED[0] = seed
        for method in methods:
            started = time.perf_counter()
            if method == "optuna_hyperband":
                points = run_optuna(data, args.max_epochs, args.factor, budget, seed)
            else:
                points = run_keras_tuner(method, data, args.max_epochs, args.factor, budget,
                                         seed)
            runs[method].append({"seed": seed, "epochs": points[-1][0],
                                 "best_accuracy": float(points[-1][1]), "trials": len(points),
                                 "seconds": round(time.perf_counter() - started, 1),
                                 "trajectory": points})
        reference = runs["kt_hyperband"][-1]["best_accuracy"]
        for method in methods:
            run = runs[method][-1]
            run["epochs_to_hyperband_best"] = epochs_to_reach(run["trajectory"], reference)

    summary, targets = summarise(runs, budget)
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    print(json.dumps({"benchmark": "hpo_budget", "seeds": seeds,
                      "max_epochs": args.max_epochs, "factor": args.factor,
                      "budget_epochs": budget, "summary": summary, "targets": targets,
                      "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
