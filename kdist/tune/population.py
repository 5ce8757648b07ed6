"""Population-based training's oracle: members, rounds, exploit and explore.

Each member of the population trains in rounds of `perturbation_interval`
epochs; each round is one keras-tuner trial, which continues from the trial
named in its `tuner/trial_id` value (the member's own last round, or after an
exploit a better member's), from epoch `tuner/initial_epoch` to `tuner/epochs`.
The tuner that trains the trials is `kdist.tune.PBT`.
"""

import math
import numbers

import keras_tuner as kt
import numpy as np

from kdist._args import whole_number
from kdist.tune import bandit, storage
from kdist.tune.compat import keep_seed, random_values, trial_number
from kdist.tune.space import trial_response

_RUNNING = kt.engine.trial.TrialStatus.RUNNING
_COMPLETED = kt.engine.trial.TrialStatus.COMPLETED
_IDLE = kt.engine.trial.TrialStatus.IDLE
# Keys of a trial's values that say where it sits in the population, not what it tries.
_ROUND_KEYS = ("tuner/trial_id", "tuner/initial_epoch", "tuner/epochs", "pbt/member")


def searched_values(values):
    """A trial's hyper-parameter values without the keys that place it in the population."""
    return {k: v for k, v in values.items() if k not in _ROUND_KEYS}


def lineage(trials, trial_id):
    """`trial_id` and the rounds its weights came through, newest first; `trials`
    maps ids to keras-tuner trials."""
    chain = []
    while trial_id is not None:
        chain.append(trial_id)
        trial_id = trials[trial_id].hyperparameters.values.get("tuner/trial_id")
    return chain


def perturb(hp, value, factors, rng):
    """`value` of hyper-parameter `hp` moved by one of `factors` (numbers) or, for a
    choice, to a neighbouring value; it stays within `hp`'s bounds."""
    factor = factors[rng.integers(len(factors))]
    if isinstance(hp, kt.engine.hyperparameters.Choice):
        if not hp.ordered:
            return value
        index = hp.values.index(value) + (1 if factor > 1 else -1)
        return hp.values[min(max(index, 0), len(hp.values) - 1)]
    if isinstance(hp, kt.engine.hyperparameters.Int):
        step = hp.step or 1
        moved = hp.min_value + round((value * factor - hp.min_value) / step) * step
        if moved == value:  # small integers: move one step at least
            moved = value + (1 if factor > 1 else -1) * step
        return int(min(max(moved, hp.min_value), hp.max_value))
    if isinstance(hp, kt.engine.hyperparameters.Float):
        moved = min(max(value * factor, hp.min_value), hp.max_value)
        if hp.step:
            moved = hp.min_value + round((moved - hp.min_value) / hp.step) * hp.step
        return float(moved)
    return value  # Boolean and Fixed move only by resampling


def explore(space, values, rng, resample_probability=0.25, factors=(1.2, 0.8)):
    """New values from a donor's `values`: each hyper-parameter of `space` is
    resampled from its range with `resample_probability`, otherwise perturbed."""
    explored = dict(values)
    for hp in space:
        if hp.name not in values or isinstance(hp, kt.engine.hyperparameters.Fixed):
            continue
        if rng.random() < resample_probability:
            explored[hp.name] = hp.random_sample(int(rng.integers(2**31)))
        else:
            explored[hp.name] = perturb(hp, values[hp.name], factors, rng)
    return explored


class PBTOracle(storage.WholeSaves, kt.Oracle):
    """Population-based training (Jaderberg et al. 2017): the population's
    members train side by side; at each round's end (every
    `perturbation_interval` epochs, once `burn_in` epochs have passed) a member
    in the bottom `quantile_fraction` of the population takes the weights and
    optimizer state of a member of the top quantile (exploit) and trains on with
    that member's hyper-parameters, perturbed (explore).

    A member is a donor only once it has finished a round. With
    `synchronous=True` every member finishes a round before any starts the next
    and members are ranked by the scores of the round just finished; otherwise a
    member ranks itself against the latest scores of the others, so groups of
    processes never wait, and a member that takes a donor further on goes on from
    the donor's epoch. A failed round is trained again from the member's last
    finished one. Members' trials are ordinary keras-tuner trials:
    `get_best_hyperparameters`, `get_best_models` and `results_summary` work, and
    `learned_schedule(trial_id)` gives the hyper-parameters a trial's weights were
    trained with, epoch by epoch.

    Each round of each member is one trial, whose values carry, besides the
    hyper-parameters, `tuner/trial_id` (the trial whose weights it continues:
    the member's own last round, or after an exploit the donor's; absent for
    a first round), `tuner/initial_epoch`, `tuner/epochs` and `pbt/member`.
    The tuner that trains them is `kdist.tune.PBT`. There is no `max_trials`:
    the search ends when every member has trained `max_epochs`. `rounds` is
    the number of rounds a member trains when it never takes a donor further
    on, `ceil(max_epochs / perturbation_interval)`.

    `objective`, `hyperparameters`, `allow_new_entries`, `tune_new_entries`,
    `max_retries_per_trial` and `max_consecutive_failed_trials` are as for any
    `keras_tuner.Oracle`.

    Args:
        population_size: members (at least 2).
        perturbation_interval: epochs per round.
        max_epochs: epochs each member trains in all.
        burn_in: no exploit before this epoch.
        quantile_fraction: share of the population in each of the bottom and
            top quantiles, in (0, 0.5].
        resample_probability: chance that an explored hyper-parameter is drawn
            afresh instead of perturbed.
        perturbation_factors: factors a number is multiplied by when perturbed.
        explore: `explore(values, rng) -> values` to use instead of perturbing
            and resampling, or `"pb2"`: PB2's choice (Parker-Holder et al. 2020),
            the values with the highest upper confidence bound of the score's
            change in the next round, from a Gaussian process fitted to the
            rounds so far (see `kdist.tune.bandit`); until four rounds have
            continued a checkpoint, values are perturbed.
        synchronous: rounds in lockstep (see above).
        seed: makes a search reproducible.

    Raises:
        ValueError: `population_size` below 2, `perturbation_interval` or
            `max_epochs` below 1, a negative `burn_in`, `quantile_fraction`
            outside (0, 0.5], `resample_probability` outside [0, 1], a
            perturbation factor that is not a positive number, or a negative
            seed.
        TypeError: `explore` is neither `"pb2"` nor callable.

    Example:

        >>> import keras_tuner as kt
        >>> oracle = PBTOracle(objective=kt.Objective("val_loss", "min"),
        ...                    population_size=4, perturbation_interval=2, max_epochs=8)
        >>> oracle.rounds  # of 2 epochs each; 16 trials in all
        4
    """

    def __init__(self, objective=None, population_size=8, perturbation_interval=4, max_epochs=20,
                 burn_in=0, quantile_fraction=0.25, resample_probability=0.25,
                 perturbation_factors=(1.2, 0.8), explore=None, synchronous=True, seed=None,
                 hyperparameters=None, allow_new_entries=True, tune_new_entries=True,
                 max_retries_per_trial=0, max_consecutive_failed_trials=3):
        population_size = whole_number(population_size, "population_size", minimum=2)
        perturbation_interval = whole_number(perturbation_interval, "perturbation_interval",
                                             minimum=1)
        max_epochs = whole_number(max_epochs, "max_epochs", minimum=1)
        burn_in = whole_number(burn_in, "burn_in", minimum=0)
        if not isinstance(quantile_fraction, numbers.Real) or not 0 < quantile_fraction <= 0.5:
            raise ValueError(f"quantile_fraction must be in (0, 0.5]; got {quantile_fraction!r}.")
        if (not isinstance(resample_probability, numbers.Real)
                or not 0 <= resample_probability <= 1):
            raise ValueError("resample_probability must be in [0, 1]; got "
                             f"{resample_probability!r}.")
        factors = tuple(perturbation_factors)
        if not factors or any(not isinstance(f, numbers.Real) or f <= 0 for f in factors):
            raise ValueError("perturbation_factors must be positive numbers; got "
                             f"{perturbation_factors!r}.")
        if explore is not None and explore != "pb2" and not callable(explore):
            raise TypeError("explore must be 'pb2' or callable as explore(values, rng); got "
                            f"{explore!r}.")
        rounds = math.ceil(max_epochs / perturbation_interval)
        # No max_trials: the search ends when every member has trained
        # max_epochs, failed rounds and retries included.
        super().__init__(objective=objective, max_trials=None,
                         hyperparameters=hyperparameters, allow_new_entries=allow_new_entries,
                         tune_new_entries=tune_new_entries, seed=seed,
                         max_retries_per_trial=max_retries_per_trial,
                         max_consecutive_failed_trials=max_consecutive_failed_trials)
        keep_seed(self, seed)
        self.population_size = population_size
        self.perturbation_interval = perturbation_interval
        self.max_epochs = max_epochs
        self.burn_in = burn_in
        self.quantile_fraction = float(quantile_fraction)
        self.resample_probability = float(resample_probability)
        self.perturbation_factors = factors
        self.explore = explore
        self.synchronous = bool(synchronous)
        self.rounds = rounds
        # Each member's trials, oldest first.
        self.members = []

    # -- what the population looks like ----------------------------------------

    def _trial(self, trial_id):
        return self.trials.get(trial_id)

    def _finished_rounds(self, member):
        return [t for t in (self._trial(i) for i in self.members[member])
                if t is not None and t.status == _COMPLETED]

    def _reached(self, member):
        """The epoch a member's weights have reached, and the trial that holds them."""
        done = self._finished_rounds(member)
        if not done:
            return 0, None
        return done[-1].hyperparameters.values["tuner/epochs"], done[-1]

    def _busy(self, member):
        last = self._trial(self.members[member][-1]) if self.members[member] else None
        return last is not None and last.status in (_RUNNING, _IDLE)

    def _score_at(self, member, epoch):
        """The member's score at the end of `epoch` (None when it has not finished there)."""
        for trial in self._finished_rounds(member):
            if trial.hyperparameters.values["tuner/epochs"] == epoch and trial.score is not None:
                return trial.score
        return None

    def _donor_trial(self, member, epoch):
        """The trial holding a donor's weights: at `epoch` when synchronous (it may
        have gone on since), else its latest."""
        if self.synchronous:
            for trial in self._finished_rounds(member):
                if trial.hyperparameters.values["tuner/epochs"] == epoch:
                    return trial
        return self._reached(member)[1]

    def _ranked(self, epoch):
        """Members with a score, best first: at `epoch` when synchronous, else their latest."""
        scores = {}
        for member in range(len(self.members)):
            if self.synchronous:
                score = self._score_at(member, epoch)
            else:
                reached, trial = self._reached(member)
                score = trial.score if trial is not None else None
            if score is not None:
                scores[member] = score
        maximise = self.objective.direction == "max"
        return sorted(scores, key=lambda m: (-scores[m] if maximise else scores[m], m))

    def quantiles(self, epoch):
        """(top members, bottom members) of the ranking at `epoch`, each
        `quantile_fraction` of the members with a score (at most half).

        Synchronous: ranked by the scores at the end of `epoch`; asynchronous:
        by each member's latest score. Members are numbers, as in `pbt/member`.
        """
        ranked = self._ranked(epoch)
        count = min(math.ceil(self.quantile_fraction * len(ranked)), len(ranked) // 2)
        if count == 0:
            return [], []
        return ranked[:count], ranked[-count:]

    # -- keras-tuner's hook -------------------------------------------------------

    def populate_space(self, trial_id):
        rng = np.random.default_rng([self.seed, trial_number(trial_id)])
        if len(self.members) < self.population_size:
            values = random_values(self)
            if values is None:
                values = self.hyperparameters.values  # a space of one point
            self.members.append([trial_id])
            return self._round(values, len(self.members) - 1, 0, None)
        choice = self._next_member()
        if choice is None:
            return trial_response(None)
        if choice == "wait":
            return {"status": _IDLE, "values": None}
        member, epoch, own = choice
        values = searched_values(own.hyperparameters.values)
        # A first round that failed left no checkpoint: it starts afresh.
        parent = own.trial_id if own.status == _COMPLETED else None
        top, bottom = self.quantiles(epoch) if epoch >= self.burn_in else ([], [])
        if not self.synchronous:
            # A donor that has trained every epoch would leave the member none to train.
            top = [m for m in top if self._reached(m)[0] < self.max_epochs]
        if member in bottom and top:
            donor = self._donor_trial(top[rng.integers(len(top))], epoch)
            # Asynchronous donors may be ahead: the member goes on from where they are.
            parent, epoch = donor.trial_id, donor.hyperparameters.values["tuner/epochs"]
            donated = searched_values(donor.hyperparameters.values)
            values = None
            if self.explore == "pb2":
                values = self._bandit(donated, epoch, rng)
            elif self.explore is not None:
                values = dict(self.explore(dict(donated), rng))
            if values is None:
                values = explore(self.hyperparameters.space, donated, rng,
                                 self.resample_probability, self.perturbation_factors)
        self.members[member].append(trial_id)
        return self._round(values, member, epoch, parent)

    def _bandit(self, donated, epoch, rng):
        """PB2's values for a round from `epoch`, or None while too few are known."""
        rounds = []
        for trial in self.trials.values():
            values = trial.hyperparameters.values
            if trial.status != _COMPLETED or "pbt/member" not in values:
                continue
            parent = self._trial(values.get("tuner/trial_id"))
            rounds.append((values, trial.score, None if parent is None else parent.score))
        observed = bandit.observations(rounds, self.objective.direction == "max")
        end = min(epoch + self.perturbation_interval, self.max_epochs)
        return bandit.choose(self.hyperparameters, observed, donated, end, self.max_epochs,
                             rng)

    def _next_member(self):
        """(member, epoch, trial) to continue; "wait" while the rounds it depends on
        run; None when every member has trained `max_epochs`."""
        reached = [self._reached(m) for m in range(len(self.members))]
        waiting = [m for m in range(len(self.members))
                   if reached[m][0] < self.max_epochs]
        if not waiting:
            return None
        ready = [m for m in waiting if not self._busy(m)]
        if self.synchronous:
            # The slowest members go first, and none goes past a round that
            # another member is still training.
            slowest = min(reached[m][0] for m in waiting)
            if any(self._busy(m) and reached[m][0] == slowest for m in waiting):
                return "wait"
            ready = [m for m in ready if reached[m][0] == slowest]
        if not ready:
            return "wait"
        member = min(ready, key=lambda m: (reached[m][0], m))
        epoch, trial = reached[member]
        if trial is None:  # its first round failed: start it again
            first = self._trial(self.members[member][0])
            return member, 0, first
        return member, epoch, trial

    def _round(self, values, member, epoch, parent):
        values = dict(searched_values(values))
        values.update({"tuner/initial_epoch": epoch,
                       "tuner/epochs": min(epoch + self.perturbation_interval, self.max_epochs),
                       "pbt/member": member})
        if parent is not None:  # as in Hyperband, absent for a first round (values go
            values["tuner/trial_id"] = parent  # over gRPC, which has no None)
        return trial_response(values)

    # -- what the search learned --------------------------------------------------

    def learned_schedule(self, trial_id=None):
        """The hyper-parameters that trained a trial's weights: a list of
        `{"epoch": e, "values": {...}}`, from epoch 0, one entry per change. The best
        trial's by default.

        Raises:
            ValueError: no trial has finished (with `trial_id=None`).
            KeyError: no trial has that id.
        """
        if trial_id is None:
            best = self.get_best_trials(1)
            if not best:
                raise ValueError("learned_schedule: no trial has finished yet.")
            trial_id = best[0].trial_id
        if trial_id not in self.trials:
            raise KeyError(f"learned_schedule: no trial {trial_id!r}.")
        rounds = []
        for each in lineage(self.trials, trial_id):
            values = self.trials[each].hyperparameters.values
            rounds.append((values["tuner/initial_epoch"], searched_values(values)))
        schedule = []
        for epoch, values in sorted(rounds, key=lambda r: r[0]):
            if not schedule or schedule[-1]["values"] != values:
                schedule.append({"epoch": epoch, "values": values})
        return schedule

    def get_state(self):
        state = super().get_state()
        state["members"] = [list(m) for m in self.members]
        return state

    def set_state(self, state):
        super().set_state(state)
        # Read from the trials (loaded first): a job killed between writing a
        # trial and writing oracle.json leaves a trial the saved list lacks.
        members = [list(m) for m in state.get("members", [])]
        for trial_id in sorted(self.trials):
            member = self.trials[trial_id].hyperparameters.values.get("pbt/member")
            if member is None:
                continue
            while len(members) <= member:
                members.append([])
            if trial_id not in members[member]:
                members[member].append(trial_id)
                members[member].sort()
        self.members = members
