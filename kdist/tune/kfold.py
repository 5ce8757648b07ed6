"""A keras-tuner `Tuner` whose objective is the mean over K cross-validation folds."""

import logging
import os

import keras_tuner as kt
import numpy as np

from kdist._args import whole_number
from kdist.comm import processes
from kdist.tune import compat, distributed, storage, watch

logger = logging.getLogger(__name__)


def fold_indices(y, folds, stratified=None, shuffle=True, seed=0, rows=None):
    """`[(train, validation), ...]` index arrays of a K-fold split (scikit-learn's).

    Stratified (`StratifiedKFold`) when `stratified` is true, or when it is
    None and `y` holds class labels (binary, multiclass, or one-hot rows):
    every fold then keeps the class proportions.

    Example:

        >>> import numpy as np
        >>> [v.tolist() for _, v in fold_indices(np.array([0, 0, 1, 1]), 2, shuffle=False)]
        [[0, 2], [1, 3]]
    """
    from sklearn.model_selection import KFold, StratifiedKFold
    from sklearn.utils.multiclass import type_of_target

    folds = whole_number(folds, "folds", minimum=2)
    labels = None
    if y is not None and not isinstance(y, (dict, list, tuple)):
        y = np.asarray(y)
        kind = type_of_target(y)
        if kind in ("binary", "multiclass"):
            labels = y.reshape(len(y), -1)[:, 0] if y.ndim > 1 else y
        elif kind == "multilabel-indicator" and np.all(y.sum(axis=1) == 1):
            labels = y.argmax(axis=1)
    if stratified and labels is None:
        raise ValueError("stratified=True needs class labels in y (integers, strings or "
                         "one-hot rows).")
    count = rows if rows is not None else len(y)
    if count < folds:
        raise ValueError(f"{folds} folds need at least {folds} rows; got {count}.")
    seed = seed if shuffle else None
    if labels is not None and stratified is not False:
        splitter = StratifiedKFold(folds, shuffle=shuffle, random_state=seed)
        return list(splitter.split(np.zeros(count), labels))
    return list(KFold(folds, shuffle=shuffle, random_state=seed).split(np.zeros(count)))


def _rows(data):
    if isinstance(data, dict):
        return _rows(next(iter(data.values())))
    if isinstance(data, (list, tuple)):
        return _rows(data[0])
    return len(data)


def _take(data, index):
    if data is None:
        return None
    if isinstance(data, dict):
        return {k: _take(v, index) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return type(data)(_take(v, index) for v in data)
    return np.asarray(data)[index]


class KFoldTuner(storage.WholeTunerSaves, kt.Tuner):
    """Scores each trial by K-fold cross-validation.

    For every trial the training set is split in `folds` folds (stratified
    for classification); a fresh model is built and trained on all folds but
    one, and evaluated on that one. The trial's metrics are the mean over
    folds of every evaluated metric, as `val_<metric>`, plus
    `val_<metric>_std` (the model's instability across folds) and
    `val_<metric>_fold_<k>` for each fold. Any oracle works: kdist's
    `GeneticOracle` and `BayesianOracle`, or keras-tuner's.

    The weights of the best fold's model are saved with the trial, so
    `get_best_models()` works; retrain the best hyper-parameters on all the
    data for a final model.

    Budgets in epochs work as in `keras_tuner.Hyperband`: a trial that
    carries `tuner/epochs` (from `kdist.tune.BOHBOracle` or keras-tuner's
    `HyperbandOracle`) trains each fold up to that epoch, and a promoted
    trial (`tuner/trial_id`) starts each fold from the same fold of its
    parent at `tuner/initial_epoch`; those trials keep every fold's weights.

    Args:
        hypermodel: a function of `hp` returning a compiled model, or a
            `keras_tuner.HyperModel` (its `fit` is used when it has one).
        oracle: any `keras_tuner.Oracle`.
        folds: K, at least 2.
        stratified: None to decide from the labels, or True / False.
        shuffle: deal rows to folds at random; the split is the same for
            every trial, so trials are compared on the same folds.
        split_seed: the seed of that random split.
        **kwargs: `directory`, `project_name`, `overwrite`, ... as for any tuner.
            Under MPI, `overwrite=True` clears the project once for all ranks
            (`kdist.tune.clear_project`), not once per rank.

    `search(x, y, ..., **fit_kwargs)` takes arrays (or dicts or lists of
    them) and `fit`'s arguments, without `validation_data` or
    `validation_split`; under MPI with more than one rank it runs as
    `kdist.tune.search` does (see `search` below).

    Raises:
        ValueError: no `oracle`, or fewer than 2 folds. While searching, a
            trial raises (keras-tuner then marks it invalid) `ValueError` when
            `search` is given `validation_data` or `validation_split`, or there
            are fewer rows than folds, and `TypeError` for a `tf.data.Dataset`
            or positional arguments after `y`.

    Example:

        >>> import tempfile, keras, numpy as np, kdist.tune
        >>> def build(hp):
        ...     model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(
        ...         hp.Int("units", 4, 16, step=4), activation="relu"), keras.layers.Dense(1)])
        ...     model.compile("adam", "mse")
        ...     return model
        >>> oracle = kdist.tune.GeneticOracle(objective="val_loss", max_trials=2,
        ...                                   population_size=2, seed=0)
        >>> tuner = kdist.tune.KFoldTuner(build, oracle=oracle, folds=2,
        ...                               directory=tempfile.mkdtemp(), project_name="doc")
        >>> x = np.random.default_rng(0).normal(size=(60, 4)); y = x.sum(axis=1)
        >>> tuner.search(x, y, epochs=1, verbose=0)
        >>> sorted(tuner.oracle.get_best_trials(1)[0].metrics.metrics)[:3]
        ['val_loss', 'val_loss_fold_0', 'val_loss_fold_1']
    """

    # Read by kdist.tune.distributed: this tuner splits, broadcasts and scores folds itself.
    trains_folds = True

    def __init__(self, hypermodel=None, oracle=None, folds=5, stratified=None, shuffle=True,
                 split_seed=0, **kwargs):
        if oracle is None:
            raise ValueError("KFoldTuner needs an oracle, e.g. "
                             "kdist.tune.BayesianOracle(objective='val_loss', max_trials=30).")
        folds = whole_number(folds, "folds", minimum=2)
        if kwargs.get("overwrite"):
            kwargs["overwrite"] = distributed.clear_project(
                kwargs.get("directory") or ".", kwargs.get("project_name") or "untitled_project")
        super().__init__(hypermodel=hypermodel, oracle=oracle, **kwargs)
        storage.order_trials(self.oracle)
        self.folds = int(folds)
        self.stratified = stratified
        self.shuffle = bool(shuffle)
        self.split_seed = int(split_seed)

    def run_trial(self, trial, x, y=None, *fit_args, sample_weight=None, **fit_kwargs):
        for unsupported in ("validation_data", "validation_split"):
            if fit_kwargs.get(unsupported):
                raise ValueError(f"KFoldTuner makes its own validation folds; do not pass "
                                 f"{unsupported} to search().")
            fit_kwargs.pop(unsupported, None)
        if fit_args:
            raise TypeError("KFoldTuner.search takes x, y and keyword arguments only.")
        if hasattr(x, "element_spec"):
            raise TypeError("KFoldTuner splits arrays in memory; pass numpy arrays (or dicts "
                            "or lists of them), not a tf.data.Dataset.")
        splits = fold_indices(y, self.folds, self.stratified, self.shuffle, self.split_seed,
                              rows=_rows(x))
        roles = distributed.current_roles()
        if roles is None:
            runs = [self._run_fold(trial, x, y, sample_weight, train, held_out, fit_kwargs,
                                   fold=k)
                    for k, (train, held_out) in enumerate(splits)]
            metrics, best = self._summarise(trial, [scores for _, scores in runs])
            self.save_model(trial.trial_id, runs[best][0])
            return metrics
        return self._run_shared(trial, x, y, sample_weight, splits, fit_kwargs, roles)

    def _run_shared(self, trial, x, y, sample_weight, splits, fit_kwargs, roles):
        """This rank's folds of a distributed search; the group shares the scores."""
        mine = [k for k in range(len(splits)) if k % roles.folds_per_group == roles.fold_team]
        models, scores, error = {}, {}, None
        try:
            for k in mine:
                models[k], scores[k] = self._run_fold(trial, x, y, sample_weight, *splits[k],
                                                      fit_kwargs, roles, fold=k)
        except Exception as caught:  # every rank must reach the gather below
            error = f"{type(caught).__name__}: {caught}"
        shared = roles.group_comm.allgather_object(
            (scores if roles.worker == 0 else {}, error))
        failed = [(rank, message) for rank, (_, message) in enumerate(shared) if message]
        if failed:
            raise RuntimeError(f"Trial {trial.trial_id}: fold training failed on rank "
                               f"{failed[0][0]} of group {roles.group}: {failed[0][1]}")
        everything = {}
        for part, _ in shared:
            everything.update(part)
        metrics, best = self._summarise(trial, [everything[k] for k in range(len(splits))])
        if best in models and roles.worker == 0:
            self.save_model(trial.trial_id, models[best])
        return metrics

    def _run_fold(self, trial, x, y, sample_weight, train, held_out, fit_kwargs, roles=None,
                  fold=0):
        hp = trial.hyperparameters
        model = compat.build_model(self, hp)
        kwargs = dict(fit_kwargs)
        budgeted = "tuner/epochs" in hp.values
        if budgeted:
            kwargs.update(self._budget(hp.values, model, fold))
        if roles is not None and roles.workers_per_fold > 1:
            # The fold team trains one model data-parallel: same start, averaged
            # gradients, equal shares of the fold's rows.
            from kdist.comm import collectives
            from kdist.optimizers import AllreduceOptimizer

            collectives.broadcast_variables(model.weights, 0, comm=roles.team_comm)
            model.optimizer = AllreduceOptimizer(model.optimizer, comm=roles.team_comm)
            share = len(train) // roles.workers_per_fold
            train = train[roles.worker::roles.workers_per_fold][:share]
        kwargs["callbacks"] = list(kwargs.get("callbacks") or [])
        self.hypermodel.fit(hp, model, _take(x, train), _take(y, train),
                            sample_weight=_take(sample_weight, train), **kwargs)
        if budgeted and (roles is None or roles.worker == 0):
            model.save_weights(self.fold_checkpoint(trial.trial_id, fold))
        scores = model.evaluate(_take(x, held_out), _take(y, held_out),
                                sample_weight=_take(sample_weight, held_out),
                                verbose=0, return_dict=True)
        return model, {f"val_{name}": float(value) for name, value in scores.items()}

    def _budget(self, values, model, fold):
        """`fit` arguments for a trial with a budget; a promoted trial's model
        takes the weights its parent's fold ended with."""
        epochs, start = int(values["tuner/epochs"]), int(values.get("tuner/initial_epoch", 0))
        parent = values.get("tuner/trial_id")
        if parent is not None and start > 0:
            path = self.fold_checkpoint(parent, fold)
            if os.path.exists(path):
                model.load_weights(path)
            else:
                logger.warning("fold %d of trial %s has no weights at %s; this promoted trial "
                               "trains that fold from scratch", fold, parent, path)
                start = 0
        return {"epochs": epochs, "initial_epoch": start}

    def fold_checkpoint(self, trial_id, fold):
        """Where fold `fold` of a trial with a budget keeps its weights."""
        path = compat.checkpoint_path(self, trial_id)
        stem = path[:-len(".weights.h5")] if path.endswith(".weights.h5") else path
        return f"{stem}.fold_{fold}.weights.h5"

    def _summarise(self, trial, per_fold):
        """The trial's metrics, and which fold's model is the best."""
        names = per_fold[0].keys()
        metrics = {}
        for name in names:
            values = np.array([scores[name] for scores in per_fold])
            metrics[name] = float(values.mean())
            metrics[f"{name}_std"] = float(values.std())
            for k, value in enumerate(values):
                metrics[f"{name}_fold_{k}"] = float(value)
        objective = self.oracle.objective
        best = 0
        if isinstance(objective, kt.Objective) and objective.name in names:
            values = [scores[objective.name] for scores in per_fold]
            best = int(np.argmin(values) if objective.direction == "min" else np.argmax(values))
        logger.info("trial %s: %s", trial.trial_id, ", ".join(
            f"{n} {metrics[n]:.4g} ± {metrics[n + '_std']:.2g}" for n in names))
        return metrics, best

    def search(self, *fit_args, folds_per_group=1, workers_per_fold=1, lost_after=60.0,
               trial_timeout=None, **fit_kwargs):
        """Searches; under MPI with more than one rank, as `kdist.tune.search` does.

        Called as `search(*fit_args, folds_per_group=1, workers_per_fold=1,
        lost_after=60.0, trial_timeout=None, **fit_kwargs)`: `fit_args` and
        `fit_kwargs` are those of any tuner's `search` (the data and `fit`'s
        arguments); the options after `*fit_args` are keyword-only.

        `folds_per_group` fold teams share each trial's folds, each of
        `workers_per_fold` data-parallel ranks: with N ranks there are
        `(N - 1) / (folds_per_group * workers_per_fold)` groups.
        `lost_after` and `trial_timeout` are `kdist.tune.search`'s.

        Raises:
            ValueError: `lost_after` or `trial_timeout` is not a number of
                seconds > 0, and the errors of `kdist.tune.search`.
        """
        watch.check_timeouts(lost_after, trial_timeout)
        if distributed.current_roles() is None:
            processes.init()
            if processes.size() > 1:
                return distributed.search(self, *fit_args, folds_per_group=folds_per_group,
                                          workers_per_fold=workers_per_fold,
                                          lost_after=lost_after, trial_timeout=trial_timeout,
                                          **fit_kwargs)
        return super().search(*fit_args, **fit_kwargs)

    def save_model(self, trial_id, model, step=0):
        model.save_weights(compat.checkpoint_path(self, trial_id))
