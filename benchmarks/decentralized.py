"""Allreduce, parameter server and gossip on one task: accuracy, time, bytes, stragglers.

    python benchmarks/decentralized.py [--workers 4,8] [--epochs 10] [--straggler both]

Every method trains the same MLP (20-64-64-4, 5.8k parameters) on the same
generated classification task as `ps_convergence.py`, `--workers` training
processes each on its shard with batches of 32, for the same number of
epochs; the parameter-server modes add one master. Afterwards the model that
counts (rank 0's replica for allreduce, the central model for the parameter
server, the final mean of the replicas for gossip) is validated.

With `--straggler on` the last worker sleeps, after every step, twice the
step time the first worker had in the same method without a straggler: it
runs at a third of the others' pace. A synchronous method holds every
worker to that pace; an asynchronous one should not. The column that shows it
is the first worker's steps per second while it trains (the job as a whole
still ends when the straggler has done its epochs, whatever the method).

Bytes are those one worker sends per step: for allreduce the ring algorithm's
2 (n - 1) / n copies of the weights, for Downpour and EASGD one copy up per
exchange (the master's copy down is the same size again), for gossip what the
rank actually sent to its neighbours (`GossipAveraging.bytes_sent`).
Prints one JSON object, and the table as markdown on stderr.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from ps_convergence import BASE_LR, task  # noqa: E402

METHODS = {
    "allreduce": {},
    "downpour": {"sync_every": 1},
    "easgd": {"sync_every": 4, "elastic_force": 0.5},
    "gossip-ring": {"topology": "ring", "period": 1},
    "gossip-torus": {"topology": "torus", "period": 1},
    "gossip-ring-async": {"topology": "ring", "period": 1, "asynchronous": True},
    "gossip-torus-async": {"topology": "torus", "period": 1, "asynchronous": True},
    # Averaging every 8th step sends what EASGD sends (one copy per 4 steps, both ways).
    "gossip-ring-p8": {"topology": "ring", "period": 8},
    "gossip-ring-async-p8": {"topology": "ring", "period": 8, "asynchronous": True},
}
# Averaging methods see each worker's gradient scaled down by the number of workers
# (EASGD makes up for it itself: its workers' steps are stretched by their number).
SCALED = {"allreduce"} | {m for m in METHODS if m.startswith("gossip")}


def child(method, epochs, workers, delay):
    from _mlp import one_thread

    one_thread()
    import keras
    import numpy as np

    import kdist
    from kdist.gossip import GossipAveraging

    kdist.init()
    settings = METHODS[method]
    (x, y), (xv, yv) = task()
    strategy = gossip = None
    if method in ("downpour", "easgd"):
        strategy = kdist.ps.ParameterServerStrategy(
            mode=method, sync_every=settings["sync_every"],
            elastic_force=settings.get("elastic_force", 0.5))
        worker = strategy.worker_index if strategy.is_worker else None
    else:
        worker = kdist.rank()
    last_worker = workers - 1

    def build():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((20,)), keras.layers.Dense(64, activation="relu"),
                                  keras.layers.Dense(64, activation="relu"),
                                  keras.layers.Dense(4)])
        optimizer = keras.optimizers.SGD(BASE_LR * (workers if method in SCALED else 1))
        if method == "allreduce":
            optimizer = kdist.DistributedOptimizer(optimizer)
        model.compile(optimizer=optimizer, metrics=["accuracy"],
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    class Straggle(keras.callbacks.Callback):
        """Sleeps `delay` seconds after each step."""

        def on_train_batch_end(self, batch, logs=None):
            time.sleep(delay)

    class Pace(keras.callbacks.Callback):
        """This worker's steps per second from its second epoch (the first traces) on."""

        def on_epoch_begin(self, epoch, logs=None):
            if epoch == min(1, epochs - 1):
                self.began, self.steps = time.perf_counter(), 0

        def on_train_batch_end(self, batch, logs=None):
            if hasattr(self, "began"):
                self.steps += 1
                self.ended = time.perf_counter()

    pace = Pace()
    callbacks = []
    if worker == 0:
        callbacks.append(pace)
    if delay and worker == last_worker:
        callbacks.append(Straggle())
    started = time.perf_counter()
    if strategy is not None:
        with strategy.scope():
            model = build()
        history = strategy.fit(model, x, y, batch_size=32, epochs=epochs, verbose=0,
                               shuffle=False, validation_data=(xv, yv),
                               worker_callbacks=callbacks)
        accuracy = history.history["val_accuracy"][-1] if strategy.is_master else None
    else:
        model = build()
        shard = slice(kdist.rank(), None, kdist.size())
        callbacks.insert(0, kdist.callbacks.BroadcastGlobalVariablesCallback(0))
        if method.startswith("gossip"):
            gossip = GossipAveraging(settings["topology"], period=settings["period"],
                                     asynchronous=settings.get("asynchronous", False),
                                     final_average=True, consensus_every=0)
            callbacks.append(gossip)
        model.fit(x[shard], y[shard], batch_size=32, epochs=epochs, verbose=0, shuffle=False,
                  callbacks=callbacks)
        accuracy = model.evaluate(xv, yv, verbose=0, return_dict=True)["accuracy"]
    seconds = time.perf_counter() - started
    if worker == 0:
        parameters = sum(int(np.prod(w.shape)) for w in model.trainable_weights)
        copy = 4 * parameters
        if method == "allreduce":
            sent = 2 * (workers - 1) / workers * copy
        elif strategy is not None:
            sent = copy / settings["sync_every"]
        else:
            sent = gossip.bytes_sent / (epochs * len(range(0, len(x[shard]), 32)))
        print("PACE " + json.dumps({"steps_per_second": pace.steps / (pace.ended - pace.began),
                                    "steps": pace.steps, "bytes_per_step": sent,
                                    "parameters": parameters}), flush=True)
    if accuracy is not None and kdist.rank() == 0:
        print("RESULT " + json.dumps({"val_accuracy": float(accuracy), "seconds": seconds}),
              flush=True)


def run(method, epochs, workers, delay=0.0):
    sys.path.insert(0, os.path.dirname(HERE))
    from kdist.cli import mpiexec_command

    ranks = workers + (1 if method in ("downpour", "easgd") else 0)
    command = [sys.executable, "-u", os.path.abspath(__file__), "--child", method,
               "--epochs", str(epochs), "--workers", str(workers)]
    if delay:
        command += ["--delay", str(delay)]
    argv, env = mpiexec_command(ranks, command)
    env.update({"TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": os.pathsep.join(
        [HERE, os.path.dirname(HERE), env.get("PYTHONPATH", "")])})
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=1800)
    result = re.findall(r"RESULT (.*)$", done.stdout, re.M)
    pace = re.findall(r"PACE (.*)$", done.stdout, re.M)
    if done.returncode != 0 or not result or not pace:
        raise SystemExit(f"{method} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return dict(json.loads(result[0]), **json.loads(pace[0]))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", default="4,8")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--straggler", choices=["off", "on", "both"], default="both")
    parser.add_argument("--child")
    parser.add_argument("--delay", type=float, default=0.0)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.epochs, int(args.workers), args.delay)
        return
    methods = args.methods.split(",")
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise SystemExit(f"Unknown method(s) {unknown}; choose from {', '.join(METHODS)}.")
    cases = {"off": ["off"], "on": ["on"], "both": ["off", "on"]}[args.straggler]
    rows = []
    for workers in (int(w) for w in args.workers.split(",")):
        for method in methods:
            calm = run(method, args.epochs, workers)
            found = []
            if "off" in cases:
                found.append(dict(calm, straggler=False))
            if "on" in cases:
                # Two more of the calm run's steps: the straggler's pace is a third of it.
                delay = 2 / calm["steps_per_second"]
                slow = run(method, args.epochs, workers, delay)
                found.append(dict(slow, straggler=True, delay=delay,
                                  pace_kept=slow["steps_per_second"] / calm["steps_per_second"]))
            for row in found:
                rows.append(dict(row, workers=workers, method=method,
                                 settings=METHODS[method]))
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(json.dumps({"epochs": args.epochs, "base_learning_rate": BASE_LR, "rows": rows},
                     indent=1))
    print("| workers | method | straggler | val accuracy | wall s | worker 0 steps/s | "
          "pace kept | kB sent / step |\n|---|---|---|---|---|---|---|---|", file=sys.stderr)
    for row in rows:
        kept = f"{row['pace_kept']:.2f}" if "pace_kept" in row else ""
        print(f"| {row['workers']} | {row['method']} | {'yes' if row['straggler'] else 'no'} | "
              f"{row['val_accuracy']:.3f} | {row['seconds']:.1f} | "
              f"{row['steps_per_second']:.0f} | {kept} | {row['bytes_per_step'] / 1e3:.1f} |",
              file=sys.stderr)


if __name__ == "__main__":
    main()
