"""Hyper-parameter search for keras-tuner: genetic, Bayesian, BOHB and
multi-objective oracles, population-based training, K-fold tuning.

>>> import keras_tuner as kt, kdist.tune
>>> oracle = kdist.tune.BayesianOracle(objective=kt.Objective("val_loss", "min"),
...                                    max_trials=30)

Every oracle plugs into any `keras_tuner.Tuner` (`oracle=`); `KFoldTuner`
scores trials by cross-validation.
"""

from kdist._exports import declare as _declare

_EXPORTS = {
    "BayesianOracle": "kdist.tune.bayesian",
    "expected_improvement": "kdist.tune.bayesian",
    "BOHB": "kdist.tune.bohb",
    "BOHBOracle": "kdist.tune.bohb",
    "TESTED_KERAS_TUNER": "kdist.tune.compat",
    "clear_project": "kdist.tune.distributed",
    "current_roles": "kdist.tune.distributed",
    "Roles": "kdist.tune.distributed",
    "search": "kdist.tune.distributed",
    "trial_comm": "kdist.tune.distributed",
    "GeneticOracle": "kdist.tune.genetic",
    "fold_indices": "kdist.tune.kfold",
    "KFoldTuner": "kdist.tune.kfold",
    "dominates": "kdist.tune.pareto",
    "NSGA2Oracle": "kdist.tune.pareto",
    "ParEGOOracle": "kdist.tune.pareto",
    "plot_front": "kdist.tune.pareto",
    "PBT": "kdist.tune.pbt",
    "ScheduleReplay": "kdist.tune.pbt",
    "PBTOracle": "kdist.tune.population",
    "Encoding": "kdist.tune.space",
    "plot_population": "kdist.tune.trajectories",
}

__all__, __getattr__, __dir__ = _declare(__name__, _EXPORTS)
