"""Population-based training over MPI: rank 0 holds the oracle, the other ranks
are single-rank groups that train the members' rounds; each rank reports.

Usage: tune_pbt.py DIRECTORY [--population P] [--max-epochs E] [--asynchronous]
"""

import argparse

import numpy as np

from common import report, settle_imports

parser = argparse.ArgumentParser()
parser.add_argument("directory")
parser.add_argument("--population", type=int, default=4)
parser.add_argument("--max-epochs", type=int, default=3)
parser.add_argument("--asynchronous", action="store_true")
args = parser.parse_args()

import keras  # noqa: E402

import kdist  # noqa: E402
import kdist.tune  # noqa: E402

settle_imports()

kdist.init()
rng = np.random.default_rng(0)
x = rng.normal(size=(256, 6)).astype("float32")
y = (x[:, 0] - x[:, 1] > 0).astype("int64")
rounds = []


def build(hp):
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(2, activation="softmax")])
    model.compile(keras.optimizers.Adam(hp.Float("learning_rate", 1e-4, 0.3, sampling="log")),
                  "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


class Starts(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        rounds.append(int(self.model.optimizer.iterations.numpy()))


tuner = kdist.tune.PBT(build, objective="val_accuracy", population_size=args.population,
                       perturbation_interval=1, max_epochs=args.max_epochs, seed=0,
                       synchronous=not args.asynchronous, directory=args.directory,
                       project_name="search")
kdist.tune.search(tuner, x, y, validation_split=0.25, batch_size=32, verbose=0,
                  callbacks=[Starts()])
trials = tuner.oracle.trials
report({"statuses": {t.trial_id: t.status for t in trials.values()},
        "values": {t.trial_id: t.hyperparameters.values for t in trials.values()},
        "best": tuner.get_best_hyperparameters(1)[0].values,
        "schedule": tuner.learned_schedule(),
        "rounds_started_at_step": rounds})
