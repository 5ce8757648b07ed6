"""Elastic training on the digits data; one rank dies or leaves at a chosen batch.

    elastic_train.py [--lose-rank R[,R...]] [--at-batch B]
                     [--how kill|stop|leave|raise|unplug] [--epochs E] [--commit-every C]

`unplug`: the first rank listed takes its emulated host off the network
(tests/emulated_hosts.py), so that every rank of that host is lost at once.

Each survivor reports its final size, epoch counter, sizes seen by the reset
callbacks, optimizer iterations, weights and loss on the whole data.
"""

import argparse
import os
import signal
import socket
import subprocess

import keras
import numpy as np
from sklearn.datasets import load_digits

import kdist
from workers.common import flat_weights, report

parser = argparse.ArgumentParser()
parser.add_argument("--lose-rank", default="-1",
                    type=lambda text: [int(rank) for rank in text.split(",")])
parser.add_argument("--at-batch", type=int, default=10)
parser.add_argument("--how", choices=("kill", "stop", "leave", "raise", "unplug"),
                    default="kill")
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--commit-every", type=int, default=4)
parser.add_argument("--path", choices=("optimizer", "strategy"), default="optimizer")
parser.add_argument("--replacement-dies-at", type=int, default=-1,
                    help="the first replacement rank kills itself after this many batches "
                         "(0: every replacement dies before it reaches training)")
parser.add_argument("--fail-at-the-end", action="store_true",
                    help="raise once the report is written: a bug after training")
args = parser.parse_args()

kdist.init()
x, y = load_digits(return_X_y=True)
x, y = (x / 16.0).astype("float32"), y.astype("int64")
keras.utils.set_random_seed(kdist.rank())  # different on purpose: sync() makes them equal


def build():
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(10)])
    optimizer = keras.optimizers.SGD(0.05 * kdist.size())
    if args.path == "optimizer":
        optimizer = kdist.DistributedOptimizer(optimizer)
    model.compile(optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model, optimizer


if args.path == "strategy":
    with kdist.distribute.MPIStrategy().scope():
        model, optimizer = build()
else:
    model, optimizer = build()
state = kdist.elastic.KerasState(model, batch=0, epoch=0)
sizes_at_reset = []
# Started by the survivors to replace a lost rank (kdist run --elastic --max-np).
replacement = kdist.elastic.is_replacement()
if replacement and args.replacement_dies_at == 0:
    os.kill(os.getpid(), signal.SIGKILL)  # as a process that cannot start would


def on_reset():
    sizes_at_reset.append(kdist.size())
    optimizer.learning_rate.assign(0.05 * kdist.size())


state.register_reset_callbacks([on_reset])
batches_seen = []


class LoseOneRank(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        batches_seen.append(batch)
        if replacement and len(batches_seen) == args.replacement_dies_at:
            marker = os.path.join(os.environ["KDIST_TEST_REPORTS"], "replacement-died")
            if not os.path.exists(marker):
                open(marker, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
        if (kdist.rank() not in args.lose_rank or sizes_at_reset or replacement
                or len(batches_seen) != args.at_batch):
            return
        if args.how == "unplug":
            if kdist.rank() == args.lose_rank[0]:
                unplug_my_host()
            return
        if args.how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if args.how == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        if args.how == "leave":
            raise kdist.elastic.FatalToThisRank("this rank's device is gone")
        raise ValueError("a bug on one rank")


def unplug_my_host():
    host = int(socket.gethostname().lstrip("h"))
    switch, prefix = os.environ["KDIST_TEST_SWITCH"], os.environ["KDIST_TEST_HOSTS"]
    print(f"rank {kdist.rank()} pulls the cable of host h{host}", flush=True)
    subprocess.run(["ip", "-n", switch, "link", "set", f"{prefix}p{host}", "down"], check=True)


callbacks = [kdist.elastic.CommitStateCallback(state, batches_per_commit=args.commit_every),
             kdist.elastic.UpdateBatchStateCallback(state),
             kdist.elastic.UpdateEpochStateCallback(state), LoseOneRank()]


@kdist.elastic.run
def train(state):
    start = kdist.rank() * len(x) // kdist.size()
    stop = (kdist.rank() + 1) * len(x) // kdist.size()
    model.fit(x[start:stop], y[start:stop], batch_size=16, epochs=args.epochs - state.epoch,
              callbacks=callbacks, verbose=0)


train(state)
report({"size": kdist.size(), "epoch": state.epoch, "sizes_at_reset": sizes_at_reset,
        "replacement": replacement,
        "iterations": int(optimizer.iterations.numpy()),
        "learning_rate": float(optimizer.learning_rate.numpy()),
        "loss": float(model.evaluate(x, y, verbose=0)),
        "weights_sum": float(np.sum(flat_weights(model)))})
if args.fail_at_the_end:
    raise RuntimeError("a bug after training")
