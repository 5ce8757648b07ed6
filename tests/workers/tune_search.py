"""A K-fold search over MPI; each rank reports what it saw.

Usage: tune_search.py DIRECTORY [--oracle genetic|bayesian|bohb] [--trials T] [--folds-per-group F]
       [--workers-per-fold W] [--fail-trial ID] [--die-after K] [--generic]
       [--kill-group G] [--lost-after S] [--trial-timeout S] [--stall-trial ID] [--folds K]
"""

import argparse
import json
import os

import numpy as np

from common import report, settle_imports

parser = argparse.ArgumentParser()
parser.add_argument("directory")
parser.add_argument("--oracle", default="genetic")
parser.add_argument("--trials", type=int, default=8, help="with bohb: the budget in epochs")
parser.add_argument("--folds", type=int, default=4)
parser.add_argument("--folds-per-group", type=int, default=1)
parser.add_argument("--workers-per-fold", type=int, default=1)
parser.add_argument("--fail-trial", help="this trial raises on the group's last rank")
parser.add_argument("--die-after", type=int, help="the master kills the job after K trials")
parser.add_argument("--generic", action="store_true", help="a stock tuner, no K-fold")
parser.add_argument("--overwrite", action="store_true")
parser.add_argument("--kill-group", type=int,
                    help="this group's leader kills itself (SIGKILL) during its first trial")
parser.add_argument("--kill-follower", action="store_true",
                    help="with --kill-group: the group's last rank dies instead")
parser.add_argument("--stall-trial",
                    help="this trial's first build sleeps until rank 0 has reported")
parser.add_argument("--lost-after", type=float, default=60.0)
parser.add_argument("--trial-timeout", type=float)
args = parser.parse_args()

import keras  # noqa: E402
import keras_tuner as kt  # noqa: E402

import kdist  # noqa: E402
import kdist.tune  # noqa: E402

settle_imports()

kdist.init()
rng = np.random.default_rng(0)
x = rng.normal(size=(240, 6)).astype("float32")
y = (x[:, 0] - x[:, 1] > 0).astype("int64")
built, stalled = [], []


def build(hp):
    roles = kdist.tune.current_roles()
    trial_id = getattr(build, "trial_id", None)
    if (args.fail_trial is not None and roles is not None and trial_id == args.fail_trial
            and roles.group_comm.rank == roles.group_comm.size - 1):
        raise ValueError("this trial's model cannot be built here")
    last = roles is not None and roles.group_comm.rank == roles.group_comm.size - 1
    if (args.kill_group is not None and roles is not None and roles.group == args.kill_group
            and (last if args.kill_follower else roles.is_leader) and len(built) == 2):
        import signal

        # Mid-trial, while building the group's first fold: dying here rather than a
        # moment later means the trial can never finish before the death.
        os.kill(os.getpid(), signal.SIGKILL)
    if args.stall_trial is not None and trial_id == args.stall_trial and not stalled:
        import time

        stalled.append(trial_id)
        # Until the search is over without this group (bounded, should it never be).
        reported = os.path.join(os.environ["KDIST_TEST_REPORTS"], "rank-0.json")
        for _ in range(1200):
            if os.path.exists(reported):
                break
            time.sleep(0.1)
    model = keras.Sequential([keras.Input((6,)),
                              keras.layers.Dense(hp.Int("units", 4, 32, step=4),
                                                 activation="relu"),
                              keras.layers.Dense(2, activation="softmax")])
    optimizer = keras.optimizers.Adam(hp.Float("lr", 1e-3, 3e-1, sampling="log"))
    if args.generic and args.workers_per_fold > 1:
        optimizer = kdist.DistributedOptimizer(optimizer, comm=kdist.tune.trial_comm())
    model.compile(optimizer, "sparse_categorical_crossentropy", metrics=["accuracy"])
    built.append(hp.values)
    return model


class Tracking(kdist.tune.KFoldTuner):
    def run_trial(self, trial, *a, **k):
        build.trial_id = trial.trial_id
        return super().run_trial(trial, *a, **k)


class GenericTracking(kt.Tuner):
    def run_trial(self, trial, *a, **k):
        build.trial_id = trial.trial_id
        return super().run_trial(trial, *a, **k)


def oracle():
    objective = kt.Objective("val_accuracy", "max")
    if args.oracle == "bayesian":
        return kdist.tune.BayesianOracle(objective=objective, max_trials=args.trials, seed=0,
                                         candidates=200)
    return kdist.tune.GeneticOracle(objective=objective, max_trials=args.trials,
                                    population_size=4, seed=0)


if args.die_after is not None and kdist.rank() == 0:
    import threading
    import time

    def kill_when_done():
        project = os.path.join(args.directory, "search")
        while True:
            finished = 0
            for name in os.listdir(project) if os.path.isdir(project) else []:
                path = os.path.join(project, name, "trial.json")
                if name.startswith("trial_") and os.path.exists(path):
                    try:
                        with open(path) as f:
                            finished += json.load(f)["status"] == "COMPLETED"
                    except ValueError:
                        pass
            if finished >= args.die_after:
                os._exit(3)
            time.sleep(0.05)

    threading.Thread(target=kill_when_done, daemon=True).start()

if args.oracle == "bohb":
    class BOHBTracking(kdist.tune.BOHB):
        def run_trial(self, trial, *a, **k):
            build.trial_id = trial.trial_id
            return super().run_trial(trial, *a, **k)

    tuner = BOHBTracking(build, objective=kt.Objective("val_accuracy", "max"), max_epochs=4,
                         factor=2, budget=args.trials, seed=0, directory=args.directory,
                         project_name="search")
    kdist.tune.search(tuner, x, y, validation_split=0.25, verbose=0,
                      workers_per_fold=args.workers_per_fold)
elif args.generic:
    tuner = GenericTracking(oracle=oracle(), hypermodel=build, directory=args.directory,
                            project_name="search")
    kdist.tune.search(tuner, x, y, epochs=2, validation_split=0.25, verbose=0,
                      workers_per_fold=args.workers_per_fold)
else:
    tuner = Tracking(build, oracle=oracle(), folds=args.folds, directory=args.directory,
                     project_name="search", overwrite=args.overwrite)
    tuner.search(x, y, epochs=2, verbose=0, folds_per_group=args.folds_per_group,
                 workers_per_fold=args.workers_per_fold, lost_after=args.lost_after,
                 trial_timeout=args.trial_timeout)
trials = tuner.oracle.trials
report({"statuses": {t.trial_id: t.status for t in trials.values()},
        "messages": {t.trial_id: t.message for t in trials.values() if t.message},
        "best": tuner.get_best_hyperparameters(1)[0].values,
        "values": {t.trial_id: t.hyperparameters.values for t in trials.values()},
        "built": len(built), "roles": None,
        "ended": list(tuner.oracle.end_order), "started": list(tuner.oracle.start_order)})
