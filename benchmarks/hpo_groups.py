"""Wall time of the same distributed search with 1 and with 2 groups evaluating trials.

    python benchmarks/hpo_groups.py [--trials 16] [--epochs 4]

Runs a `KFoldTuner` search (3 folds) of a small MLP on scikit-learn's digits
with `kdist.tune.BayesianOracle`, first on 2 ranks (the oracle and 1 group),
then on 3 ranks (the oracle and 2 groups), one thread per rank, and times each
whole job from launch to exit. `ratio` is the 2-group time over the 1-group
time (0.5 is perfect; the target is <= 0.6). Prints one JSON object.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def worker(args):
    sys.path.insert(0, HERE)
    from _mlp import one_thread

    one_thread()
    import keras
    import keras_tuner as kt
    from sklearn.datasets import load_digits

    import kdist
    import kdist.tune

    kdist.init()
    digits = load_digits()
    x = (digits.images.reshape(-1, 64) / 16.0).astype("float32")
    y = digits.target.astype("int64")

    def build(hp):
        model = keras.Sequential([
            keras.Input((64,)),
            keras.layers.Dense(hp.Int("units", 32, 256, step=32), activation="relu"),
            keras.layers.Dense(10, activation="softmax")])
        model.compile(keras.optimizers.Adam(hp.Float("lr", 1e-4, 1e-1, sampling="log")),
                      "sparse_categorical_crossentropy", metrics=["accuracy"])
        return model

    oracle = kdist.tune.BayesianOracle(objective=kt.Objective("val_accuracy", "max"),
                                       max_trials=args.trials, seed=0)
    tuner = kdist.tune.KFoldTuner(build, oracle=oracle, folds=3, directory=args.directory,
                                  project_name="groups", overwrite=True)
    tuner.search(x, y, epochs=args.epochs, batch_size=64, verbose=0)
    if kdist.rank() == 0:
        done = sum(t.status == "COMPLETED" for t in tuner.oracle.trials.values())
        print(json.dumps({"completed": done}), flush=True)


def run(ranks, args):
    from kdist.cli import mpiexec_command

    with tempfile.TemporaryDirectory() as directory:
        command = [sys.executable, os.path.abspath(__file__), "--worker", "--trials",
                   str(args.trials), "--epochs", str(args.epochs), "--directory", directory]
        argv, env = mpiexec_command(ranks, command)
        env["TF_CPP_MIN_LOG_LEVEL"] = "3"
        started = time.perf_counter()
        done = subprocess.run(argv, capture_output=True, text=True, env=env)
        seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"{ranks}-rank search failed:\n{done.stdout[-3000:]}"
                           f"{done.stderr[-3000:]}")
    completed = [json.loads(line) for line in done.stdout.splitlines()
                 if line.startswith('{"completed"')]
    return seconds, completed[-1]["completed"] if completed else None


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--directory", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    one, one_done = run(2, args)
    two, two_done = run(3, args)
    print(json.dumps({"benchmark": "hpo_groups", "trials": args.trials, "epochs": args.epochs,
                      "seconds": {"1_group": one, "2_groups": two},
                      "completed": {"1_group": one_done, "2_groups": two_done},
                      "ratio": two / one, "target_met": two / one <= 0.6}, indent=1))


if __name__ == "__main__":
    main()
