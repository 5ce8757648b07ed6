"""The parameter-server update rules, as small functions on flat float32 arrays.

Every function here is pure arithmetic: no MPI, no Keras. Functions whose
name ends in `_` update their first argument(s) in place, so the master
never allocates a model-sized array per update.

An *update* is what a worker's own optimizer moved its replica by since it
last pulled the centre (`w_now - w_pulled`): with plain SGD at learning
rate 1 it is exactly minus the gradient.

>>> import numpy as np
>>> center = np.zeros(3, np.float32); worker = np.full(3, 2.0, np.float32)
>>> easgd_exchange_(worker, center, elastic_force=0.5, scratch=np.empty(3, np.float32))
>>> worker.tolist(), center.tolist()
([1.0, 1.0, 1.0], [1.0, 1.0, 1.0])
"""

import numpy as np

GEM_MAX_SCALE = 5.0
GEM_EPS = 1e-8


def staleness(clock, pulled_at):
    """How many central updates were applied since the sender last pulled."""
    if clock < pulled_at:
        raise ValueError(f"staleness: the clock ({clock}) is behind the pull ({pulled_at}).")
    return clock - pulled_at


def staleness_factor(stale):
    """The learning-rate factor of a staleness-aware update: 1/staleness (1 when fresh)."""
    return 1.0 / max(1, stale)


def downpour_apply(center, update, optimizer, out, scale=1.0):
    """Downpour: the master optimizer applies a worker's update to the centre.

    The new centre is written to `out`, which may be `center` itself: a
    server that keeps the result in the reply buffer saves a copy per update.
    `optimizer` is a `kdist.ps.MasterSGD`/`MasterAdam`; it treats `-update`
    as the gradient. `scale` (e.g. a staleness factor) multiplies the step.
    """
    if scale == 1.0 and optimizer.adds_plainly:
        np.add(center, update, out=out)
        return
    if out is not center:
        np.copyto(out, center)
    optimizer.apply_(out, update, scale)


def easgd_exchange_(worker, center, elastic_force, scratch, worker_out=None):
    """Elastic averaging: worker and centre move towards each other.

    `w <- w - a (w - c)` and `c <- c + a (w - c)`, computed once into
    `scratch`. The centre changes in place; the worker's new values go to
    `worker_out` (default: `worker`, in place).
    """
    if not 0.0 < elastic_force <= 1.0:
        raise ValueError(f"elastic_force must lie in (0, 1]; got {elastic_force}.")
    np.subtract(worker, center, out=scratch)
    scratch *= elastic_force
    center += scratch
    np.subtract(worker, scratch, out=worker if worker_out is None else worker_out)


def gem_momentum_(momentum, update, mu):
    """The momentum of one worker's own updates: `m <- mu m + u`."""
    momentum *= mu
    momentum += update


def gem_scale(update, momentum, drift, kappa, eps=GEM_EPS, out=None, scratch=None):
    """Gradient Energy Matching: the per-parameter factor for an incoming update.

    `pi = clip((kappa |m| - |d|) / (|u| + eps), 0, 5)`, where `m` is the
    worker's momentum, `d` how far the centre moved since that worker pulled
    and `u` the update. The collective then moves with about the energy of
    `kappa` times one worker's momentum, however many workers push.
    """
    out = np.empty_like(update) if out is None else out
    scratch = np.empty_like(update) if scratch is None else scratch
    np.abs(momentum, out=out)
    out *= kappa
    np.abs(drift, out=scratch)
    out -= scratch
    np.abs(update, out=scratch)
    scratch += eps
    out /= scratch
    np.clip(out, 0.0, GEM_MAX_SCALE, out=out)
    return out


def gem_apply_(center, update, momentum, drift, kappa, mu, scale=1.0, buffers=(None, None),
               out=None):
    """GEM at the master: update the worker's momentum, rescale `update`, add it.

    `update` is rescaled in place; `buffers` are two arrays of its size to
    compute in; the new centre goes to `out` (default: `center`, in place).
    Returns the mean factor, for logging.
    """
    gem_momentum_(momentum, update, mu)
    factor = gem_scale(update, momentum, drift, kappa, out=buffers[0], scratch=buffers[1])
    update *= factor
    if scale != 1.0:
        update *= scale
    np.add(center, update, out=center if out is None else out)
    return float(factor.mean()) if factor.size else 1.0
