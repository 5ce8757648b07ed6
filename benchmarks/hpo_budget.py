"""Budget-aware search on a real Keras task: epochs needed to reach a validation accuracy.

    python benchmarks/hpo_budget.py [--seeds 3] [--max-epochs 27] [--factor 3]
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

Each trial's score is its best epoch's validation accuracy. For each run the
JSON gives the best accuracy, the epochs it took, and the epochs each method
needed to reach keras-tuner Hyperband's best accuracy of the same seed
(`epochs_to_hyperband_best`, null if never); the medians over seeds go in
`summary`. Target: kdist BOHB reaches Hyperband's best in at most half of
Hyperband's epochs, and BOHB and Hyperband both beat random search at E.
"""

import argparse
import contextlib
import io
import json
import os
import statistics
import tempfile
import time

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


def build(hp):
    import keras

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


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--max-epochs", type=int, default=27)
    parser.add_argument("--factor", type=int, default=3)
    parser.add_argument("--methods", default=",".join(METHODS))
    args = parser.parse_args()
    methods = args.methods.split(",")
    for method in methods:
        if method not in METHODS:
            parser.error(f"unknown method {method!r}; choose from {METHODS}")
    if "kt_hyperband" not in methods:
        methods.insert(0, "kt_hyperband")  # it sets the budget and the accuracy to reach

    from kdist.tune.bohb import iteration_epochs

    budget = iteration_epochs(args.max_epochs, args.factor)
    data = digits()
    runs = {method: [] for method in methods}
    for seed in range(args.seeds):
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

    summary = {}
    for method in methods:
        reached = [r["epochs_to_hyperband_best"] for r in runs[method]]
        summary[method] = {
            "median_best_accuracy": statistics.median(r["best_accuracy"] for r in runs[method]),
            "median_epochs": statistics.median(r["epochs"] for r in runs[method]),
            "reached_hyperband_best": sum(e is not None for e in reached),
            "median_epochs_to_hyperband_best": (
                statistics.median(e if e is not None else float("inf") for e in reached)),
            "median_seconds": statistics.median(r["seconds"] for r in runs[method])}

    def share(method):
        entry = summary.get(method)
        if entry is None or not np.isfinite(entry["median_epochs_to_hyperband_best"]):
            return None
        return entry["median_epochs_to_hyperband_best"] / budget

    random_best = summary.get("kt_random", {}).get("median_best_accuracy")
    targets = {
        "bohb_reaches_hyperband_best_in_half_the_epochs": (
            None if share("kdist_bohb") is None else bool(share("kdist_bohb") <= 0.5)),
        "bohb_beats_random": None if random_best is None or "kdist_bohb" not in summary else (
            bool(summary["kdist_bohb"]["median_best_accuracy"] > random_best)),
        "hyperband_beats_random": None if random_best is None else (
            bool(summary["kt_hyperband"]["median_best_accuracy"] > random_best)),
    }
    for entry in summary.values():
        value = entry["median_epochs_to_hyperband_best"]
        entry["median_epochs_to_hyperband_best"] = value if np.isfinite(value) else None
    print(json.dumps({"benchmark": "hpo_budget", "seeds": args.seeds,
                      "max_epochs": args.max_epochs, "factor": args.factor,
                      "budget_epochs": budget, "summary": summary, "targets": targets,
                      "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
