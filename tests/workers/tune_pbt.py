"""Population-based training over MPI: rank 0 holds the oracle, the other ranks
are groups that train the members' rounds; each rank reports.

With `--workers-per-group W` each group trains its rounds data-parallel, each rank
on its own shard of the rows, its gradients averaged over the group.

With `--kill-group G` that group's leader dies (SIGKILL) in the middle of its first
round; run it with fault tolerance.

Usage: tune_pbt.py DIRECTORY [--population P] [--max-epochs E] [--asynchronous]
                   [--workers-per-group W [--plain-optimizer]]
                   [--kill-group G] [--lost-after S]
"""

import argparse

import numpy as np

from common import report, settle_imports

parser = argparse.ArgumentParser()
parser.add_argument("directory")
parser.add_argument("--population", type=int, default=4)
parser.add_argument("--max-epochs", type=int, default=3)
parser.add_argument("--asynchronous", action="store_true")
parser.add_argument("--workers-per-group", type=int, default=1)
parser.add_argument("--plain-optimizer", action="store_true",
                    help="leave out the DistributedOptimizer a data-parallel group needs")
parser.add_argument("--kill-group", type=int)
parser.add_argument("--lost-after", type=float, default=60.0)
args = parser.parse_args()

import keras  # noqa: E402

import kdist  # noqa: E402
import kdist.tune  # noqa: E402

settle_imports()

kdist.init()
rng = np.random.default_rng(0)
x = rng.normal(size=(256, 6)).astype("float32")
y = (x[:, 0] - x[:, 1] > 0).astype("int64")
rounds, trained = [], []
workers = args.workers_per_group
if workers > 1 and kdist.rank() > 0:
    # Ranks 1..W are the first group, and so on: each takes its own rows.
    shard = (kdist.rank() - 1) % workers
    x, y = x[shard::workers], y[shard::workers]


def build(hp):
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(2, activation="softmax")])
    optimizer = keras.optimizers.Adam(hp.Float("learning_rate", 1e-4, 0.3, sampling="log"))
    if workers > 1 and not args.plain_optimizer:
        optimizer = kdist.DistributedOptimizer(optimizer, comm=kdist.tune.trial_comm())
    model.compile(optimizer, "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def digest(model):
    return float(sum(np.abs(w).sum() * (i + 1) for i, w in enumerate(model.get_weights())))


class Starts(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        roles = kdist.tune.current_roles()
        if (args.kill_group is not None and roles.group == args.kill_group
                and roles.is_leader and batch == 1):
            import os
            import signal

            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_begin(self, logs=None):
        rounds.append(int(self.model.optimizer.iterations.numpy()))
        self.start = digest(self.model)

    def on_train_end(self, logs=None):
        team = kdist.tune.trial_comm()
        trained.append({"start": self.start, "end": digest(self.model),
                        "steps": int(self.model.optimizer.iterations.numpy()),
                        "team": [team.rank, team.size]})


tuner = kdist.tune.PBT(build, objective="val_accuracy", population_size=args.population,
                       perturbation_interval=1, max_epochs=args.max_epochs, seed=0,
                       synchronous=not args.asynchronous, directory=args.directory,
                       project_name="search")
kdist.tune.search(tuner, x, y, validation_split=0.25, batch_size=32, verbose=0,
                  callbacks=[Starts()], workers_per_fold=workers, lost_after=args.lost_after)
trials = tuner.oracle.trials
report({"statuses": {t.trial_id: t.status for t in trials.values()},
        "values": {t.trial_id: t.hyperparameters.values for t in trials.values()},
        "best": tuner.get_best_hyperparameters(1)[0].values,
        "schedule": tuner.learned_schedule(),
        "rounds_started_at_step": rounds, "trained": trained})
