"""Frechet and kernel physics distances (FPD and KPD) between two sets of features.

The definitions are those of Kansal et al., "Evaluating generative models in
high energy physics" (Phys. Rev. D 107, 076017, arXiv:2211.10295), as the
CaloChallenge reports them:

- both samples are scaled feature by feature by the largest absolute value
  in the reference sample;
- FPD: the Frechet distance between Gaussians fitted to the two samples,
  `|mu_1 - mu_2|^2 + Tr(C_1 + C_2 - 2 (C_1 C_2)^(1/2))`, measured on bootstrap
  batches of sizes spaced evenly in 1/N and extrapolated linearly to
  1/N = 0, which removes the estimator's bias; the error is the fit's;
- KPD: the unbiased estimate of the squared maximum mean discrepancy with
  the polynomial kernel `(x . y / d + 1)^4`, on bootstrap batches; the value
  is the median over batches and the error half the 16-84 % range.

Both are 0 for identical distributions; a second sample of the reference
gives the floor that a finite sample allows.

The building blocks are scipy (`linalg.sqrtm`, `optimize.curve_fit`,
`stats.iqr`) and scikit-learn (`metrics.pairwise.polynomial_kernel`).
"""

import numpy as np


def normalise(reference, other):
    """Both samples divided by the reference's largest absolute value per feature."""
    reference = np.asarray(reference, np.float64)
    other = np.asarray(other, np.float64)
    if reference.ndim != 2 or other.ndim != 2 or reference.shape[1] != other.shape[1]:
        raise ValueError("Features must be (N, d) arrays with the same d; got "
                         f"{reference.shape} and {other.shape}.")
    scale = np.abs(reference).max(axis=0)
    scale[scale == 0] = 1.0
    return reference / scale, other / scale


def frechet_distance(mean_1, cov_1, mean_2, cov_2):
    """The Frechet (2-Wasserstein) distance squared between two Gaussians."""
    import warnings

    from scipy import linalg

    cov_1, cov_2 = np.atleast_2d(cov_1), np.atleast_2d(cov_2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", linalg.LinAlgWarning)
        root = linalg.sqrtm(cov_1 @ cov_2)
    if caught or not np.isfinite(root).all():
        # A singular product (fewer samples than features): move both covariances a
        # little off the singularity.
        shift = 1e-6 * np.eye(len(cov_1))
        root = linalg.sqrtm((cov_1 + shift) @ (cov_2 + shift))
    root = np.real(root)
    difference = np.atleast_1d(mean_1) - np.atleast_1d(mean_2)
    return float(difference @ difference + np.trace(cov_1) + np.trace(cov_2)
                 - 2.0 * np.trace(root))


def fpd(reference, other, min_samples=None, max_samples=None, batches=10, points=5, seed=0):
    """(FPD, error): the Frechet distance extrapolated to infinitely many samples.

    Batch sizes run from `min_samples` (default a quarter of the smaller
    sample, and at least the number of features + 2) to `max_samples` (default
    the smaller sample), `points` sizes evenly spaced in 1/N, `batches`
    bootstrap draws each.
    """
    from scipy.optimize import curve_fit

    x, y = normalise(reference, other)
    n = min(len(x), len(y))
    max_samples = int(max_samples or n)
    # Fewer samples than features + 2 leave the covariance singular: allowed, but not
    # by default when there are more.
    min_samples = int(min_samples or max(2, min(max_samples, max(x.shape[1] + 2, n // 4))))
    if not 2 <= min_samples <= max_samples <= n:
        raise ValueError(f"Need 2 <= min_samples <= max_samples <= {n} (the smaller sample); "
                         f"got {min_samples} and {max_samples}.")
    sizes = (1.0 / np.linspace(1.0 / min_samples, 1.0 / max_samples, points)).astype(int)
    rng = np.random.default_rng(seed)
    means = []
    for size in sizes:
        values = []
        for _ in range(batches):
            a = x[rng.integers(0, len(x), size)]
            b = y[rng.integers(0, len(y), size)]
            values.append(frechet_distance(a.mean(axis=0), np.cov(a, rowvar=False),
                                           b.mean(axis=0), np.cov(b, rowvar=False)))
        means.append(np.mean(values))
    (intercept, _), covariance = curve_fit(lambda t, c, s: c + s * t, 1.0 / sizes, means,
                                           bounds=([0.0, 0.0], [np.inf, np.inf]))
    return float(intercept), float(np.sqrt(covariance[0, 0]))


def mmd_polynomial(x, y, degree=4):
    """The unbiased squared MMD between samples x and y with kernel (x . y / d + 1)^degree."""
    from sklearn.metrics.pairwise import polynomial_kernel

    gamma = 1.0 / x.shape[1]
    xx = polynomial_kernel(x, degree=degree, gamma=gamma, coef0=1.0)
    yy = polynomial_kernel(y, degree=degree, gamma=gamma, coef0=1.0)
    xy = polynomial_kernel(x, y, degree=degree, gamma=gamma, coef0=1.0)
    m, n = len(x), len(y)
    return float((xx.sum() - np.trace(xx)) / (m * (m - 1))
                 + (yy.sum() - np.trace(yy)) / (n * (n - 1)) - 2.0 * xy.mean())


def kpd(reference, other, batch_size=None, batches=10, seed=0):
    """(KPD, error): the median of the squared MMD over bootstrap batches, and half
    their 16-84 % range. `batch_size` defaults to half the smaller sample, at most 5000."""
    from scipy.stats import iqr

    x, y = normalise(reference, other)
    batch_size = int(batch_size or min(5000, max(2, min(len(x), len(y)) // 2)))
    if batch_size < 2:
        raise ValueError(f"batch_size must be at least 2; got {batch_size}.")
    rng = np.random.default_rng(seed)
    values = [mmd_polynomial(x[rng.integers(0, len(x), batch_size)],
                             y[rng.integers(0, len(y), batch_size)]) for _ in range(batches)]
    return float(np.median(values)), float(iqr(values, rng=(16, 84)) / 2.0)
