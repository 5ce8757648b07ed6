"""Searches with several objectives: NSGA-II on DEAP, ParEGO on kdist's Gaussian process.

A multi-objective search has no single best trial but a Pareto front: the
trials no other trial beats on every objective at once (accuracy against
model size, against latency on an FPGA...). Both oracles take keras-tuner's
list of objectives, keep keras-tuner's summed `trial.score` for its displays,
and rank trials by fronts: `get_best_trials(n)` returns the first front
first, and `pareto_front()` returns all of it.
"""

import contextlib
import random

import keras_tuner as kt
import numpy as np
from deap import base, tools

from kdist._args import whole_number
from kdist.tune import storage
from kdist.tune.bayesian import BayesianOracle
from kdist.tune.compat import keep_seed, random_values, trial_number
from kdist.tune.space import Encoding, trial_response, unique_values

_COMPLETED = kt.engine.trial.TrialStatus.COMPLETED


def _objectives(oracle):
    objective = oracle.objective
    # keras-tuner turns a list of objectives into its MultiObjective.
    if not hasattr(objective, "objectives"):
        raise ValueError(
            f"{type(oracle).__name__} needs at least two objectives, as a list: "
            f"objective=[kt.Objective('val_accuracy', 'max'), kt.Objective('size', 'min')]; "
            f"got {objective}.")
    if len(objective.objectives) < 2:
        raise ValueError(f"{type(oracle).__name__} needs at least two objectives; got one: "
                         f"{objective.objectives[0].name!r}. Use a single-objective oracle.")
    return objective.objectives


@contextlib.contextmanager
def _seeded_random(seed):
    """DEAP's operators draw from Python's `random`: seed it for one proposal only."""
    state = random.getstate()
    random.seed(seed)
    try:
        yield
    finally:
        random.setstate(state)


def dominates(a, b, signs):
    """Whether objective vector `a` is no worse than `b` everywhere and better somewhere.

    `signs` is +1 for an objective to maximise and -1 for one to minimise.

    >>> dominates([0.9, 10.0], [0.8, 12.0], signs=[1, -1])
    True
    >>> dominates([0.9, 14.0], [0.8, 12.0], signs=[1, -1])
    False
    """
    a, b = np.asarray(a) * signs, np.asarray(b) * signs
    return bool(np.all(a >= b) and np.any(a > b))


class ParetoTrials:
    """Mixin for a `keras_tuner.Oracle` with a list of objectives: objective
    vectors, fronts, and the best trials front by front."""

    @property
    def signs(self):
        """+1 for each objective to maximise, -1 for each to minimise, in order."""
        return np.array([1.0 if o.direction == "max" else -1.0 for o in _objectives(self)])

    def objective_values(self, trial):
        """The trial's value for each objective, in the order given; None if one is missing."""
        if trial.status != _COMPLETED:
            return None
        values = []
        for objective in _objectives(self):
            if not trial.metrics.exists(objective.name):
                return None
            value = trial.metrics.get_last_value(objective.name)
            if value is None or not np.isfinite(value):
                return None
            values.append(float(value))
        return values

    def score_trial(self, trial):
        # keras-tuner's own scalar (the sum to minimise, maximised objectives
        # negated) for its displays; fronts use the vector. A non-finite
        # objective leaves NaN, which keras-tuner records as an invalid trial.
        values = self.objective_values(trial)
        trial.score = float("nan") if values is None else float(-np.dot(self.signs, values))
        trial.best_step = 0

    def _members(self, trial_ids=None):
        """DEAP individuals for the finished trials: genes, vector fitness, trial id."""
        encoding = Encoding(self.hyperparameters)
        fitness = type("ParetoFitness", (base.Fitness,), {"weights": tuple(self.signs)})
        members = []
        for trial_id in self.trials if trial_ids is None else trial_ids:
            trial = self.trials[trial_id]
            values = self.objective_values(trial)
            if values is None:
                continue
            member = _Member(encoding.encode(trial.hyperparameters.values))
            member.fitness = fitness(values)
            member.key = trial_id
            members.append(member)
        return members

    def fronts(self):
        """Lists of trials, the Pareto front first, then the front behind it, ..."""
        members = self._members()
        if not members:
            return []
        ranked = tools.sortNondominated(members, len(members))
        fronts = []
        for front in ranked:
            tools.emo.assignCrowdingDist(front)
            # Within a front, the trials that spread it most (its ends) come first.
            front = sorted(front, key=lambda m: (-m.fitness.crowding_dist,
                                                 storage.trial_order(m.key)))
            fronts.append([self.trials[m.key] for m in front])
        return fronts

    def pareto_front(self):
        """The finished trials that no other finished trial dominates."""
        fronts = self.fronts()
        return fronts[0] if fronts else []

    def get_best_trials(self, num_trials=1):
        ranked = [trial for front in self.fronts() for trial in front]
        return ranked[:num_trials]


def plot_front(oracle, path=None, objectives=(0, 1), ax=None):
    """Plots two objectives of every finished trial, the Pareto front as a line.

    Args:
        oracle: an oracle with `ParetoTrials` (`NSGA2Oracle`, `ParEGOOracle`).
        path: where to save the figure (PNG, PDF, ... by its suffix); None
            leaves it open.
        objectives: the two objectives to plot, by position in the list.
        ax: a matplotlib axes to draw on (default: a new figure).

    Returns:
        The matplotlib axes.

    Raises:
        ValueError: no trial has finished yet.
    """
    import matplotlib

    if ax is None and path is not None:
        matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    first, second = objectives
    names = [o.name for o in _objectives(oracle)]
    trials = [t for t in oracle.trials.values() if oracle.objective_values(t) is not None]
    if not trials:
        raise ValueError("no finished trial to plot yet")
    points = np.array([oracle.objective_values(t) for t in trials])
    front = np.array([oracle.objective_values(t) for t in oracle.pareto_front()])
    front = front[np.argsort(front[:, first])]
    if ax is None:
        _, ax = plt.subplots(figsize=(5, 4))
    ax.scatter(points[:, first], points[:, second], s=12, color="0.6", label="trials")
    ax.step(front[:, first], front[:, second], where="post", color="C3",
            label="Pareto front")
    ax.scatter(front[:, first], front[:, second], s=24, color="C3")
    ax.set_xlabel(f"{names[first]} ({_objectives(oracle)[first].direction})")
    ax.set_ylabel(f"{names[second]} ({_objectives(oracle)[second].direction})")
    ax.legend(frameon=False)
    if path is not None:
        ax.figure.tight_layout()
        ax.figure.savefig(path)
        plt.close(ax.figure)
    return ax


class _Member(list):
    """Genes DEAP's NSGA-II tools can rank (they set `fitness.crowding_dist`)."""


class NSGA2Oracle(ParetoTrials, storage.WholeSaves, kt.Oracle):
    """NSGA-II: parents chosen by non-dominated rank and crowding, children by
    simulated binary crossover and polynomial mutation (DEAP's
    `cxSimulatedBinaryBounded` and `mutPolynomialBounded`).

    Steady-state, so no request ever waits for a generation: the first
    `population_size` trials are random; after that each request selects the
    `population_size` best finished trials with DEAP's `selNSGA2` and breeds
    one child from two of them picked by `selTournamentDCD`. Unordered
    choices are inherited from either parent and resampled on mutation.

    A multi-objective search has no single best trial but a Pareto front:
    the trials no other trial beats on every objective at once. The oracle
    keeps keras-tuner's summed `trial.score` for its displays (maximised
    objectives negated) and ranks trials by fronts:

    - `pareto_front()`: the finished trials no other finished trial dominates;
    - `fronts()`: every front in order, the Pareto front first (within a
      front, the trials that spread it most come first);
    - `get_best_trials(n)`: the first `n` trials, front by front;
    - `objective_values(trial)`: a trial's values in the objectives' order
      (None until it has finished with every one);
    - `signs`: +1 for each maximised objective, -1 for each minimised one.

    `max_trials`, `hyperparameters`, `allow_new_entries`, `tune_new_entries`,
    `max_retries_per_trial` and `max_consecutive_failed_trials` are as for
    any `keras_tuner.Oracle`.

    Args:
        objective: a list of at least two objectives (`keras_tuner.Objective`
            or names whose direction keras-tuner can infer).
        population_size: parents kept (at least 4, as DEAP's tournament
            needs).
        crossover_eta: distribution index of the crossover (larger: children
            nearer their parents).
        mutation_eta: distribution index of the mutation (larger: mutants
            nearer their parents).
        mutation_rate: chance that each gene mutates (default: 1 / genes).
        seed: makes a search reproducible.

    Raises:
        ValueError: fewer than two objectives, `population_size` below 4,
            an eta <= 0, `mutation_rate` outside [0, 1], or a negative seed.

    Example:

        >>> import keras_tuner as kt
        >>> oracle = NSGA2Oracle(objective=[kt.Objective("val_accuracy", "max"),
        ...                                 kt.Objective("parameters", "min")], max_trials=40)
        >>> oracle.population_size
        8
    """

    def __init__(self, objective=None, max_trials=64, population_size=8, crossover_eta=15.0,
                 mutation_eta=20.0, mutation_rate=None, seed=None, hyperparameters=None,
                 allow_new_entries=True, tune_new_entries=True, max_retries_per_trial=0,
                 max_consecutive_failed_trials=3):
        super().__init__(objective=objective, max_trials=max_trials,
                         hyperparameters=hyperparameters, allow_new_entries=allow_new_entries,
                         tune_new_entries=tune_new_entries, seed=seed,
                         max_retries_per_trial=max_retries_per_trial,
                         max_consecutive_failed_trials=max_consecutive_failed_trials)
        keep_seed(self, seed)
        _objectives(self)
        # DEAP's NSGA-II tournament draws four.
        whole_number(population_size, "population_size", minimum=4)
        for name, value in (("crossover_eta", crossover_eta), ("mutation_eta", mutation_eta)):
            if value <= 0:
                raise ValueError(f"{name} must be > 0; got {value}.")
        if mutation_rate is not None and not 0.0 <= mutation_rate <= 1.0:
            raise ValueError(f"mutation_rate must lie in [0, 1]; got {mutation_rate}.")
        self.population_size = int(population_size)
        self.crossover_eta, self.mutation_eta = float(crossover_eta), float(mutation_eta)
        self.mutation_rate = mutation_rate

    # keras-tuner's hook: one call per new trial.
    def populate_space(self, trial_id):
        encoding = Encoding(self.hyperparameters)
        rng = np.random.default_rng([self.seed, trial_number(trial_id)])
        if encoding.dimensions == 0:
            return trial_response(random_values(self))
        members = self._members([t for t in self.trials if t != trial_id])
        if len(members) < self.population_size:
            return trial_response(unique_values(self, encoding, encoding.random(rng), rng))
        with _seeded_random(int(rng.integers(2 ** 31))):
            parents = tools.selNSGA2(members, self.population_size)
            first, second = [list(m) for m in tools.selTournamentDCD(parents, 2)[:2]]
            genes = self._breed(encoding, first, second, rng)
        return trial_response(unique_values(self, encoding, genes, rng))

    def _breed(self, encoding, first, second, rng):
        child, other = tools.cxSimulatedBinaryBounded(list(first), list(second),
                                                     self.crossover_eta, 0.0, 1.0)
        child = np.array(child)
        pick = rng.uniform(size=child.shape) < 0.5
        child[encoding.categorical] = np.where(pick, first, second)[encoding.categorical]
        rate = self.mutation_rate if self.mutation_rate is not None else 1.0 / len(child)
        (mutated,) = tools.mutPolynomialBounded(list(child), self.mutation_eta, 0.0, 1.0,
                                                rate)
        mutated = np.array(mutated)
        resample = encoding.categorical & (rng.uniform(size=child.shape) < rate)
        mutated[resample] = rng.uniform(size=int(resample.sum()))
        return np.clip(mutated, 0.0, 1.0)

    def get_state(self):
        state = super().get_state()
        state.update(population_size=self.population_size, crossover_eta=self.crossover_eta,
                     mutation_eta=self.mutation_eta, mutation_rate=self.mutation_rate)
        return state

    def set_state(self, state):
        super().set_state(state)
        self.population_size = state["population_size"]
        self.crossover_eta, self.mutation_eta = state["crossover_eta"], state["mutation_eta"]
        self.mutation_rate = state["mutation_rate"]


class ParEGOOracle(ParetoTrials, BayesianOracle):
    """Bayesian search of a Pareto front (ParEGO): each proposal maximises
    expected improvement of one random scalarisation.

    Each new trial draws weights on the simplex (seeded by its id) and
    scalarises the finished trials' objectives, each scaled to [0, 1] over
    the trials so far, with the augmented Chebyshev function
    `max_i w_i f_i + 0.05 sum_i w_i f_i` (every objective turned into a loss).
    kdist's Gaussian process then proposes for that scalarisation, so
    successive trials aim at different parts of the front. It has
    `NSGA2Oracle`'s Pareto methods: `pareto_front()`, `fronts()`,
    `get_best_trials(n)` front by front, `objective_values(trial)` and
    `signs`.

    Args:
        objective: a list of at least two objectives.
        **kwargs: `BayesianOracle`'s other arguments.

    Raises:
        ValueError: fewer than two objectives, or a bad `BayesianOracle`
            argument.

    Example:

        >>> import keras_tuner as kt
        >>> oracle = ParEGOOracle(objective=[kt.Objective("val_loss", "min"),
        ...                                  kt.Objective("latency", "min")], max_trials=30)
    """

    def __init__(self, objective=None, **kwargs):
        super().__init__(objective=objective, **kwargs)
        _objectives(self)

    def _data(self, encoding, trial_id):
        finished, losses, pending = [], [], []
        for trial in self.trials.values():
            if trial.trial_id == trial_id:
                continue
            values = self.objective_values(trial)
            if values is not None:
                finished.append(encoding.encode(trial.hyperparameters.values))
                losses.append(-self.signs * np.array(values))
            elif trial.status == kt.engine.trial.TrialStatus.RUNNING:
                pending.append(encoding.encode(trial.hyperparameters.values))
        if not losses:
            return np.array(finished), np.array([]), np.array(pending)
        losses = np.array(losses)
        low, span = losses.min(axis=0), np.ptp(losses, axis=0)
        scaled = (losses - low) / np.where(span > 0, span, 1.0)
        weights = np.random.default_rng([self.seed, trial_number(trial_id), 7]).dirichlet(
            np.ones(losses.shape[1]))
        scores = np.max(weights * scaled, axis=1) + 0.05 * scaled @ weights
        return np.array(finished), scores, np.array(pending)
