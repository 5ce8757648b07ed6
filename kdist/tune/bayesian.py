"""A Gaussian-process oracle for keras-tuner, built on scikit-learn's GP regression."""

import logging
import warnings

import keras_tuner as kt
import numpy as np
from scipy import optimize, stats

from kdist._args import whole_number
from kdist.tune import storage
from kdist.tune.compat import keep_seed, random_values, trial_number
from kdist.tune.space import Encoding, trial_response, unique_values

logger = logging.getLogger(__name__)

# In the unit cube: shorter would fit noise, longer would ignore an input.
LENGTH_SCALE_BOUNDS = (5e-2, 2.0)
# Log-normal prior of each length scale: median 0.3, a factor of 2 either side
# for one standard deviation. Maximum likelihood alone, with a few dozen points
# in six dimensions, sends length scales to their bounds; with this prior the
# median regret on Hartmann-6 (30 trials, 40 seeds) fell from 0.126 to 0.010.
LENGTH_SCALE_PRIOR = (np.log(0.3), 0.7)
# Draws of the running trials' scores that expected improvement is averaged
# over while trials run (a power of two, for the Sobol sequence that draws them).
FANTASIES = 16
# Within this many fitted length scales of a running trial (distance scaled
# input by input) a proposal is that trial again: nothing is left to learn
# there that the running trial will not tell. Expected improvement alone
# allows it where every other point looks worse, as when the fitted noise
# absorbs a kink and the best trial's neighbourhood stays uncertain.
SEPARATION = 0.1


def expected_improvement(mean, std, best, xi=0.0):
    """E[max(best - f - xi, 0)] for f ~ N(mean, std^2): improvement below `best`.

    >>> import numpy as np
    >>> round(float(expected_improvement(np.array([0.0]), np.array([1.0]), 0.0)[0]), 4)
    0.3989
    """
    std = np.maximum(std, 1e-12)
    z = (best - mean - xi) / std
    return (best - mean - xi) * stats.norm.cdf(z) + std * stats.norm.pdf(z)


def warp(scores):
    """Scores made closer to Gaussian (Yeo-Johnson, then standardised), order kept.

    Losses are skewed: a few bad trials would set the process's scale and
    flatten the region of the good ones.
    """
    from sklearn.preprocessing import PowerTransformer

    scores = np.asarray(scores, dtype=float)
    if len(scores) < 3 or np.ptp(scores) == 0:
        return scores
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        warped = PowerTransformer(method="yeo-johnson").fit_transform(scores[:, None])[:, 0]
    return warped if np.all(np.isfinite(warped)) else scores


def standardised(losses):
    """Warped losses with mean 0 and spread 1."""
    losses = warp(losses)
    return (losses - losses.mean()) / (losses.std() or 1.0)


def _with_length_scale_prior(dimensions):
    """scikit-learn's `optimizer` hook: L-BFGS-B on the log marginal likelihood
    plus the log prior of the length scales (a maximum a posteriori fit)."""
    centre, spread = LENGTH_SCALE_PRIOR
    # theta is the kernel's log hyper-parameters: constant, length scales, noise.
    scales = slice(1, 1 + dimensions)

    def minimise(objective, theta, bounds):
        def penalised(theta):
            value, gradient = objective(theta, eval_gradient=True)
            distance = theta[scales] - centre
            gradient = np.array(gradient, dtype=float)
            gradient[scales] += distance / spread ** 2
            return value + np.sum(distance ** 2) / (2 * spread ** 2), gradient

        found = optimize.minimize(penalised, theta, jac=True, method="L-BFGS-B", bounds=bounds)
        return found.x, found.fun

    return minimise


def fit_process(inputs, targets, rng, restarts=3):
    """A Gaussian process (scikit-learn) fitted to `targets` at points of the unit cube.

    Matern 5/2 with one length scale per input, times a constant, plus a
    small noise term; hyper-parameters by maximum a posteriori, with a
    log-normal prior on the length scales, from `1 + restarts` starts.
    """
    from sklearn.gaussian_process import GaussianProcessRegressor
    from sklearn.gaussian_process.kernels import ConstantKernel, Matern, WhiteKernel

    kernel = (ConstantKernel(1.0, (1e-2, 1e2))
              * Matern(np.full(inputs.shape[1], 0.5), LENGTH_SCALE_BOUNDS, nu=2.5)
              + WhiteKernel(1e-4, (1e-8, 1e-1)))
    model = GaussianProcessRegressor(kernel, normalize_y=False, n_restarts_optimizer=restarts,
                                     optimizer=_with_length_scale_prior(inputs.shape[1]),
                                     random_state=int(rng.integers(2 ** 31)))
    with warnings.catch_warnings():
        # Length scales at their bounds are expected with few points.
        warnings.simplefilter("ignore")
        model.fit(inputs, targets)
    return model


def fantasised_improvement(model, finished, scores, pending, asked, best, xi, count, rng):
    """Expected improvement averaged over `count` fantasies of the running trials.

    Each fantasy draws the running trials' scores (`pending`) jointly from
    `model`'s posterior, then conditions the process on the finished trials
    and the drawn scores, with `model`'s fitted hyper-parameters kept. A drawn
    score below `best` at the asked budget (rows where `asked` is true)
    becomes that fantasy's score to beat. Next to a running trial every
    fantasy knows the score, so there is little left to gain; how far that
    reaches, and along which inputs, is set by the fitted length scales.
    Returns a function of points of the cube.
    """
    from scipy.linalg import cho_factor, cho_solve

    signal, noise = model.kernel_.k1, model.kernel_.k2.noise_level
    # The posterior at the running trials, from the fit's own Cholesky factor.
    across = signal(pending, finished)
    mean = across @ model.alpha_
    covariance = signal(pending) - across @ cho_solve((model.L_, True), across.T)
    values, vectors = np.linalg.eigh((covariance + covariance.T) / 2)
    # Quasi-random normal draws (scrambled Sobol): with a few dozen of them
    # the average is far steadier than with independent ones.
    uniform = stats.qmc.Sobol(len(pending), scramble=True, seed=rng).random(count)
    normal = stats.norm.ppf(np.clip(uniform, 1e-9, 1 - 1e-9))
    drawn = mean + normal @ (vectors * np.sqrt(np.maximum(values, 0.0))).T
    # A fantasy is a noiseless score: a running trial's point is then as
    # good as measured, and nothing is left to gain right beside it.
    inputs = np.vstack([finished, pending])
    noises = np.concatenate([np.full(len(finished), noise), np.full(len(pending), 1e-6)])
    factor = cho_factor(signal(inputs) + np.diag(noises), lower=True)
    targets = np.vstack([np.tile(scores[:, None], (1, count)), drawn.T])
    weights = cho_solve(factor, targets)
    bests = np.full(count, best)
    if asked.any():
        bests = np.minimum(bests, drawn[:, asked].min(axis=1))

    def improvement(points):
        across = signal(points, inputs)
        means = across @ weights
        variance = signal.diag(points) - np.sum(across * cho_solve(factor, across.T).T, axis=1)
        std = np.sqrt(np.maximum(variance, 1e-12))[:, None]
        return expected_improvement(means, std, bests[None, :], xi).mean(axis=1)

    return improvement


class BayesianOracle(storage.WholeSaves, kt.Oracle):
    """Gaussian-process search with expected improvement.

    The first `num_initial_points` trials come from a scrambled Sobol
    sequence. After that each trial maximises expected improvement under a
    Gaussian process (scikit-learn; Matern 5/2 kernel with one length scale
    per input, plus a noise term) fitted to the finished trials by maximum a
    posteriori, with a log-normal prior on the length scales. Inputs are
    the unit cube of each hyper-parameter's own scale (log scales stay log,
    integers are rounded), unordered choices are one-hot; scores are warped
    to be closer to Gaussian (Yeo-Johnson) and standardised. While trials
    run, expected improvement is averaged over 16 draws of their scores from
    the fitted process ("fantasies"; a drawn score better than the best
    result is that draw's score to beat), so concurrent requests spread out
    instead of crowding one point. Trials still running count towards the
    initial design. A proposal never repeats a trial.

    `objective`, `max_trials`, `hyperparameters`, `allow_new_entries`,
    `tune_new_entries`, `max_retries_per_trial` and
    `max_consecutive_failed_trials` are as for any `keras_tuner.Oracle`.

    Args:
        num_initial_points: Sobol trials before the model takes over
            (default: 2 per dimension, at least 3, at most `max_trials // 3`
            once the search space is known).
        xi: exploration margin of expected improvement, in standardised units.
        candidates: random points scored before the local optimisation.
        seed: makes a search reproducible.

    Raises:
        ValueError: `num_initial_points` or `candidates` below 1 or
            fractional, `xi < 0`, or a negative seed.

    Example:

        >>> import keras_tuner as kt
        >>> oracle = BayesianOracle(objective=kt.Objective("val_loss", "min"), max_trials=30)
    """

    def __init__(self, objective=None, max_trials=30, num_initial_points=None, xi=0.01,
                 candidates=2000, seed=None, hyperparameters=None, allow_new_entries=True,
                 tune_new_entries=True, max_retries_per_trial=0,
                 max_consecutive_failed_trials=3):
        super().__init__(objective=objective, max_trials=max_trials,
                         hyperparameters=hyperparameters, allow_new_entries=allow_new_entries,
                         tune_new_entries=tune_new_entries, seed=seed,
                         max_retries_per_trial=max_retries_per_trial,
                         max_consecutive_failed_trials=max_consecutive_failed_trials)
        keep_seed(self, seed)
        if num_initial_points is not None:
            num_initial_points = whole_number(num_initial_points, "num_initial_points",
                                              minimum=1)
        if xi < 0:
            raise ValueError(f"xi must be >= 0; got {xi}.")
        whole_number(candidates, "candidates", minimum=1)
        self.num_initial_points = num_initial_points
        self.xi = float(xi)
        self.candidates = int(candidates)

    def initial_points(self, dimensions):
        if self.num_initial_points is not None:
            return self.num_initial_points
        return max(3, min(2 * dimensions, (self.max_trials or 30) // 3))

    # keras-tuner's hook: one call per new trial.
    def populate_space(self, trial_id):
        encoding = Encoding(self.hyperparameters, one_hot=True)
        if encoding.dimensions == 0:
            return trial_response(random_values(self))
        rng = np.random.default_rng([self.seed, trial_number(trial_id)])
        finished, scores, pending = self._data(encoding, trial_id)
        # Trials still running count towards the initial design: groups asking
        # at once would otherwise each draw design points until the first
        # results arrive, and leave the model fewer trials than it is meant to have.
        if len(finished) < 2 or (len(finished) + len(pending)
                                 < self.initial_points(encoding.dimensions)):
            return trial_response(self._unique(encoding, self._sobol(encoding, trial_id), rng))
        return trial_response(self._unique(encoding,
                                          self._propose(encoding, finished, scores, pending,
                                                        rng), rng))

    def _data(self, encoding, trial_id):
        finished, scores, pending = [], [], []
        for trial in self.trials.values():
            if trial.trial_id == trial_id:
                continue
            vector = encoding.encode(trial.hyperparameters.values)
            if trial.status == kt.engine.trial.TrialStatus.COMPLETED:
                if trial.score is not None and np.isfinite(trial.score):
                    finished.append(vector)
                    sign = 1.0 if self.objective.direction == "min" else -1.0
                    scores.append(sign * trial.score)
            elif trial.status == kt.engine.trial.TrialStatus.RUNNING:
                pending.append(vector)
        return np.array(finished), np.array(scores), np.array(pending)

    def _sobol(self, encoding, trial_id):
        sampler = stats.qmc.Sobol(encoding.dimensions, scramble=True, seed=self.seed)
        index = trial_number(trial_id) % (1 << 20)
        if index:
            sampler.fast_forward(index)
        return sampler.random(1)[0]

    def _propose(self, encoding, finished, scores, pending, rng, context=(), incumbent=None):
        """The point of the cube that maximises expected improvement.

        `context` is appended to every point the search tries and is not
        optimised (BOHB's budget column); `finished` and `pending` already
        carry it. `incumbent` picks which finished rows' best score is the one
        to improve on (default: all).
        """
        context = np.asarray(context, dtype=float)
        # Shifted so that the prior mean is the worst score seen: far from
        # every trial the process then expects a bad result, not an average
        # one, and expected improvement stops favouring the corners of the
        # cube just because they are uncertain.
        scores = standardised(scores)
        scores = scores - scores.max()
        model = fit_process(finished, scores, rng)
        among = np.arange(len(scores)) if incumbent is None else np.flatnonzero(incumbent)
        best = scores[among].min()
        scale = scores.std() or 1.0
        if len(pending):
            # The fitted hyper-parameters are kept. A kriging believer with the
            # kernel's starting ones (length 0.5 on every input) made Branin, 4
            # trials kept running, reach a median regret of 0.22 over ten seeds
            # against 0.010 with fantasies (docs/performance.md). Only running
            # trials at the asked `context` (BOHB: the full budget) may set the
            # score to beat.
            asked = np.all(pending[:, pending.shape[1] - context.size:] == context, axis=1)
            fantasised = fantasised_improvement(model, finished, scores, pending, asked, best,
                                                self.xi * scale, FANTASIES, rng)
            lengths = model.kernel_.k1.k2.length_scale

            def improvement(points):
                apart = np.linalg.norm((points[:, None, :] - pending[None]) / lengths, axis=2)
                return np.where(apart.min(axis=1) < SEPARATION, 0.0, fantasised(points))
        else:
            def improvement(inputs):
                mean, std = model.predict(inputs, return_std=True)
                return expected_improvement(mean, std, best, self.xi * scale)

        def negative_ei(points):
            points = np.atleast_2d(points)
            inputs = np.hstack([points, np.broadcast_to(context, (len(points), context.size))])
            return -improvement(inputs)

        # Random points, and moves of several sizes around the best trials: in
        # more than a few dimensions random points alone rarely land where the
        # improvement is.
        dims = encoding.dimensions
        candidates = [rng.uniform(size=(self.candidates, dims))]
        for rank, index in enumerate(among[np.argsort(scores[among])][:3]):
            count = max(1, self.candidates // (2 * (rank + 1)))
            steps = rng.normal(size=(count, dims)) * rng.choice([0.01, 0.05, 0.15], (count, 1))
            candidates.append(np.clip(finished[index, :dims] + steps, 0.0, 1.0))
        # Improvement is scored where a point's values really are (integers and
        # steps rounded): two points that round alike are one trial, and a
        # proposal that rounds onto a running trial gains nothing. Scored
        # before rounding, concurrent proposals came back as one point; with
        # keras-tuner's own distributed test (an integer, a stepped float, 4
        # tuners) the search then crept along the stepped input a step a round.
        candidates = encoding.snap_points(np.vstack(candidates))
        values = negative_ei(candidates)
        starts = candidates[np.argsort(values)[:5]]
        best_point, best_value = starts[0], values.min()
        bounds = [(0.0, 1.0)] * encoding.dimensions
        for start in starts:
            found = optimize.minimize(lambda p: float(negative_ei(p)[0]), start,
                                      method="L-BFGS-B", bounds=bounds,
                                      options={"maxiter": 50})
            point = found.x
            value = found.fun
            if encoding.discrete:
                point = encoding.snap_points(found.x[None])[0]
                value = float(negative_ei(point)[0])
            if value < best_value:
                best_point, best_value = point, value
        return best_point

    def _unique(self, encoding, vector, rng):
        return unique_values(self, encoding, vector, rng)

    def get_state(self):
        state = super().get_state()
        state.update(num_initial_points=self.num_initial_points, xi=self.xi,
                     candidates=self.candidates)
        return state

    def set_state(self, state):
        super().set_state(state)
        self.num_initial_points = state["num_initial_points"]
        self.xi = state["xi"]
        self.candidates = state["candidates"]
