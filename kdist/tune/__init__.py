"""Hyper-parameter search for keras-tuner: genetic, Bayesian, BOHB and
multi-objective oracles, population-based training, K-fold tuning.

Needs the `tune` extra. Importing `kdist.tune` with a keras-tuner outside
`TESTED_KERAS_TUNER` warns.

>>> import keras_tuner as kt, kdist.tune
>>> oracle = kdist.tune.BayesianOracle(objective=kt.Objective("val_loss", "min"),
...                                    max_trials=30)

Every oracle plugs into any `keras_tuner.Tuner` (`oracle=`); `KFoldTuner`
scores trials by cross-validation.

| name | what it is |
|---|---|
| `GeneticOracle` | a genetic algorithm, each child pre-selected by a Gaussian process |
| `BayesianOracle` | Gaussian-process search with expected improvement |
| `BOHBOracle`, `BOHB` | Hyperband's budgets in epochs, asynchronous, proposals from a model |
| `PBTOracle`, `PBT` | population-based training (and PB2), with `ScheduleReplay` |
| `NSGA2Oracle`, `ParEGOOracle` | searches with several objectives, for a Pareto front |
| `KFoldTuner` | a tuner whose objective is the mean over K folds |
| `search` | any tuner's search over MPI ranks |

The oracles share keras-tuner's arguments `objective`, `hyperparameters`,
`allow_new_entries`, `tune_new_entries`, `max_retries_per_trial` and
`max_consecutive_failed_trials`, and a `seed` that makes a search
reproducible (`seed=0` included). The model-based and genetic ones reason
in the unit cube of each hyper-parameter's own scale (`Encoding`).
Bad settings raise `ValueError` (`TypeError` for a setting of the wrong kind).
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
