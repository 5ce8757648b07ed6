"""Population-based training's tuner: rounds that continue from a checkpoint of
weights and optimizer state, and the replay of a learned schedule."""

import io
import os
import warnings

import keras
import keras_tuner as kt
import numpy as np

from kdist import _files
from kdist.tune import compat, distributed
from kdist.tune.population import PBTOracle


def _optimizer_file(weights_path):
    # Named after the weights: ranks that keep rounds in one scratch folder
    # must not share a file.
    return weights_path[:-len(".weights.h5")] + ".optimizer.npz"


def save_training_state(model, weights_path):
    """Writes `model`'s weights to `weights_path` (a `.weights.h5` file) and its
    optimizer's variables beside it, each file whole or not at all."""
    directory = os.path.dirname(os.path.abspath(weights_path))
    os.makedirs(directory, exist_ok=True)
    if not weights_path.endswith(".weights.h5"):
        raise ValueError(f"save_training_state: {weights_path} must end in .weights.h5.")
    partial = os.path.join(directory, f".partial-{os.getpid()}.weights.h5")
    try:
        model.save_weights(partial)
        os.replace(partial, weights_path)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    optimizer = model.optimizer
    arrays = {f"v{i}": keras.ops.convert_to_numpy(v) for i, v in enumerate(optimizer.variables)}
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    _files.write_atomically(_optimizer_file(weights_path),
                            lambda stream: stream.write(buffer.getvalue()))


def restore_training_state(model, weights_path):
    """Loads what `save_training_state` wrote into a model compiled with the same
    optimizer class: weights, step count and slots. The learning rate stays the
    new model's own (unless it is a schedule, which follows the step count), as
    do the optimizer's other hyper-parameters."""
    optimizer = model.optimizer
    # The explored rate, which a weights file that holds the optimizer's variables
    # (an optimizer built before this call loads them) would overwrite.
    explored = [(v, keras.ops.convert_to_numpy(v)) for v in optimizer.variables
                if v.name == "learning_rate"]
    with warnings.catch_warnings():
        # An optimizer not built yet skips the file's optimizer variables, as it
        # should: they are restored below from their own file.
        warnings.filterwarnings("ignore", message="Skipping variable loading for optimizer")
        model.load_weights(weights_path)
    for variable, value in explored:
        variable.assign(value)
    if not optimizer.built:
        optimizer.build(model.trainable_variables)
    with np.load(_optimizer_file(weights_path)) as saved:
        arrays = [saved[f"v{i}"] for i in range(len(saved.files))]
    if len(arrays) != len(optimizer.variables):
        raise ValueError(
            f"The checkpoint at {weights_path} holds {len(arrays)} optimizer variables and "
            f"this model's {type(optimizer).__name__} has {len(optimizer.variables)}: build "
            "every member with the same optimizer class and the same layers.")
    for variable, array in zip(optimizer.variables, arrays):
        if variable.name == "learning_rate":
            continue  # the explored value, not the donor's
        if tuple(variable.shape) != array.shape:
            raise ValueError(f"Optimizer variable {variable.path} has shape {variable.shape}; "
                             f"the checkpoint at {weights_path} holds {array.shape}.")
        variable.assign(array)


class PBT(kt.Tuner):
    """Population-based training as a keras-tuner tuner (see `PBTOracle` for the
    arguments it shares).

    `hypermodel.build(hp)` must return a built, compiled model; every member uses the
    same optimizer class and layers, and may differ in what does not change the
    weights' shapes (optimizer hyper-parameters, dropout rates, loss weights).
    Each round builds the model with its values, loads the weights, step count
    and optimizer slots of the trial it continues, and trains from
    `tuner/initial_epoch` to `tuner/epochs`; the explored learning rate is
    kept. `search(x, y, validation_data=..., ...)` takes `model.fit`'s
    arguments except `epochs` and `initial_epoch`. With `kdist.tune.search` the
    population is trained by groups of ranks, one member at a time each; a group
    of several ranks (`workers_per_fold`) needs an optimizer built as
    `kdist.DistributedOptimizer(optimizer, comm=kdist.tune.trial_comm())`.

    Every round saves the weights and the optimizer's state, so
    `get_best_models()` (through `load_model(trial)`) gives each model with its
    optimizer's state where its round ended, ready to train on.
    `learned_schedule(trial_id=None)` is the oracle's.

    Args:
        hypermodel: a `keras_tuner.HyperModel` or a function `hp -> model`.
        **kwargs: any `keras_tuner.Tuner` argument (`directory`,
            `project_name`, `overwrite`, ...).

    Raises:
        ValueError: a bad setting, as for `PBTOracle`. While searching, a
            round raises `ValueError` (keras-tuner then marks the trial
            invalid) when `search` is given `epochs` or `initial_epoch`, the
            model is not compiled, or the checkpoint's optimizer variables do
            not match the model's.

    Example:

        >>> import keras, keras_tuner as kt, kdist.tune
        >>> def build(hp):
        ...     model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        ...     model.compile(keras.optimizers.SGD(hp.Float("learning_rate", 1e-3, 0.1,
        ...                                                 sampling="log")), "mse")
        ...     return model
        >>> tuner = kdist.tune.PBT(build, objective="loss", population_size=4,
        ...                        perturbation_interval=2, max_epochs=6,
        ...                        directory="/tmp/kdist-pbt-doc", overwrite=True)
        >>> tuner.oracle.rounds
        3
    """

    def __init__(self, hypermodel=None, objective=None, population_size=8,
                 perturbation_interval=4, max_epochs=20, burn_in=0, quantile_fraction=0.25,
                 resample_probability=0.25, perturbation_factors=(1.2, 0.8), explore=None,
                 synchronous=True, seed=None, hyperparameters=None, tune_new_entries=True,
                 allow_new_entries=True, max_retries_per_trial=0,
                 max_consecutive_failed_trials=3, **kwargs):
        oracle = PBTOracle(
            objective=objective, population_size=population_size,
            perturbation_interval=perturbation_interval, max_epochs=max_epochs,
            burn_in=burn_in, quantile_fraction=quantile_fraction,
            resample_probability=resample_probability,
            perturbation_factors=perturbation_factors, explore=explore,
            synchronous=synchronous, seed=seed, hyperparameters=hyperparameters,
            tune_new_entries=tune_new_entries, allow_new_entries=allow_new_entries,
            max_retries_per_trial=max_retries_per_trial,
            max_consecutive_failed_trials=max_consecutive_failed_trials)
        super().__init__(oracle=oracle, hypermodel=hypermodel, **kwargs)

    def run_trial(self, trial, *fit_args, **fit_kwargs):
        for taken in ("epochs", "initial_epoch"):
            if taken in fit_kwargs:
                raise ValueError(f"PBT.search: {taken} is set by the population's rounds "
                                 "(perturbation_interval, max_epochs); leave it out.")
        values = trial.hyperparameters.values
        model = compat.build_model(self, trial.hyperparameters)
        if model.optimizer is None:
            raise ValueError("PBT: hypermodel.build(hp) must return a compiled model.")
        parent = values.get("tuner/trial_id")
        if parent is not None:
            # From the shared project folder, wherever the parent round ran.
            restore_training_state(model, self._round_checkpoint(parent))
        history = model.fit(*fit_args, initial_epoch=values["tuner/initial_epoch"],
                            epochs=values["tuner/epochs"], **fit_kwargs)
        save_training_state(model, compat.checkpoint_path(self, trial.trial_id))
        # The round's score is where it ended, not its best epoch.
        return {name: float(series[-1]) for name, series in history.history.items()}

    def load_model(self, trial):
        """The trial's model where its round ended: weights and optimizer state, so
        that `get_best_models` gives a model that can train on as the member would."""
        model = compat.build_model(self, trial.hyperparameters)
        restore_training_state(model, compat.checkpoint_path(self, trial.trial_id))
        return model

    def _round_checkpoint(self, trial_id):
        """Where the round `trial_id` left its member: the copy its group's leader wrote
        in the project folder every rank shares (a follower of a distributed search
        runs its trials with its own directory pointed at scratch)."""
        trial_dir = self.get_trial_dir(trial_id)
        roles = distributed.current_roles()
        shared = getattr(roles, "project_dir", None)
        if shared is not None:
            trial_dir = os.path.join(shared, os.path.relpath(trial_dir, self.project_dir))
        return os.path.join(trial_dir, "checkpoint.weights.h5")

    def learned_schedule(self, trial_id=None):
        """`PBTOracle.learned_schedule`: the best trial's by default."""
        return self.oracle.learned_schedule(trial_id)


class ScheduleReplay(keras.callbacks.Callback):
    """Replays a learned schedule (`PBT.learned_schedule()`) in a plain training:
    at the start of each epoch the optimizer's hyper-parameters take the values
    of the schedule's latest entry at or before that epoch.

    Args:
        schedule: a list of `{"epoch": e, "values": {...}}`.
        names: the values to replay; by default those that name an attribute of
            the optimizer. Others (a dropout rate) are the model's to build with.

    The learning rate is set in place; a change of any other value makes the
    model trace its train step again. `values_at(epoch)` returns the values in
    force at an epoch.

    Raises:
        ValueError: `schedule` is empty or not a list of such entries; at an
            epoch's start, a name in `names` that is not an attribute of the
            optimizer.

    Example:

        >>> replay = ScheduleReplay([{"epoch": 0, "values": {"learning_rate": 0.1}},
        ...                          {"epoch": 4, "values": {"learning_rate": 0.02}}])
        >>> replay.values_at(5)
        {'learning_rate': 0.02}
    """

    def __init__(self, schedule, names=None):
        super().__init__()
        entries = list(schedule)
        if not entries or any(not isinstance(e, dict) or "epoch" not in e or "values" not in e
                              for e in entries):
            raise ValueError("ScheduleReplay: schedule must be a non-empty list of "
                             "{'epoch': e, 'values': {...}}, as PBT.learned_schedule() gives.")
        self.schedule = sorted(entries, key=lambda e: e["epoch"])
        self.names = None if names is None else list(names)

    def values_at(self, epoch):
        """The schedule's values in force at `epoch`."""
        current = self.schedule[0]["values"]
        for entry in self.schedule:
            if entry["epoch"] <= epoch:
                current = entry["values"]
        return dict(current)

    def _replayed(self, optimizer):
        known = set().union(*(e["values"] for e in self.schedule))
        if self.names is None:
            return sorted(n for n in known if hasattr(optimizer, n))
        missing = [n for n in self.names if not hasattr(optimizer, n)]
        if missing:
            raise ValueError(f"ScheduleReplay: {missing} are not hyper-parameters of "
                             f"{type(optimizer).__name__}; build the model with them instead.")
        return self.names

    def on_epoch_begin(self, epoch, logs=None):
        optimizer = self.model.optimizer
        values = self.values_at(epoch)
        retrace = False
        for name in self._replayed(optimizer):
            if name not in values:
                continue
            if name == "learning_rate":
                optimizer.learning_rate = values[name]  # a variable: no new step function
            elif getattr(optimizer, name) != values[name]:
                setattr(optimizer, name, values[name])
                retrace = True
        if retrace:
            # Other hyper-parameters are constants of the traced step.
            self.model.make_train_function(force=True)
