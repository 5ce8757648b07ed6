"""How a server folds one child's message into the centre, per mode.

A rule owns the per-mode state a checkpoint must keep (master optimizer
slots, GEM momenta) and calls the pure functions of `algorithms`. It only
touches the first `trainable_size` values; the server copies the rest.

`absorb(child, incoming, center, reply, stale)` is called with `reply`
holding the centre that child pulled last. It leaves in `reply` what the
child gets back and returns the array that now holds the centre. Downpour
and GEM write the new centre straight into `reply` and return it, so the
reply costs no copy; they never write into `center`, which may be another
child's reply still on its way.
"""

import numpy as np

from kdist.ps import algorithms, kernels, master_optimizers

MODES = ("downpour", "easgd", "gem")


class DownpourRule:
    """Applies worker updates with the master optimizer; children pull the centre."""

    sends_weights = False

    def __init__(self, trainable_size, optimizer="sgd", staleness_aware=False):
        self.size = trainable_size
        self.optimizer = master_optimizers.get(optimizer)
        self.staleness_aware = staleness_aware

    def absorb(self, child, incoming, center, reply, stale):
        scale = algorithms.staleness_factor(stale) if self.staleness_aware else 1.0
        t = self.size
        algorithms.downpour_apply(center[:t], incoming[:t], self.optimizer, reply[:t], scale)
        return reply

    def get_state(self):
        return {f"optimizer/{k}": v for k, v in self.optimizer.get_state().items()}

    def set_state(self, state):
        self.optimizer.set_state({k.split("/", 1)[1]: v for k, v in state.items()
                                  if k.startswith("optimizer/")})


class EasgdRule:
    """Elastic exchange: the child sends its weights and gets them back pulled
    towards the centre, which moves towards the child by the same amount."""

    sends_weights = True

    def __init__(self, trainable_size, elastic_force):
        self.size = trainable_size
        self.elastic_force = elastic_force
        self._scratch = np.empty(trainable_size, dtype=np.float32)

    def absorb(self, child, incoming, center, reply, stale):
        t = self.size
        if kernels.compiled() is not None:
            kernels.easgd(incoming[:t], center[:t], reply[:t], self.elastic_force)
        else:
            algorithms.easgd_exchange_(incoming[:t], center[:t], self.elastic_force,
                                       self._scratch, worker_out=reply[:t])
        return center

    def get_state(self):
        return {}

    def set_state(self, state):
        pass


class GemRule:
    """Gradient Energy Matching: each update is rescaled per parameter before it
    is added. The momentum of a child's updates is kept here for it, which
    equals the child keeping it and costs no traffic."""

    sends_weights = False

    def __init__(self, trainable_size, kappa=1.5, momentum=0.9, staleness_aware=False):
        self.size = trainable_size
        self.kappa, self.mu = kappa, momentum
        self.staleness_aware = staleness_aware
        self.momenta = {}
        self._buffers = (np.empty(trainable_size, np.float32),
                         np.empty(trainable_size, np.float32))
        self._drift = np.empty(trainable_size, np.float32)
        self.last_mean_scale = 1.0

    def absorb(self, child, incoming, center, reply, stale):
        t = self.size
        momentum = self.momenta.get(child)
        if momentum is None:
            momentum = self.momenta[child] = np.zeros(t, np.float32)
        scale = algorithms.staleness_factor(stale) if self.staleness_aware else 1.0
        if kernels.compiled() is not None:
            # The reply buffer holds the centre this child pulled last time;
            # the loop reads it before writing the new centre there.
            self.last_mean_scale = kernels.gem(
                center[:t], incoming[:t], momentum, reply[:t], reply[:t], self.kappa, self.mu,
                scale, algorithms.GEM_EPS, algorithms.GEM_MAX_SCALE)
            return reply
        # The reply buffer still holds the centre this child pulled last time.
        np.subtract(center[:t], reply[:t], out=self._drift)
        self.last_mean_scale = algorithms.gem_apply_(
            center[:t], incoming[:t], momentum, self._drift, self.kappa, self.mu, scale,
            self._buffers, out=reply[:t])
        return reply

    def get_state(self):
        return {f"momentum/{child}": m for child, m in self.momenta.items()}

    def set_state(self, state):
        self.momenta = {int(k.split("/", 1)[1]): np.array(v, np.float32)
                        for k, v in state.items() if k.startswith("momentum/")}


def make(mode, trainable_size, *, master_optimizer="sgd", elastic_force=0.5, gem_kappa=1.5,
         gem_momentum=0.9, staleness_aware=False):
    """The rule for `mode` at the top master."""
    if mode == "downpour":
        return DownpourRule(trainable_size, master_optimizer, staleness_aware)
    if mode == "easgd":
        return EasgdRule(trainable_size, elastic_force)
    if mode == "gem":
        return GemRule(trainable_size, gem_kappa, gem_momentum, staleness_aware)
    raise ValueError(f"mode must be one of {MODES}; got {mode!r}.")


def make_intermediate(mode, trainable_size, elastic_force=0.5):
    """The rule a sub-master applies to its own workers: plain summation of
    their updates (the top master applies the configured rule to the sum),
    or the elastic exchange in EASGD."""
    if mode == "easgd":
        return EasgdRule(trainable_size, elastic_force)
    return DownpourRule(trainable_size, "sgd")
