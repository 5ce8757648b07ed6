"""A distributed search whose leader stops it with an error; every rank
reports what the search left on its tuner.

Usage: tune_leftovers.py DIRECTORY
"""

import os
import sys

import numpy as np

from common import report, settle_imports

import keras  # noqa: E402
import keras_tuner as kt  # noqa: E402

import kdist  # noqa: E402
import kdist.tune  # noqa: E402

settle_imports()

kdist.init()
x = np.random.default_rng(0).normal(size=(32, 3)).astype("float32")
y = x.sum(axis=1)


def build(hp):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(hp.Int("units", 1, 4))])
    model.compile("sgd", "mse")
    return model


class Own(kt.Tuner):
    def run_trial(self, trial, *args, **kwargs):
        roles = kdist.tune.current_roles()
        if trial.trial_id == "1" and roles is not None and roles.is_leader:
            raise kt.errors.FatalError("the search stops here")
        return super().run_trial(trial, *args, **kwargs)


kdist.tune.clear_project(sys.argv[1], "leftovers")
tuner = Own(oracle=kt.oracles.RandomSearchOracle(kt.Objective("loss", "min"), max_trials=3),
            hypermodel=build, directory=sys.argv[1], project_name="leftovers")
before, oracle = set(vars(tuner)), tuner.oracle
oracle_before = set(vars(oracle))
failed = None
try:
    kdist.tune.search(tuner, x, y, epochs=1, verbose=0, lost_after=30)
except Exception as error:  # noqa: BLE001  (reported)
    failed = f"{type(error).__name__}: {error}"
report({"class": type(tuner).__name__, "added": sorted(set(vars(tuner)) - before),
        "same_oracle": tuner.oracle is oracle,
        "added_to_oracle": sorted(set(vars(oracle)) - oracle_before),
        "hypermodel_fit": "fit" in vars(tuner.hypermodel),
        "environment": {k: v for k, v in os.environ.items() if k.startswith("KERASTUNER_")},
        "failed": failed})
