"""Updates and wall time to a target accuracy: synchronous allreduce vs Downpour, EASGD, GEM.

    python benchmarks/ps_convergence.py [--workers 4] [--target 0.92] [--task teacher]
                                        [--methods allreduce,downpour,easgd,gem]

Each method trains the same MLP on the same generated classification task
with `--workers` training processes (the parameter-server runs add one
master), each on its shard with batches of 32. Per epoch, the model that
counts (rank 0's replica for allreduce, the central model otherwise) is
validated; the table reports, for the first epoch that reaches `--target`
validation accuracy, the wall time since training began, the updates applied
(synchronous steps, or the master's applied updates), and the staleness the
master saw. Every method compiles SGD at 0.01 but allreduce, which averages
and so scales it with the number of workers, as is common practice. EASGD
runs with its defaults (its workers' steps stretched by the number of
workers, `elastic_step_scale`) and an exchange every 4 steps. The `easgd_*`
methods (not run by default) show what EASGD's settings do: an exchange
every step (`p1`); the learning rate scaled instead of the steps (`lr`);
each worker stepping as compiled (`same_lr`), exchanging every 4 steps or
every step (`p1`), with an elastic force of 0.9 (`f09`). `--task teacher`
labels the rows with a random two-layer tanh network instead of a noisy
linear rule. Prints one JSON object.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
BASE_LR = 0.01
METHODS = {
    "allreduce": {"lr_scale": "workers"},
    "downpour": {},
    "easgd": {"sync_every": 4},
    "gem": {},
    "easgd_p1": {"sync_every": 1},
    "easgd_lr": {"lr_scale": "workers", "step_scale": 1, "sync_every": 4},
    "easgd_same_lr": {"step_scale": 1, "sync_every": 4},
    "easgd_same_lr_p1": {"step_scale": 1, "sync_every": 1},
    "easgd_same_lr_p1_f09": {"step_scale": 1, "sync_every": 1, "elastic_force": 0.9},
}
DEFAULT_METHODS = ["allreduce", "downpour", "easgd", "gem"]


def task(kind="linear", seed=11, rows=8192, inputs=20, classes=4):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows + 2048, inputs)).astype("float32")
    if kind == "teacher":
        hidden = np.tanh(x @ (rng.normal(size=(inputs, 32)) / np.sqrt(inputs)))
        y = np.argmax(hidden @ (rng.normal(size=(32, classes)) / np.sqrt(32)), axis=-1)
    else:
        w = rng.normal(size=(inputs, classes))
        y = np.argmax(x @ w + 0.5 * rng.normal(size=(len(x), classes)), axis=-1)
    y = y.astype("int64")
    return (x[:rows], y[:rows]), (x[rows:], y[rows:])


def child(method, epochs, workers, kind):
    from _mlp import one_thread

    one_thread()
    import keras

    import kdist

    kdist.init()
    settings = METHODS[method]
    scale = workers if settings.get("lr_scale") == "workers" else 1
    (x, y), (xv, yv) = task(kind)
    strategy = None
    if method != "allreduce":
        strategy = kdist.ps.ParameterServerStrategy(
            mode=method.split("_")[0], sync_every=settings.get("sync_every", 1),
            elastic_force=settings.get("elastic_force", 0.5),
            elastic_step_scale=settings.get("step_scale", "workers"))

    def build():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((20,)), keras.layers.Dense(64, activation="relu"),
                                  keras.layers.Dense(64, activation="relu"),
                                  keras.layers.Dense(4)])
        optimizer = keras.optimizers.SGD(BASE_LR * scale)
        if strategy is None:
            optimizer = kdist.DistributedOptimizer(optimizer)
        model.compile(optimizer=optimizer, metrics=["accuracy"],
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    records = []

    class Record(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.started = time.perf_counter()
            self.steps = 0

        def on_train_batch_end(self, batch, logs=None):
            self.steps += 1

        def on_epoch_end(self, epoch, logs=None):
            if strategy is None:
                accuracy = self.model.evaluate(xv, yv, verbose=0, return_dict=True)["accuracy"]
                stats = {"updates": self.steps, "staleness_mean": 0.0, "staleness_max": 0}
            else:
                accuracy = logs["val_accuracy"]
                stats = strategy.epoch_stats[-1]
            records.append({"epoch": epoch + 1, "val_accuracy": float(accuracy),
                            "seconds": time.perf_counter() - self.started,
                            "updates": stats["updates"],
                            "staleness_mean": stats["staleness_mean"],
                            "staleness_max": stats["staleness_max"]})

    if strategy is None:
        model = build()
        shard = slice(kdist.rank(), None, kdist.size())
        callbacks = [kdist.callbacks.BroadcastGlobalVariablesCallback(0)]
        if kdist.rank() == 0:
            callbacks.append(Record())
        model.fit(x[shard], y[shard], batch_size=32, epochs=epochs, verbose=0, shuffle=False,
                  callbacks=callbacks)
    else:
        with strategy.scope():
            model = build()
        model.fit(x, y, batch_size=32, epochs=epochs, verbose=0, shuffle=False,
                  validation_data=(xv, yv), callbacks=[Record()] if strategy.is_master else [])
    if kdist.rank() == 0:
        print("RESULT " + json.dumps({"method": method, "records": records}), flush=True)


def run(method, epochs, workers, kind):
    sys.path.insert(0, os.path.dirname(HERE))
    from kdist.cli import mpiexec_command

    ranks = workers if method == "allreduce" else workers + 1
    command = [sys.executable, "-u", os.path.abspath(__file__), "--child", method,
               "--epochs", str(epochs), "--workers", str(workers), "--task", kind]
    argv, env = mpiexec_command(ranks, command)
    env.update({"TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": os.pathsep.join(
        [HERE, os.path.dirname(HERE), env.get("PYTHONPATH", "")])})
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=1800)
    found = re.findall(r"^RESULT (.*)$", done.stdout, re.M)
    if done.returncode != 0 or not found:
        raise SystemExit(f"{method} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads(found[0])["records"]


def summarise(records, target):
    for record in records:
        if record["val_accuracy"] >= target:
            return dict(record, reached=True)
    return dict(records[-1], reached=False)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--methods", default=",".join(DEFAULT_METHODS))
    parser.add_argument("--task", choices=["linear", "teacher"], default="linear")
    parser.add_argument("--child")
    args = parser.parse_args()
    if args.child:
        child(args.child, args.epochs, args.workers, args.task)
        return
    table = {}
    for method in args.methods.split(","):
        if method not in METHODS:
            raise SystemExit(f"Unknown method {method!r}; choose from {', '.join(METHODS)}.")
        records = run(method, args.epochs, args.workers, args.task)
        table[method] = {"to_target": summarise(records, args.target), "epochs": records,
                         "settings": METHODS[method]}
    print(json.dumps({"workers": args.workers, "task": args.task,
                      "target_val_accuracy": args.target,
                      "base_learning_rate": BASE_LR, "methods": table}, indent=1))


if __name__ == "__main__":
    main()
