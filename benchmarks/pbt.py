"""Population-based training against random search and BOHB at equal epochs.

    python benchmarks/pbt.py [--task digits|textures] [--seeds 3] [--first-seed 1]
                             [--population 8] [--max-epochs 16] [--interval 2]
                             [--threads 0] [--plot population.png]
                             [--methods kdist_pbt,kdist_pb2,kt_random,kdist_bohb,
                              best_constant,best_cosine]

The `digits` task is hpo_budget.py's: a small CNN on scikit-learn's 8x8 digits (500
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

The `textures` task searches the learning rate alone (log, 1e-3 to 1; plain SGD,
no momentum or dropout), where a schedule is known to matter: ten classes of
generated 16x16 images (a smooth random texture per class, shifted by up to 3
pixels, scaled by 0.5-1.5 and buried in Gaussian noise of 1.5 times its spread;
a tenth of the training labels replaced by random ones), 2000 training, 1000
validation and 1000 test images, and a CNN of two convolutions (16 and 32
filters) and 64 units. Two more methods train by hand, at 9 times one member's
epochs each:

- `best_constant`: the best of nine fixed rates from 0.01 to 1 (log grid);
- `best_cosine`: the best cosine decay from one of those rates to a hundredth of it.

For this task the JSON also gives the test accuracy of each method's best
model (the best member, trial or hand-tuned training at its best epoch).

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
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402

import hpo_budget  # noqa: E402  (the digits split, the seeding and the trajectories)
from pbt_toy import cosine_rate  # noqa: E402  (numpy only)

METHODS = ["kdist_pbt", "kdist_pb2", "kt_random", "kdist_bohb", "best_constant",
           "best_cosine"]
SEARCHES = METHODS[:4]
TASK = ["digits"]
HAND_RATES = np.logspace(-2, 0, 9)


def textures(size=16, label_noise=0.1, seed=0):
    """(train, validation, test) of generated 16x16 textures, 2000/1000/1000."""
    rng = np.random.default_rng(seed)
    frequency = np.hypot(*np.meshgrid(np.fft.fftfreq(size), np.fft.fftfreq(size)))
    spectra = rng.normal(size=(10, size, size)) + 1j * rng.normal(size=(10, size, size))
    templates = np.real(np.fft.ifft2(spectra / (1 + (frequency / 0.12) ** 3)))
    templates = (templates - templates.mean((1, 2), keepdims=True)) / templates.std(
        (1, 2), keepdims=True)

    def sample(count):
        labels = rng.integers(0, 10, count)
        shifts = rng.integers(-3, 4, (count, 2))
        images = np.stack([np.roll(templates[label], tuple(shift), (0, 1))
                           for label, shift in zip(labels, shifts)])
        images = images * rng.uniform(0.5, 1.5, (count, 1, 1))
        images = images + 1.5 * rng.normal(size=images.shape)
        return images.astype("float32")[..., None], labels

    (x, y), validation, test = sample(2000), sample(1000), sample(1000)
    noisy = rng.random(len(y)) < label_noise
    y = np.where(noisy, rng.integers(0, 10, len(y)), y)
    return (x, y), validation, test


def build(hp):
    if TASK[0] == "textures":
        return build_textures(hp)
    return build_digits(hp)


def build_textures(hp, learning_rate=None):
    import keras

    if learning_rate is None:
        learning_rate = hp.Float("learning_rate", 1e-3, 1.0, sampling="log")
        hpo_budget.seed_training({k: v for k, v in hp.values.items()
                                  if not k.startswith("pbt/")})
    model = keras.Sequential([
        keras.Input((16, 16, 1)),
        keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(2),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(2),
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10, activation="softmax")])
    model.compile(keras.optimizers.SGD(learning_rate), "sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    return model


def build_digits(hp):
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

    (x, y), validation = data[:2]
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


def best_model_accuracy(tuner, test):
    """The test accuracy of the search's best model (its best epoch's weights)."""
    model = tuner.get_best_models(1)[0]
    return float(model.evaluate(*test, batch_size=256, verbose=0, return_dict=True)["accuracy"])


def by_hand(method, data, args):
    """The best of HAND_RATES, constant or cosine-decayed to a hundredth, each trained
    once for max_epochs: (best validation accuracy, test accuracy at that epoch,
    epochs spent)."""
    import keras

    (x, y), validation, test = data
    best, best_test = 0.0, 0.0
    epochs = args.max_epochs

    class TestAtEpoch(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.scores = []

        def on_epoch_end(self, epoch, logs=None):
            self.scores.append((logs["val_accuracy"], self.model.evaluate(
                *test, batch_size=256, verbose=0, return_dict=True)["accuracy"]))

    for start in HAND_RATES:
        hpo_budget.seed_training({"learning_rate": float(start)})
        model = build_textures(None, learning_rate=float(start))
        scores = TestAtEpoch()
        callbacks = [scores]
        if method == "best_cosine":
            callbacks.append(keras.callbacks.LearningRateScheduler(
                lambda epoch, _, start=float(start): cosine_rate(epoch, epochs, start)))
        model.fit(x, y, validation_data=validation, batch_size=64, epochs=epochs, verbose=0,
                  callbacks=callbacks)
        valid, tested = max(scores.scores, key=lambda score: score[0])
        if valid > best:
            best, best_test = float(valid), float(tested)
    return best, best_test, epochs * len(HAND_RATES)


def replay(tuner, data, args):
    """A new model trained for max_epochs with PBT's learned schedule; its best
    validation accuracy."""
    import keras_tuner as kt

    import kdist.tune

    (x, y), validation = data[:2]
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
    summary = {}
    for method, method_runs in runs.items():
        if not method_runs or method == "replayed":
            continue
        accuracies = [r["best_accuracy"] for r in method_runs]
        summary[method] = {"median_best_accuracy": statistics.median(accuracies),
                           "range": [min(accuracies), max(accuracies)],
                           "median_seconds": statistics.median(r["seconds"]
                                                               for r in method_runs)}
        if "trajectory" in method_runs[0]:
            summary[method]["median_best_at_epochs"] = {str(e): statistics.median(
                hpo_budget.best_at(r["trajectory"], e) for r in method_runs)
                for e in checkpoints}
        if "test_accuracy" in method_runs[0]:
            tests = [r["test_accuracy"] for r in method_runs]
            summary[method]["median_test_accuracy"] = statistics.median(tests)
            summary[method]["test_range"] = [min(tests), max(tests)]
    if runs.get("replayed"):
        summary["replayed"] = {"median_best_accuracy": statistics.median(
            r["best_accuracy"] for r in runs["replayed"])}
    return summary


def progress(run, method):
    """One line on stderr per run: a seed takes minutes, and stdout is the JSON."""
    print(f"pbt.py: seed {run['seed']} {method}: best validation accuracy "
          f"{run['best_accuracy']:.3f}, {run['seconds']:.0f} s", file=sys.stderr, flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=["digits", "textures"], default="digits")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--first-seed", type=int, default=1)
    parser.add_argument("--population", type=int, default=8)
    parser.add_argument("--max-epochs", type=int, default=16)
    parser.add_argument("--interval", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0,
                        help="TensorFlow's threads per operation (0: its default)")
    parser.add_argument("--methods", help="a comma-separated list (default: the four "
                        "searches for digits, all six for textures)")
    parser.add_argument("--plot", help="draw the first seed's PBT population here")
    args = parser.parse_args()
    TASK[0] = args.task
    available = METHODS if args.task == "textures" else SEARCHES
    methods = args.methods.split(",") if args.methods else available
    for method in methods:
        if method not in available:
            parser.error(f"unknown method {method!r} for --task {args.task}; "
                         f"choose from {available}")
    if args.max_epochs % args.interval:
        parser.error("--max-epochs must be a multiple of --interval")
    if args.threads:
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(args.threads)
        tf.config.threading.set_inter_op_parallelism_threads(args.threads)

    data = textures() if args.task == "textures" else hpo_budget.digits()
    budget = args.population * args.max_epochs
    runs = {method: [] for method in methods}
    runs["replayed"] = []
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        hpo_budget.RUN_SEED[0] = seed
        for method in methods:
            started = time.perf_counter()
            if method.startswith("best_"):
                valid, tested, epochs = by_hand(method, data, args)
                runs[method].append({"seed": seed, "epochs": epochs, "best_accuracy": valid,
                                     "test_accuracy": tested, "trials": len(HAND_RATES),
                                     "seconds": round(time.perf_counter() - started, 1)})
                progress(runs[method][-1], method)
                continue
            with tempfile.TemporaryDirectory() as directory:
                tuner, points = run(method, data, args, seed, directory)
                runs[method].append({"seed": seed, "epochs": points[-1][0],
                                     "best_accuracy": points[-1][1], "trials": len(points),
                                     "seconds": round(time.perf_counter() - started, 1),
                                     "trajectory": points})
                if len(data) == 3:
                    runs[method][-1]["test_accuracy"] = best_model_accuracy(tuner, data[2])
                progress(runs[method][-1], method)
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
    print(json.dumps({"benchmark": "pbt", "task": args.task, "budget_epochs": budget,
                      "population": args.population,
                      "max_epochs": args.max_epochs, "interval": args.interval,
                      "seeds": list(range(args.first_seed, args.first_seed + args.seeds)),
                      "summary": summary, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
