"""Genetic operators on genomes in the unit cube, as small functions.

A genome is a numpy vector with one gene per hyper-parameter (see
`kdist.tune.space.Encoding`); `categorical` marks the unordered choices, for
which arithmetic means nothing and which are inherited or resampled instead.
Each function takes its random generator, so a seeded search is reproducible.
"""

import random

import numpy as np
from deap import base, tools


class Fitness(base.Fitness):
    """DEAP fitness: one value, larger is better."""

    weights = (1.0,)


class Individual(list):
    """A genome DEAP's selection tools can rank; `key` names where it came from."""

    def __init__(self, genes, fitness, key=None):
        super().__init__(float(g) for g in genes)
        self.fitness = Fitness((float(fitness),))
        self.key = key


def directed_crossover(fitter, other, rng, categorical=None):
    """A child beyond the fitter parent, away from the other: `r * (A - B) + A`.

    `r` is uniform in (0, 1) and the child is clipped to the cube. Categorical
    genes come from either parent with equal chance.

    >>> import numpy as np
    >>> rng = np.random.default_rng(0)
    >>> directed_crossover(np.array([0.5, 0.5]), np.array([0.25, 1.0]), rng).round(3)
    array([0.659, 0.182])
    """
    fitter, other = np.asarray(fitter, float), np.asarray(other, float)
    r = rng.uniform()
    child = np.clip(r * (fitter - other) + fitter, 0.0, 1.0)
    if categorical is not None and np.any(categorical):
        pick = rng.uniform(size=child.shape) < 0.5
        child[categorical] = np.where(pick, fitter, other)[categorical]
    return child


def nonuniform_mutation(genes, generation, generations, rng, rate, categorical=None):
    """Michalewicz's non-uniform mutation, annealed over the planned generations.

    Each gene mutates with probability `rate`: with `r1, r2` uniform,
    `m = (1 - r1 ** ((1 - g / G) ** 3)) * (1 - p if r2 > 0.5 else 0 - p)`, so a
    step may reach the bounds at generation 0 and shrinks to nothing at
    generation G. Categorical genes are resampled instead.

    >>> import numpy as np
    >>> rng = np.random.default_rng(1)
    >>> late = nonuniform_mutation(np.full(4, 0.5), 9, 10, rng, rate=1.0)
    >>> bool(np.all(np.abs(late - 0.5) < 0.01))
    True
    """
    genes = np.array(genes, dtype=float)
    progress = min(max(generation / generations, 0.0), 1.0) if generations else 1.0
    shrink = (1.0 - progress) ** 3
    for i in range(genes.size):
        if rng.uniform() >= rate:
            continue
        if categorical is not None and categorical[i]:
            genes[i] = rng.uniform()
            continue
        r1, r2 = rng.uniform(size=2)
        towards = (1.0 - genes[i]) if r2 > 0.5 else (0.0 - genes[i])
        genes[i] += (1.0 - r1 ** shrink) * towards
    return np.clip(genes, 0.0, 1.0)


def select_elite(individuals, fraction):
    """The best `ceil(fraction * len)` individuals (DEAP's `selBest`), at least one."""
    count = max(1, int(np.ceil(fraction * len(individuals))))
    return tools.selBest(individuals, min(count, len(individuals)))


def binary_tournament(individuals, count, rng):
    """`count` winners of two-way tournaments (DEAP's `selTournament`, seeded by `rng`)."""
    state = random.getstate()
    random.seed(int(rng.integers(2 ** 31)))
    try:
        return tools.selTournament(individuals, count, tournsize=2)
    finally:
        random.setstate(state)
