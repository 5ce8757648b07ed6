"""Hyper-parameter search for keras-tuner: genetic, Bayesian, BOHB and
multi-objective oracles, population-based training, K-fold tuning.

>>> import keras_tuner as kt, kdist.tune
>>> oracle = kdist.tune.BayesianOracle(objective=kt.Objective("val_loss", "min"),
...                                    max_trials=30)

Every oracle plugs into any `keras_tuner.Tuner` (`oracle=`); `KFoldTuner`
scores trials by cross-validation.
"""

# compat comes first: importing it warns when keras-tuner is an untested version.
from kdist.tune.compat import TESTED_KERAS_TUNER
from kdist.tune.bayesian import BayesianOracle, expected_improvement
from kdist.tune.bohb import BOHB, BOHBOracle
from kdist.tune.distributed import Roles, clear_project, current_roles, search, trial_comm
from kdist.tune.genetic import GeneticOracle
from kdist.tune.kfold import KFoldTuner, fold_indices
from kdist.tune.pareto import NSGA2Oracle, ParEGOOracle, dominates, plot_front
from kdist.tune.pbt import PBT, ScheduleReplay
from kdist.tune.population import PBTOracle
from kdist.tune.space import Encoding
from kdist.tune.trajectories import plot_population

__all__ = [
    "BOHB", "BOHBOracle", "BayesianOracle", "Encoding", "GeneticOracle", "KFoldTuner",
    "NSGA2Oracle", "PBT", "PBTOracle", "ParEGOOracle", "Roles", "ScheduleReplay",
    "TESTED_KERAS_TUNER", "clear_project", "current_roles", "dominates",
    "expected_improvement", "fold_indices", "plot_front", "plot_population",
    "search", "trial_comm",
]
