"""Population-based training against random search and BOHB at equal epochs.

    python benchmarks/pbt.py [--seeds 3] [--first-seed 1] [--population 8]
                             [--max-epochs 16] [--interval 2] [--threads 0]
                             [--methods kdist_pbt,kdist_pb2,kt_random,kdist_bohb]
                             [--plot population.png]

The task is hpo_budget.py's: a small CNN on scikit-learn's 8x8 digits (500
training, 500 validation images), here with a fixed shape (16 filters, 64
units) so that PBT can hand weights between members, and plain SGD so that
the learning rate's course matters. Searched: a log-scaled learning rate
(1e-3 to 1), momentum (0 to 0.95) and dropout (0 to 0.7). The budget is
E = population x max_epochs epochs for every method:

- `kdist_pbt`: `kdist.tune.PBT`, the population trained for max_epochs,
  exploiting and exploring every `interval` epochs;
- `kdist_pb2`: the same with `explore="pb2"`;
- `kt_random`: keras-tuner's random search, population trials of max_epochs;
- `kdist_bohb`: `kdist.tune.BOHB` with max_epochs and factor 2, stopped at E.

A random or BOHB trial keeps a constant configuration, so the best of them
is the best fixed schedule the searches found. `replayed` trains a new model
for max_epochs with PBT's learned schedule (`ScheduleReplay`), once per seed.

Scores are validation accuracy as keras-tuner records it: a PBT round's at
its end, a random or BOHB trial's at its best epoch (which favours them a
little). For each run the JSON gives the best accuracy found after a
quarter, half and all of E; `summary` holds the medians over seeds.
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

import hpo_budget  # noqa: E402  (the digits split, the seeding and the trajectories)

METHODS = ["kdist_pbt", "kdist_pb2", "kt_random", "kdist_bohb"]


def build(hp):
    import keras

    hpo_budget.seed_training({k: v for k, v in hp.values.items() if not k.startswith("pbt/")})
    model = keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(2),
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dropout(hp.Float("dropout", 0.0, 0.7)),
        keras.layers.Dense(10, activation="softmax")])
    model.compile(keras.optimizers.SGD(hp.Float("learning_rate", 1e-3, 1.0, sampling="log"),
                                       momentum=hp.Float("momentum", 0.0, 0.95)),
                  "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def run(method, data, args, seed, directory):
    import keras_tuner as kt

    import kdist.tune

    (x, y), validation = data
    budget = args.population * args.max_epochs
    common = dict(objective=kt.Objective("val_accuracy", "max"), seed=seed,
                  directory=directory, project_name=method)
    fit = dict(validation_data=validation, batch_size=64, verbose=0)
    if method in ("kdist_pbt", "kdist_pb2"):
        tuner = kdist.tune.PBT(build, population_size=args.population,
                               perturbation_interval=args.interval,
                               max_epochs=args.max_epochs,
                               explore="pb2" if method == "kdist_pb2" else None, **common)
    elif method == "kdist_bohb":
        tuner = kdist.tune.BOHB(build, max_epochs=args.max_epochs, factor=2, budget=budget,
                                **common)
        fit["epochs"] = args.max_epochs
    else:
        epochs = kt.HyperParameters()
        epochs.Fixed("epochs", args.max_epochs)
        tuner = kt.RandomSearch(build, max_trials=args.population, hyperparameters=epochs,
                                **common)
        fit["epochs"] = args.max_epochs
    with contextlib.redirect_stdout(io.StringIO()):
        tuner.search(x, y, **fit)
    trials = sorted(tuner.oracle.trials.values(), key=lambda t: (len(t.trial_id), t.trial_id))
    return tuner, hpo_budget.trajectory(trials)


def replay(tuner, data, args):
    """A new model trained for max_epochs with PBT's learned schedule; its best
    validation accuracy."""
    import keras_tuner as kt

    import kdist.tune

    (x, y), validation = data
    schedule = tuner.learned_schedule()
    hp = kt.HyperParameters()
    hp.values = dict(schedule[0]["values"])
    model = build(hp)
    history = model.fit(x, y, validation_data=validation, batch_size=64, verbose=0,
                        epochs=args.max_epochs,
                        callbacks=[kdist.tune.ScheduleReplay(schedule)])
    return float(max(history.history["val_accuracy"])), schedule


def summarise(runs, budget):
    checkpoints = [budget // 4, budget // 2, budget]
    summary = {method: {
        "median_best_at_epochs": {str(e): statistics.median(
            hpo_budget.best_at(r["trajectory"], e) for r in method_runs) for e in checkpoints},
        "median_seconds": statistics.median(r["seconds"] for r in method_runs)}
        for method, method_runs in runs.items() if method_runs and method != "replayed"}
    if runs.get("replayed"):
        summary["replayed"] = {"median_best_accuracy": statistics.median(
            r["best_accuracy"] for r in runs["replayed"])}
    return summary


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--first-seed", type=int, default=1)
    parser.add_argument("--population", type=int, default=8)
    parser.add_argument("--max-epochs", type=int, default=16)
    parser.add_argument("--interval", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0,
                        help="TensorFlow's threads per operation (0: its default)")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--plot", help="draw the first seed's PBT population here")
    args = parser.parse_args()
    methods = args.methods.split(",")
    for method in methods:
        if method not in METHODS:
            parser.error(f"unknown method {method!r}; choose from {METHODS}")
    if args.max_epochs % args.interval:
        parser.error("--max-epochs must be a multiple of --interval")
    if args.threads:
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(args.threads)
        tf.config.threading.set_inter_op_parallelism_threads(args.threads)

    data = hpo_budget.digits()
    budget = args.population * args.max_epochs
    runs = {method: [] for method in methods}
    runs["replayed"] = []
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        hpo_budget.RUN_SEED[0] = seed
        for method in methods:
            started = time.perf_counter()
            with tempfile.TemporaryDirectory() as directory:
                tuner, points = run(method, data, args, seed, directory)
                runs[method].append({"seed": seed, "epochs": points[-1][0],
                                     "best_accuracy": points[-1][1], "trials": len(points),
                                     "seconds": round(time.perf_counter() - started, 1),
                                     "trajectory": points})
                if method != "kdist_pbt":
                    continue
                if args.plot and seed == args.first_seed:
                    import kdist.tune

                    kdist.tune.plot_population(tuner.oracle, args.plot)
                started = time.perf_counter()
                accuracy, schedule = replay(tuner, data, args)
                runs["replayed"].append({
                    "seed": seed, "best_accuracy": accuracy, "schedule": schedule,
                    "seconds": round(time.perf_counter() - started, 1)})
    summary = summarise(runs, budget)
    print(json.dumps({"budget_epochs": budget, "population": args.population,
                      "max_epochs": args.max_epochs, "interval": args.interval,
                      "seeds": list(range(args.first_seed, args.first_seed + args.seeds)),
                      "summary": summary, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
