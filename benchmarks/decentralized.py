"""Allreduce, parameter server and gossip on one task: accuracy, time, bytes, stragglers.

    python benchmarks/decentralized.py [--workers 4,8] [--epochs 10] [--straggler both]
        [--width 64] [--link-gbit G --target 0.8]

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
`--width` sets both hidden layers (512: 0.27M parameters). With `--link-gbit G` (root)
the workers are spread over two hosts emulated as network namespaces whose link is
limited to G Gbit/s (as in `network.py`; the parameter server's master shares the first
host with a worker), and each row gains the validation accuracy after every epoch with
its wall time and `seconds_to_target`: when the accuracy first reached `--target`.
`allreduce-fp16` and `allreduce-topk` (1 % of the entries, error feedback) compress the
allreduce.

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
    "allreduce-fp16": {"compression": "fp16"},
    "allreduce-topk": {"compression": "topk", "ratio": 0.01},
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
SCALED = {m for m in METHODS if m.startswith(("allreduce", "gossip"))}


def child(method, epochs, workers, delay, width=64, link=False):
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
        model = keras.Sequential([keras.Input((20,)),
                                  keras.layers.Dense(width, activation="relu"),
                                  keras.layers.Dense(width, activation="relu"),
                                  keras.layers.Dense(4)])
        optimizer = keras.optimizers.SGD(BASE_LR * (workers if method in SCALED else 1))
        if method.startswith("allreduce"):
            compression = {"fp16": kdist.Compression.fp16,
                           "topk": kdist.Compression.topk(settings.get("ratio", 0.01))}.get(
                settings.get("compression"), kdist.Compression.none)
            optimizer = kdist.DistributedOptimizer(optimizer, compression=compression)
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

    class Curve(keras.callbacks.Callback):
        """Validation accuracy of `self.model` after every epoch, with the wall time."""

        def __init__(self):
            super().__init__()
            self.points = []

        def on_epoch_end(self, epoch, logs=None):
            logs = logs or {}
            accuracy = logs.get("val_accuracy")
            if accuracy is None:
                accuracy = self.model.evaluate(xv, yv, verbose=0, return_dict=True)["accuracy"]
            self.points.append([round(time.perf_counter() - started, 3), float(accuracy)])

    pace = Pace()
    curve = Curve()
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
                               worker_callbacks=callbacks, callbacks=[curve])
        accuracy = history.history["val_accuracy"][-1] if strategy.is_master else None
    else:
        model = build()
        shard = slice(kdist.rank(), None, kdist.size())
        callbacks.insert(0, kdist.callbacks.BroadcastGlobalVariablesCallback(0))
        if kdist.rank() == 0:
            callbacks.append(curve)
        if method.startswith("gossip"):
            gossip = GossipAveraging(settings["topology"], period=settings["period"],
                                     asynchronous=settings.get("asynchronous", False),
                                     final_average=True, consensus_every=0)
            callbacks.append(gossip)
        model.fit(x[shard], y[shard], batch_size=32, epochs=epochs, verbose=0, shuffle=False,
                  callbacks=callbacks)
        accuracy = model.evaluate(xv, yv, verbose=0, return_dict=True)["accuracy"]
    seconds = time.perf_counter() - started
    import socket

    hosts = kdist.allgather_object(socket.gethostname())
    if worker == 0 and link and len(set(hosts)) < 2:
        raise SystemExit(f"the ranks were meant to span two hosts but ran on {hosts}")
    if worker == 0:
        parameters = sum(int(np.prod(w.shape)) for w in model.trainable_weights)
        copy = 4 * parameters
        if method.startswith("allreduce"):
            # fp16 halves the bytes; top-k sends indices and values of its share.
            share = {"fp16": 0.5, "topk": 2 * settings.get("ratio", 0.01)}.get(
                settings.get("compression"), 1.0)
            sent = 2 * (workers - 1) / workers * copy * share
        elif strategy is not None:
            sent = copy / settings["sync_every"]
        else:
            sent = gossip.bytes_sent / (epochs * len(range(0, len(x[shard]), 32)))
        print("PACE " + json.dumps({"steps_per_second": pace.steps / (pace.ended - pace.began),
                                    "steps": pace.steps, "bytes_per_step": sent,
                                    "parameters": parameters, "hosts": hosts}), flush=True)
    if accuracy is not None and kdist.rank() == 0:
        print("RESULT " + json.dumps({"val_accuracy": float(accuracy), "seconds": seconds,
                                      "curve": curve.points}), flush=True)


def run(method, epochs, workers, delay=0.0, width=64, link_gbit=None):
    sys.path.insert(0, os.path.dirname(HERE))
    from kdist.cli import mpiexec_command

    ranks = workers + (1 if method in ("downpour", "easgd") else 0)
    command = [sys.executable, "-u", os.path.abspath(__file__), "--child", method,
               "--epochs", str(epochs), "--workers", str(workers), "--width", str(width)]
    if delay:
        command += ["--delay", str(delay)]
    if link_gbit is not None:
        command += ["--link-gbit", str(link_gbit)]
    settings = {"TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": os.pathsep.join(
        [HERE, os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")])}
    # kdist's own settings (KDIST_RING, waits) reach every rank, on either host.
    settings.update({k: v for k, v in os.environ.items() if k.startswith("KDIST_")})
    if link_gbit is None:
        argv, env = mpiexec_command(ranks, command)
        env.update(settings)
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=1800)
    else:
        done = _run_on_two_hosts(ranks, command, settings, link_gbit)
    result = re.findall(r"RESULT (.*)$", done.stdout, re.M)
    pace = re.findall(r"PACE (.*)$", done.stdout, re.M)
    if done.returncode != 0 or not result or not pace:
        raise SystemExit(f"{method} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return dict(json.loads(result[0]), **json.loads(pace[0]))


def _run_on_two_hosts(ranks, command, settings, link_gbit):
    """`command` on `ranks` ranks filling two emulated hosts in order, each host's
    sending limited to `link_gbit` Gbit/s (network.py's set-up)."""
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
    import emulated_hosts

    why_not = emulated_hosts.available()
    if why_not:
        raise SystemExit(f"benchmarks/decentralized.py --link-gbit: {why_not}")
    with emulated_hosts.EmulatedHosts(2) as hosts:
        for index in range(2):
            hosts.limit_link(index, link_gbit)
        return hosts.run_job(-(-ranks // 2), command, env=settings, timeout=1800, ranks=ranks)


def seconds_to(target, curve):
    """When the accuracy of `curve` ([seconds, accuracy] per epoch) first reached `target`."""
    return next((seconds for seconds, accuracy in curve if accuracy >= target), None)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", default="4,8")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--straggler", choices=["off", "on", "both"], default="both")
    parser.add_argument("--child")
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--link-gbit", type=float, default=None)
    parser.add_argument("--target", type=float, default=0.8)
    args = parser.parse_args()
    if args.width < 1 or (args.link_gbit is not None and args.link_gbit <= 0):
        parser.error("--width and --link-gbit must be positive")
    if args.child:
        child(args.child, args.epochs, int(args.workers), args.delay, args.width,
              link=args.link_gbit is not None)
        return
    methods = args.methods.split(",")
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise SystemExit(f"Unknown method(s) {unknown}; choose from {', '.join(METHODS)}.")
    cases = {"off": ["off"], "on": ["on"], "both": ["off", "on"]}[args.straggler]
    rows = []
    for workers in (int(w) for w in args.workers.split(",")):
        for method in methods:
            calm = run(method, args.epochs, workers, width=args.width,
                       link_gbit=args.link_gbit)
            calm["seconds_to_target"] = seconds_to(args.target, calm.get("curve", []))
            found = []
            if "off" in cases:
                found.append(dict(calm, straggler=False))
            if "on" in cases:
                # Two more of the calm run's steps: the straggler's pace is a third of it.
                delay = 2 / calm["steps_per_second"]
                slow = run(method, args.epochs, workers, delay, width=args.width,
                           link_gbit=args.link_gbit)
                slow["seconds_to_target"] = seconds_to(args.target, slow.get("curve", []))
                found.append(dict(slow, straggler=True, delay=delay,
                                  pace_kept=slow["steps_per_second"] / calm["steps_per_second"]))
            for row in found:
                rows.append(dict(row, workers=workers, method=method,
                                 settings=METHODS[method]))
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(json.dumps({"epochs": args.epochs, "base_learning_rate": BASE_LR, "width": args.width,
                      "link_gbit": args.link_gbit, "target": args.target, "rows": rows},
                     indent=1))
    print("| workers | method | straggler | val accuracy | wall s | s to target | "
          "worker 0 steps/s | pace kept | kB sent / step |\n|---|---|---|---|---|---|---|---|---|",
          file=sys.stderr)
    for row in rows:
        kept = f"{row['pace_kept']:.2f}" if "pace_kept" in row else ""
        print(f"| {row['workers']} | {row['method']} | {'yes' if row['straggler'] else 'no'} | "
              f"{row['val_accuracy']:.3f} | {row['seconds']:.1f} | "
              f"{'' if row['seconds_to_target'] is None else round(row['seconds_to_target'], 1)} | "
              f"{row['steps_per_second']:.0f} | {kept} | {row['bytes_per_step'] / 1e3:.1f} |",
              file=sys.stderr)


if __name__ == "__main__":
    main()
