"""BOHB for keras-tuner: Hyperband's budgets, asynchronous promotions, proposals from a model.

Budgets are keras-tuner's Hyperband ones: bracket `s` starts configurations
at `ceil(max_epochs / factor**s)` epochs and promotes the best to `factor`
times as many, round by round, up to `max_epochs`. Trials carry the same
`tuner/epochs`, `tuner/initial_epoch`, `tuner/trial_id`, `tuner/bracket` and
`tuner/round` values, so any tuner written for `keras_tuner.Hyperband` runs
them (a promoted trial starts from its parent's checkpoint).

Two things differ from keras-tuner's Hyperband:

- **Promotions are asynchronous (ASHA).** A request promotes a finished
  trial as soon as it ranks in the best `1 / factor` of the trials finished
  at its budget in its bracket (a round never promotes more than that share
  in all); when none does, the request starts a new configuration, in
  Hyperband's order of brackets. Nothing waits for a round to fill, so a
  group of ranks is handed `IDLE` only when no new configuration fits (the
  budget left, or a search space used up) while a running trial may still
  earn a promotion; `STOPPED` once nothing can change.
- **New configurations come from a model (BOHB).** Once enough trials have
  finished, kdist's Gaussian process (as in `BayesianOracle`) is fitted to
  every result with the budget as one more input, and proposes the
  configuration whose fully trained result (at `max_epochs`) it expects to
  improve most on the best result at the largest budget reached. A poor
  region seen at one epoch is thus known when proposing for many. A share
  `random_fraction` of new configurations stays random, so the search
  cannot lock onto a poor model.

The search ends when its `budget` of epochs (summed over trials, counting
only the epochs each trial trains) is spent.
"""

import logging
import math

import keras_tuner as kt
import numpy as np

from kdist._args import whole_number
from kdist.tune.bayesian import BayesianOracle
from kdist.tune.compat import ComparesValues, random_values, trial_number
from kdist.tune.space import Encoding

logger = logging.getLogger(__name__)

_COMPLETED = kt.engine.trial.TrialStatus.COMPLETED


def bracket_count(max_epochs, factor):
    """Brackets of keras-tuner's Hyperband: one per budget from 1 epoch up by `factor`."""
    count, epochs = 0, max_epochs
    while epochs >= 1:
        epochs /= factor
        count += 1
    return count


def round_epochs(max_epochs, factor, bracket, round_):
    """Epochs a trial of `bracket` has trained by the end of `round_`."""
    return math.ceil(max_epochs / factor ** (bracket - round_))


def round_size(max_epochs, factor, bracket, round_):
    """Trials in `round_` of `bracket` in one synchronous Hyperband iteration."""
    last = math.ceil(1 + math.log(max_epochs, factor)) / (bracket + 1)
    return math.ceil(last * factor ** (bracket - round_))


def iteration_epochs(max_epochs, factor):
    """Epochs trained by one iteration of keras-tuner's Hyperband (promoted
    trials go on from their parent's epochs)."""
    total = 0
    for bracket in range(bracket_count(max_epochs, factor)):
        for round_ in range(bracket + 1):
            start = round_epochs(max_epochs, factor, bracket, round_ - 1) if round_ else 0
            total += round_size(max_epochs, factor, bracket, round_) * (
                round_epochs(max_epochs, factor, bracket, round_) - start)
    return total


class BOHBOracle(ComparesValues, BayesianOracle):
    """Hyperband brackets with asynchronous promotion, new configurations from a
    Gaussian process over the hyper-parameters and the budget.

    Budgets are keras-tuner's Hyperband ones: bracket `s` starts
    configurations at `ceil(max_epochs / factor**s)` epochs and promotes the
    best to `factor` times as many, round by round, up to `max_epochs`. Trials
    carry the same `tuner/epochs`, `tuner/initial_epoch`, `tuner/trial_id`,
    `tuner/bracket` and `tuner/round` values, so any tuner written for
    `keras_tuner.Hyperband` runs them (a promoted trial starts from its
    parent's checkpoint). Two things differ from keras-tuner's Hyperband:

    - Promotions are asynchronous (ASHA). A request promotes a finished trial
      as soon as it ranks in the best `1 / factor` of the trials finished at
      its budget in its bracket (a round never promotes more than that share
      in all); when none does, the request starts a new configuration, in
      Hyperband's order of brackets. Nothing waits for a round to fill: a
      request gets `IDLE` only when no new configuration fits (the budget
      left, or a search space used up) while a running trial may still earn a
      promotion, and `STOPPED` once nothing can change.
    - New configurations come from a model (BOHB). Once `min_points` trials
      have finished, a Gaussian process (as in `BayesianOracle`) is fitted to
      every result with the log of the epochs as one more input, and proposes
      the configuration whose result at `max_epochs` it expects to improve
      most on the best result at the largest budget reached. A share
      `random_fraction` of new configurations stays random.

    The search stops once its `budget` of epochs (summed over trials,
    counting only the epochs each trial trains) is spent. Properties:
    `brackets`, and `spent` (the epochs handed out so far).

    `objective`, `hyperparameters`, `allow_new_entries`, `tune_new_entries`,
    `max_retries_per_trial` and `max_consecutive_failed_trials` are as for
    any `keras_tuner.Oracle`.

    Args:
        max_epochs: epochs of a fully trained model.
        factor: budget ratio between rounds, and the share (`1 / factor`) of a
            round that is promoted (at least 2).
        budget: epochs to spend in all, summed over trials; by default what
            `hyperband_iterations` iterations of keras-tuner's Hyperband with
            the same `max_epochs` and `factor` spend.
        hyperband_iterations: sets the default `budget`.
        random_fraction: share of new configurations drawn at random even
            once the model has data.
        min_points: finished trials (at any budget) before the model takes
            over (default: one more than the search space's dimensions, at
            least 3).
        xi: as for `BayesianOracle`.
        candidates: as for `BayesianOracle`.
        seed: makes a search reproducible.

    Raises:
        ValueError: `factor < 2`, `max_epochs < 1`, `hyperband_iterations < 1`,
            a budget that is not a positive integer, `random_fraction` outside
            [0, 1], `min_points < 2`, `xi < 0`, or a negative seed.

    Example:

        >>> import keras_tuner as kt
        >>> oracle = BOHBOracle(objective=kt.Objective("val_loss", "min"), max_epochs=27)
        >>> oracle.budget  # one Hyperband iteration's epochs
        375
    """

    def __init__(self, objective=None, max_epochs=100, factor=3, budget=None,
                 hyperband_iterations=1, random_fraction=1 / 3, min_points=None, xi=0.01,
                 candidates=2000, seed=None, hyperparameters=None, allow_new_entries=True,
                 tune_new_entries=True, max_retries_per_trial=0,
                 max_consecutive_failed_trials=3):
        super().__init__(objective=objective, max_trials=None, xi=xi, candidates=candidates,
                         seed=seed, hyperparameters=hyperparameters,
                         allow_new_entries=allow_new_entries, tune_new_entries=tune_new_entries,
                         max_retries_per_trial=max_retries_per_trial,
                         max_consecutive_failed_trials=max_consecutive_failed_trials)
        try:
            factor = whole_number(factor, "factor", minimum=2)
        except (TypeError, ValueError):
            # Worded as keras-tuner's Hyperband words it, whose users match on it.
            raise ValueError(f"factor needs to be an int larger than 1; got {factor}.") from None
        max_epochs = whole_number(max_epochs, "max_epochs", minimum=1)
        hyperband_iterations = whole_number(hyperband_iterations, "hyperband_iterations",
                                            minimum=1)
        if budget is not None:
            budget = whole_number(budget, "budget (epochs)", minimum=1)
        if not 0.0 <= random_fraction <= 1.0:
            raise ValueError(f"random_fraction must lie in [0, 1]; got {random_fraction}.")
        if min_points is not None:
            min_points = whole_number(min_points, "min_points", minimum=2)
        self.max_epochs, self.factor = max_epochs, factor
        self.hyperband_iterations = hyperband_iterations
        self.budget = budget if budget is not None else (
            self.hyperband_iterations * iteration_epochs(self.max_epochs, self.factor))
        self.random_fraction = float(random_fraction)
        self.min_points = min_points

    @property
    def brackets(self):
        """The number of brackets: one per budget from 1 epoch up by `factor`."""
        return bracket_count(self.max_epochs, self.factor)

    def epochs(self, bracket, round_):
        """Epochs a trial of `bracket` has trained by the end of `round_`."""
        return round_epochs(self.max_epochs, self.factor, bracket, round_)

    @property
    def spent(self):
        """Epochs handed out so far, finished or not."""
        return sum(self._cost(t.hyperparameters.values) for t in self.trials.values())

    def _cost(self, values):
        return values.get("tuner/epochs", 0) - values.get("tuner/initial_epoch", 0)

    # Promoted trials repeat their parent's values with other tuner/* keys: a
    # configuration is a duplicate whatever budget it ran at.
    def compared_values(self, values):
        """The values that make a configuration, without its budget (`tuner/*`)."""
        return {k: v for k, v in values.items() if not k.startswith("tuner/")}

    # keras-tuner's hook: one call per new trial.
    def populate_space(self, trial_id):
        left = self.budget - self.spent
        rounds = self._rounds()
        promotion = self._promotion(rounds, left)
        if promotion is not None:
            return {"status": kt.engine.trial.TrialStatus.RUNNING, "values": promotion}
        bracket = self._next_bracket(rounds, left)
        if bracket is None:
            if self._may_promote_later(rounds, left):
                return {"status": kt.engine.trial.TrialStatus.IDLE, "values": None}
            logger.info("BOHB: budget spent (%d of %d epochs)", self.spent, self.budget)
            return {"status": kt.engine.trial.TrialStatus.STOPPED, "values": None}
        values = self._new_configuration(trial_id)
        if values is None:
            # The space is used up; a running trial may still earn a promotion.
            status = kt.engine.trial.TrialStatus
            waiting = self._may_promote_later(rounds, left)
            return {"status": status.IDLE if waiting else status.STOPPED, "values": None}
        values.update({"tuner/epochs": self.epochs(bracket, 0), "tuner/initial_epoch": 0,
                       "tuner/bracket": bracket, "tuner/round": 0})
        return {"status": kt.engine.trial.TrialStatus.RUNNING, "values": values}

    def _promotion(self, rounds, left):
        """The values of the best promotable trial at the largest budget, or None.

        In each bracket and round, a finished trial is promotable when it is
        among the best `len(finished) // factor` there and was not promoted
        before: ASHA's rule, which needs no round to be complete. A round
        promotes no more than that many in all, as Hyperband's would: ASHA
        alone promotes again whenever a newcomer displaces a promoted trial
        from the top, and spends on one round the epochs that Hyperband
        gives to the next bracket.
        """
        promoted = {t.hyperparameters.values.get("tuner/trial_id") for t in self.trials.values()}
        best = None
        for bracket, round_, trials in self._promotable_rounds(rounds, left):
            finished = self._ranked([t for t in trials if t.status == _COMPLETED])
            share = len(finished) // self.factor
            if sum(t.trial_id in promoted for t in trials) >= share:
                continue
            waiting = [t for t in finished[:share] if t.trial_id not in promoted]
            if waiting:
                key = (self.epochs(bracket, round_ + 1), -self._loss(waiting[0]))
                if best is None or key > best[0]:
                    best = (key, waiting[0], bracket, round_ + 1)
        if best is None:
            return None
        _, parent, bracket, round_ = best
        values = {k: v for k, v in parent.hyperparameters.values.items()
                  if not k.startswith("tuner/")}
        values.update({"tuner/trial_id": parent.trial_id,
                       "tuner/epochs": self.epochs(bracket, round_),
                       "tuner/initial_epoch": self.epochs(bracket, round_ - 1),
                       "tuner/bracket": bracket, "tuner/round": round_})
        return values

    def _may_promote_later(self, rounds, left):
        """Whether a trial still running could, once finished, be promoted within the
        `left` epochs: then a tuner asking for work is told to wait (IDLE), not to
        leave (STOPPED), as keras-tuner's Hyperband tells it. Running means handed to a
        tuner and not yet ended (keras-tuner's `ongoing_trials`)."""
        running = {trial.trial_id for trial in self.ongoing_trials.values()}
        return any(t.trial_id in running
                   for _, _, trials in self._promotable_rounds(rounds, left) for t in trials)

    def _promotable_rounds(self, rounds, left):
        """(bracket, round, trials) of the rounds that have a next round whose extra
        epochs fit in the `left` of the budget."""
        for (bracket, round_), trials in rounds.items():
            if round_ < bracket and (
                    self.epochs(bracket, round_ + 1) - self.epochs(bracket, round_) <= left):
                yield bracket, round_, trials

    def _rounds(self):
        rounds = {}
        for trial in self.trials.values():
            values = trial.hyperparameters.values
            if "tuner/bracket" in values:
                key = (int(values["tuner/bracket"]), int(values["tuner/round"]))
                rounds.setdefault(key, []).append(trial)
        return rounds

    def _next_bracket(self, rounds, left):
        """The most aggressive bracket that has not started all its new
        configurations of the current Hyperband iteration, among those that fit.

        Brackets go in Hyperband's order rather than side by side: the first
        fully trained models are then the best of the most configurations,
        and the model has their results before the costly brackets start.
        """
        started = {b: 0 for b in range(self.brackets)}
        for (bracket, round_), trials in rounds.items():
            if round_ == 0 and bracket in started:
                started[bracket] += len(trials)
        fitting = [b for b in started if self.epochs(b, 0) <= left]
        if not fitting:
            return None
        return min(fitting, key=lambda b: (
            started[b] // round_size(self.max_epochs, self.factor, b, 0), -b))

    def _loss(self, trial):
        return trial.score if self.objective.direction == "min" else -trial.score

    def _ranked(self, trials):
        scored = [t for t in trials if t.score is not None and np.isfinite(t.score)]
        return sorted(scored, key=self._loss)

    def _new_configuration(self, trial_id):
        encoding = Encoding(self.hyperparameters, one_hot=True)
        if encoding.dimensions == 0:
            return random_values(self)
        rng = np.random.default_rng([self.seed, trial_number(trial_id)])
        least = self.min_points or max(3, encoding.dimensions + 1)
        inputs, scores, pending, budgets = self._observations(encoding)
        if len(scores) < least or rng.uniform() < self.random_fraction:
            return self._unique(encoding, self._sobol(encoding, trial_id), rng)
        # What counts is the result of a full training: the model is asked about
        # max_epochs, however few epochs the new trial starts with.
        vector = self._propose(encoding, inputs, scores, pending, rng,
                               context=[self._fidelity(self.max_epochs)],
                               incumbent=budgets == budgets.max())
        return self._unique(encoding, vector, rng)

    def _fidelity(self, epochs):
        """A budget as the model's extra input: log-epochs scaled to [0, 1]."""
        return math.log(epochs) / math.log(self.max_epochs) if self.max_epochs > 1 else 1.0

    def _observations(self, encoding):
        """Every result at every budget, the budget as one more input: a poor
        region seen at 1 epoch is known to the model that proposes for 27."""
        finished, scores, pending, budgets = [], [], [], []
        for trial in self.trials.values():
            values = trial.hyperparameters.values
            if "tuner/epochs" not in values:
                continue
            row = np.append(encoding.encode(values), self._fidelity(values["tuner/epochs"]))
            if trial.status == _COMPLETED and trial.score is not None and np.isfinite(
                    trial.score):
                finished.append(row)
                scores.append(self._loss(trial))
                budgets.append(values["tuner/epochs"])
            elif trial.status == kt.engine.trial.TrialStatus.RUNNING:
                pending.append(row)
        return np.array(finished), np.array(scores), np.array(pending), np.array(budgets)

    def get_state(self):
        state = super().get_state()
        state.update(max_epochs=self.max_epochs, factor=self.factor, budget=self.budget,
                     hyperband_iterations=self.hyperband_iterations,
                     random_fraction=self.random_fraction, min_points=self.min_points)
        return state

    def set_state(self, state):
        super().set_state(state)
        self.max_epochs, self.factor = state["max_epochs"], state["factor"]
        self.budget = state["budget"]
        self.hyperband_iterations = state["hyperband_iterations"]
        self.random_fraction = state["random_fraction"]
        self.min_points = state["min_points"]


class BOHB(kt.Hyperband):
    """keras-tuner's `Hyperband` tuner searching with a `BOHBOracle`.

    Trains and resumes trials exactly as `keras_tuner.Hyperband` does (a
    promoted trial loads its parent's best checkpoint and trains on from
    `initial_epoch`), and takes the same `**kwargs` as any
    `keras_tuner.Tuner`; only the oracle differs. `search(...)` takes
    `model.fit`'s arguments; the epochs come from the trials.

    `objective`, `max_epochs`, `factor`, `budget`, `hyperband_iterations`,
    `seed`, `random_fraction`, `min_points`, `xi`, `candidates`,
    `hyperparameters`, `tune_new_entries`, `allow_new_entries`,
    `max_retries_per_trial` and `max_consecutive_failed_trials` are as for
    `BOHBOracle`.

    Args:
        hypermodel: a `keras_tuner.HyperModel` or a function `hp -> model`.
        **kwargs: any `keras_tuner.Tuner` argument (`directory`,
            `project_name`, `overwrite`, ...).

    Example:

        >>> import keras, keras_tuner as kt
        >>> def build(hp):
        ...     model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        ...     model.compile(keras.optimizers.SGD(hp.Float("lr", 1e-3, 1e-1, sampling="log")),
        ...                   "mse")
        ...     return model
        >>> tuner = BOHB(build, objective="val_loss", max_epochs=9, budget=20,
        ...              directory=__import__("tempfile").mkdtemp())
        >>> tuner.oracle.brackets
        3
    """

    def __init__(self, hypermodel=None, objective=None, max_epochs=100, factor=3, budget=None,
                 hyperband_iterations=1, seed=None, random_fraction=1 / 3, min_points=None,
                 xi=0.01, candidates=2000, hyperparameters=None, tune_new_entries=True,
                 allow_new_entries=True, max_retries_per_trial=0,
                 max_consecutive_failed_trials=3, **kwargs):
        oracle = BOHBOracle(objective, max_epochs=max_epochs, factor=factor, budget=budget,
                            hyperband_iterations=hyperband_iterations, seed=seed,
                            random_fraction=random_fraction, min_points=min_points, xi=xi,
                            candidates=candidates, hyperparameters=hyperparameters,
                            tune_new_entries=tune_new_entries, allow_new_entries=allow_new_entries,
                            max_retries_per_trial=max_retries_per_trial,
                            max_consecutive_failed_trials=max_consecutive_failed_trials)
        # Hyperband's own __init__ would build its oracle; its run_trial and
        # checkpoint loading are what this tuner inherits.
        kt.Tuner.__init__(self, oracle=oracle, hypermodel=hypermodel, **kwargs)
