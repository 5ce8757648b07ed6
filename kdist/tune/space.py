"""keras-tuner search spaces as points of the unit cube, and back.

Oracles that reason about distances (a Gaussian process, a genetic
algorithm) need numbers. Each hyper-parameter maps to [0, 1] through its own
`value_to_prob` / `prob_to_value` (so log scales and integer steps are the
hyper-parameter's business), except unordered choices: the Gaussian process
sees them one-hot (`Encoding(one_hot=True)`), since an index would invent an
order. Fixed hyper-parameters take no dimension. Conditional hyper-parameters
keep their dimension; inactive ones are dropped when decoding, the way
keras-tuner expects only active values in a trial.
"""

import keras_tuner as kt
import numpy as np
from keras_tuner.engine import hyperparameters as hp_module

from kdist.tune import compat


def trial_response(values):
    """What an oracle's `populate_space` returns for `values` (None: the search is over)."""
    if values is None:
        return {"status": kt.engine.trial.TrialStatus.STOPPED, "values": None}
    return {"status": kt.engine.trial.TrialStatus.RUNNING, "values": values}


def unique_values(oracle, encoding, vector, rng):
    """The values of `vector`, jittered until no trial of `oracle` has them;
    random values (None when the space is exhausted) after 20 tries."""
    for _ in range(20):
        values = encoding.decode(vector)
        if not compat.is_duplicate(oracle, values):
            return values
        vector = np.clip(vector + rng.normal(scale=0.05, size=vector.shape), 0.0, 1.0)
    return compat.random_values(oracle)


def _is_categorical(hp):
    return isinstance(hp, hp_module.Choice) and not hp.ordered


def _is_continuous(hp):
    return isinstance(hp, hp_module.Float) and not hp.step


def _to_prob(hp, value):
    """`hp.value_to_prob(value)`, taking a stepped float to its own step.

    keras-tuner finds a step by floor division, so a value a rounding error
    below its step (-0.1 in steps of 0.1 from -1 is stored as
    -0.09999999999999998) went to the step below: a trial was seen one step
    from where it ran, and a search kept proposing the step it had run.
    """
    prob = hp.value_to_prob(value)
    if not (isinstance(hp, hp_module.Float) and hp.step):
        return prob
    tolerance = 1e-9 * (abs(value) + hp.step)
    for nudged in (value, value + tolerance, value - tolerance):
        prob = float(np.clip(hp.value_to_prob(nudged), 0.0, 1.0))
        if abs(hp.prob_to_value(prob) - value) <= 1e3 * tolerance:
            return prob
    return hp.value_to_prob(value)


class Encoding:
    """Maps trial values to vectors and vectors to trial values.

    Each hyper-parameter maps to [0, 1] through its own `value_to_prob` /
    `prob_to_value`, so log scales and integer steps are kept, except
    unordered choices with `one_hot`. Fixed hyper-parameters take no
    dimension. Conditional hyper-parameters keep their dimension; inactive
    ones are dropped when decoding, as keras-tuner expects only active values
    in a trial. `encode(values)`, `decode(vector)` and `random(rng, count)`
    go between trial values and the unit cube; `dimensions` is its size.

    Args:
        hyperparameters: the oracle's `HyperParameters` (its `space`).
        one_hot: encode unordered choices one-hot (one dimension per value);
            otherwise each takes one dimension holding its index as a probability.
    """

    def __init__(self, hyperparameters, one_hot=False):
        self.hyperparameters = hyperparameters
        self.space = [hp for hp in hyperparameters.space
                      if not isinstance(hp, hp_module.Fixed)]
        self.one_hot = one_hot
        self.slices, start = [], 0
        for hp in self.space:
            width = len(hp.values) if one_hot and _is_categorical(hp) else 1
            self.slices.append(slice(start, start + width))
            start += width
        self.dimensions = start
        self.categorical = np.zeros(start, dtype=bool)
        for hp, where in zip(self.space, self.slices):
            self.categorical[where] = _is_categorical(hp)
        # Whether some point of the cube stands for the same values as another.
        self.discrete = not all(_is_continuous(hp) for hp in self.space)

    def encode(self, values):
        """The vector of a dict of values; missing or inactive ones take their default."""
        vector = np.empty(self.dimensions)
        for hp, where in zip(self.space, self.slices):
            value = values.get(hp.name, hp.default)
            if value is None:
                value = hp.default if hp.default is not None else hp.prob_to_value(0.5)
            if self.one_hot and _is_categorical(hp):
                vector[where] = 0.0
                vector[where.start + hp.values.index(value)] = 1.0
            else:
                vector[where] = _to_prob(hp, value)
        return vector

    def decode(self, vector):
        """The active values of a vector, as keras-tuner wants them in a trial."""
        hps = hp_module.HyperParameters()
        for hp, where in zip(self.space, self.slices):
            hps.merge([hp])
            if not hps.is_active(hp):
                continue
            if self.one_hot and _is_categorical(hp):
                value = hp.values[int(np.argmax(vector[where]))]
            else:
                value = hp.prob_to_value(float(np.clip(vector[where.start], 0.0, 1.0)))
            hps.values[hp.name] = value
        for hp in self.hyperparameters.space:
            if isinstance(hp, hp_module.Fixed):
                hps.merge([hp])
                if hps.is_active(hp):
                    hps.values[hp.name] = hp.value
        return hps.values

    def snap(self, vector):
        """The vector of the values a vector decodes to (integers rounded, one-hot made exact)."""
        return self.encode(self.decode(vector))

    def snap_points(self, points):
        """Rows of the cube moved to the encodings of the values they decode to.

        Dimension by dimension (steps and integers rounded, one-hot blocks made
        exact), so that many points cost little; continuous dimensions are only
        clipped to the cube. Unlike `snap`, inactive conditional values are kept.
        """
        points = np.clip(np.array(points, dtype=float), 0.0, 1.0)
        for hp, where in zip(self.space, self.slices):
            if self.one_hot and _is_categorical(hp):
                block = points[:, where]
                points[:, where] = np.eye(block.shape[1])[np.argmax(block, axis=1)]
            elif not _is_continuous(hp):
                column = points[:, where.start]
                points[:, where.start] = [_to_prob(hp, hp.prob_to_value(float(p)))
                                          for p in column]
        return points

    def random(self, rng, count=None):
        """Uniform points of the cube, as valid encodings."""
        points = rng.uniform(size=(count or 1, self.dimensions))
        points = np.array([self.snap(p) for p in points])
        return points if count else points[0]
