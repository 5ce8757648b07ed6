"""When to prune and how much: tensorflow-model-optimization's schedules.

A schedule maps a training step (the optimizer's `iterations` before the
step runs) to `(should_prune, sparsity)`. Masks change only on steps where
`should_prune` is true: from `begin_step`, every `frequency` steps, up to
`end_step` (inclusive; -1 for no end). Between those steps the masks stay
as they are, so the target sparsity is reached at the last pruning turn at
or before `end_step`.
"""

import keras
import numpy as np


def _check_steps(begin_step, end_step, frequency, open_end):
    if int(begin_step) != begin_step or begin_step < 0:
        raise ValueError(f"begin_step must be an integer >= 0; got {begin_step}.")
    if end_step == -1 and open_end:
        pass
    elif int(end_step) != end_step or end_step < begin_step or (
            not open_end and end_step == begin_step):
        need = "-1 or an integer >= begin_step" if open_end else "an integer > begin_step"
        raise ValueError(f"end_step must be {need} (begin_step={begin_step}); "
                         f"got {end_step}: the schedule would end before it begins.")
    if int(frequency) != frequency or frequency <= 0:
        raise ValueError(f"frequency must be an integer > 0; got {frequency}.")


def _check_sparsity(value, name):
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must lie in [0, 1) (the fraction of weights set to "
                         f"zero); got {value}.")


class PruningSchedule:
    """Base class: subclasses give `sparsity(step)` and `get_config()`."""

    def __init__(self, begin_step, end_step, frequency, open_end):
        _check_steps(begin_step, end_step, frequency, open_end)
        self.begin_step = int(begin_step)
        self.end_step = int(end_step)
        self.frequency = int(frequency)

    def should_prune(self, step):
        """Whether masks are recomputed before training step `step`."""
        in_range = step >= self.begin_step and (self.end_step == -1 or step <= self.end_step)
        return in_range and (step - self.begin_step) % self.frequency == 0

    def __call__(self, step):
        return self.should_prune(step), self.sparsity(step)

    def sparsity(self, step):
        raise NotImplementedError

    def sparsity_reached(self):
        """The sparsity the masks have once the schedule has run its course."""
        last = self.end_step if self.end_step != -1 else self.begin_step
        last -= (last - self.begin_step) % self.frequency
        return self.sparsity(last)

    @classmethod
    def from_config(cls, config):
        return cls(**config)

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        return f"{type(self).__name__}({args})"


@keras.saving.register_keras_serializable(package="kdist")
class ConstantSparsity(PruningSchedule):
    """Prunes to `target_sparsity` at every pruning turn.

    Args:
        target_sparsity: fraction of each kernel set to zero, in [0, 1).
        begin_step: first step at which masks are computed.
        end_step: last step at which they may change; -1 for never stopping.
        frequency: steps between mask updates.

    Example:

    >>> schedule = ConstantSparsity(0.5, begin_step=10, frequency=5)
    >>> schedule(10), schedule(12)
    ((True, 0.5), (False, 0.5))
    """

    def __init__(self, target_sparsity, begin_step, end_step=-1, frequency=100):
        super().__init__(begin_step, end_step, frequency, open_end=True)
        _check_sparsity(target_sparsity, "target_sparsity")
        self.target_sparsity = float(target_sparsity)

    def sparsity(self, step):
        return self.target_sparsity

    def get_config(self):
        return {"target_sparsity": self.target_sparsity, "begin_step": self.begin_step,
                "end_step": self.end_step, "frequency": self.frequency}


@keras.saving.register_keras_serializable(package="kdist")
class PolynomialDecay(PruningSchedule):
    """Raises sparsity from `initial_sparsity` to `final_sparsity` on a polynomial.

    `sparsity = final + (initial - final) * (1 - p) ** power` with
    `p = clip((step - begin_step) / (end_step - begin_step), 0, 1)`: fast
    at first, while many weights are small, and slowly near the end.

    Args:
        initial_sparsity, final_sparsity: in [0, 1).
        begin_step, end_step: the ramp; `end_step` must exceed `begin_step`.
        power: exponent of the ramp (3 is the usual choice).
        frequency: steps between mask updates.

    Example:

    >>> schedule = PolynomialDecay(0.0, 0.8, begin_step=0, end_step=100, frequency=50)
    >>> [round(schedule.sparsity(s), 3) for s in (0, 50, 100, 200)]
    [0.0, 0.7, 0.8, 0.8]
    """

    def __init__(self, initial_sparsity, final_sparsity, begin_step, end_step, power=3,
                 frequency=100):
        super().__init__(begin_step, end_step, frequency, open_end=False)
        _check_sparsity(initial_sparsity, "initial_sparsity")
        _check_sparsity(final_sparsity, "final_sparsity")
        if power <= 0:
            raise ValueError(f"power must be > 0; got {power}.")
        self.initial_sparsity = float(initial_sparsity)
        self.final_sparsity = float(final_sparsity)
        self.power = float(power)

    def sparsity(self, step):
        progress = (step - self.begin_step) / (self.end_step - self.begin_step)
        progress = float(np.clip(progress, 0.0, 1.0))
        return (self.final_sparsity
                + (self.initial_sparsity - self.final_sparsity) * (1.0 - progress) ** self.power)

    def get_config(self):
        return {"initial_sparsity": self.initial_sparsity,
                "final_sparsity": self.final_sparsity, "begin_step": self.begin_step,
                "end_step": self.end_step, "power": self.power, "frequency": self.frequency}
