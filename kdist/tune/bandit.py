"""PB2's explore step (Parker-Holder et al. 2020): new hyper-parameters for an
exploiting member from a Gaussian-process bandit over the population's rounds,
instead of random perturbations.

Every finished round that continued a checkpoint is one observation: where it
ended in time and the values it trained with, against how much it moved the
score. A Gaussian process fitted to them predicts the change new values would
bring in the next round; the member takes the values with the highest upper
confidence bound within the search space's bounds.
"""

import numpy as np

from kdist.tune.bayesian import fit_process
from kdist.tune.space import Encoding

# Observations needed before the model is trusted; fewer fall back to perturbing.
MIN_OBSERVATIONS = 4
# Upper confidence bound: mean + KAPPA x spread, on standardised changes.
KAPPA = 2.0
CANDIDATES = 1024


def observations(rounds, maximise):
    """(time, values, change) of each round that continued a finished one.

    `rounds`: (values, score, parent's score or None) of finished rounds;
    values hold `tuner/epochs`. The change is signed so that larger is better.
    """
    sign = 1.0 if maximise else -1.0
    return [(values["tuner/epochs"], values, sign * (score - before))
            for values, score, before in rounds
            if before is not None and score is not None and np.isfinite(score - before)]


def choose(hyperparameters, observed, donated, end_epoch, max_epochs, rng):
    """Values for a round ending at `end_epoch`: those, among random points of
    the space and the donor's own, with the highest upper confidence bound of
    the change the fitted process predicts. None when too few rounds are known.

    Args:
        hyperparameters: the oracle's `HyperParameters`.
        observed: `observations(...)`.
        donated: the donor's values (kept for keys outside the space).
        end_epoch: the epoch at which the new round ends.
        max_epochs: the epochs of the whole training.
        rng: a numpy Generator.
    """
    if len(observed) < MIN_OBSERVATIONS:
        return None
    encoding = Encoding(hyperparameters)
    if encoding.dimensions == 0:
        return None
    times = np.array([[t / max_epochs] for t, _, _ in observed])
    inputs = np.hstack([times, np.array([encoding.encode(v) for _, v, _ in observed])])
    changes = np.array([c for _, _, c in observed], dtype=float)
    spread = changes.std()
    targets = (changes - changes.mean()) / (spread if spread > 0 else 1.0)
    model = fit_process(inputs, targets, rng, restarts=1)
    points = np.vstack([encoding.random(rng, CANDIDATES), encoding.encode(donated)[None]])
    when = np.full((len(points), 1), end_epoch / max_epochs)
    mean, std = model.predict(np.hstack([when, points]), return_std=True)
    best = points[int(np.argmax(mean + KAPPA * std))]
    chosen = dict(donated)
    chosen.update(encoding.decode(best))
    return chosen
