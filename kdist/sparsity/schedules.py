"""When to prune and how much: tensorflow-model-optimization's schedules.

A schedule maps a training step to `(should_prune, sparsity)`. Masks change
only on steps where `should_prune` is true: from `begin_step`, every
`frequency` steps, up to `end_step` (inclusive; -1 for no end). Between
those steps the masks stay as they are, so the target sparsity is reached at
the last pruning turn at or before `end_step`.

Called with a step, a schedule answers as tfmot's do, with a boolean and a
float32 tensor, so it works inside a `tf.function`; `should_prune(step)` and
`sparsity(step)` give the same answers as Python values. Each rule is
written once over an array namespace (NumPy or `keras.ops`) for both.
"""

import numbers

import keras
import numpy as np


def _is_step(value):
    return (isinstance(value, numbers.Real) and not isinstance(value, bool)
            and float(value).is_integer())


def _check_steps(begin_step, end_step, frequency, open_end):
    if not _is_step(begin_step) or begin_step < 0:
        raise ValueError(f"begin_step must be an integer >= 0; got {begin_step}.")
    if end_step == -1 and open_end:
        pass
    elif not _is_step(end_step) or end_step < begin_step:
        need = "-1 or an integer >= begin_step" if open_end else "an integer >= begin_step"
        raise ValueError(f"end_step must be {need} (begin_step={begin_step}); "
                         f"got {end_step}: the schedule would end before it begins.")
    if not _is_step(frequency) or frequency <= 0:
        raise ValueError(f"frequency must be an integer > 0; got {frequency}.")


def _check_sparsity(value, name):
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must lie in [0, 1) (the fraction of weights set to "
                         f"zero); got {value}.")


class PruningSchedule:
    """Base class of pruning schedules, with tensorflow-model-optimization's semantics.

    A schedule maps a training step to `(should_prune, sparsity)`. Masks
    change only on steps where `should_prune` is true (pruning turns): from
    `begin_step`, every `frequency` steps, up to `end_step` inclusive (-1: no
    end). Between turns the masks stay as they are, so the target sparsity is
    reached at the last turn at or before `end_step`.

    Every schedule answers in two ways:

    - `schedule(step)` returns a boolean and a float32 tensor, as tfmot's
      schedules do; `step` may be a tensor, inside a `tf.function`.
    - `should_prune(step)` and `sparsity(step)` give the same answers as
      Python values.

    `get_config()` is in tfmot's format, `{"class_name": ..., "config":
    {...}}`; `from_config` reads it, and the older flat dict of arguments.
    Schedules compare equal by type and config.

    A subclass gives `get_config()` and either `rule(ops, step)`, written
    with the functions NumPy and `keras.ops` share, or, as for
    tensorflow-model-optimization, `__call__(step)` returning a boolean and a
    float tensor. `in_pruning_turn` is the usual `should_prune` part.

    Example, a schedule that prunes to 30 % at step 0 and 60 % from step 100:

    >>> class TwoSteps(PruningSchedule):
    ...     def rule(self, ops, step):
    ...         return (self.in_pruning_turn(ops, step, 0, -1, 100),
    ...                 ops.where(step >= 100, 0.6, 0.3))
    ...     def get_config(self):
    ...         return {"class_name": "TwoSteps", "config": {}}
    >>> schedule = TwoSteps()
    >>> schedule.should_prune(100), schedule.sparsity(100), schedule.should_prune(150)
    (True, 0.6, False)
    """

    def rule(self, ops, step):
        """`(should_prune, sparsity)` at `step`, computed with `ops` (NumPy or keras.ops)."""
        raise NotImplementedError(f"{type(self).__name__} must define rule(ops, step) or "
                                  "__call__(step).")

    @staticmethod
    def in_pruning_turn(ops, step, begin_step, end_step, frequency):
        """True from `begin_step` to `end_step` (-1: no end), every `frequency` steps."""
        started = ops.greater_equal(step, begin_step)
        not_ended = ops.logical_or(ops.less_equal(step, end_step), end_step < 0)
        turn = ops.equal(ops.mod(step - begin_step, frequency), 0)
        return ops.logical_and(ops.logical_and(started, not_ended), turn)

    def __call__(self, step):
        ops = keras.ops
        should, sparsity = self.rule(ops, ops.cast(ops.convert_to_tensor(step), "int64"))
        return ops.cast(should, "bool"), ops.cast(sparsity, "float32")

    def _answer(self, step):
        if type(self).rule is PruningSchedule.rule:  # a tfmot-style subclass
            should, sparsity = self(step)
            return (bool(keras.ops.convert_to_numpy(should)),
                    float(keras.ops.convert_to_numpy(sparsity)))
        should, sparsity = self.rule(np, np.int64(step))
        return bool(should), float(sparsity)

    def should_prune(self, step):
        """Whether masks are recomputed before training step `step`."""
        return self._answer(step)[0]

    def sparsity(self, step):
        """The fraction of each kernel pruned at a turn at `step`."""
        return self._answer(step)[1]

    def get_config(self):
        raise NotImplementedError(f"{type(self).__name__} must define get_config().")

    @classmethod
    def from_config(cls, config):
        # tfmot's format nests the arguments under "config"; an older flat one is read too.
        if "config" in config and "class_name" in config:
            config = config["config"]
        return cls(**config)

    def _config(self, **arguments):
        return {"class_name": type(self).__name__, "config": arguments}

    def __eq__(self, other):
        return type(self) is type(other) and self.get_config() == other.get_config()

    __hash__ = object.__hash__

    def __repr__(self):
        config = self.get_config().get("config", {})
        args = ", ".join(f"{k}={v!r}" for k, v in config.items())
        return f"{type(self).__name__}({args})"


class _StepRange(PruningSchedule):
    def __init__(self, begin_step, end_step, frequency, open_end):
        _check_steps(begin_step, end_step, frequency, open_end)
        self.begin_step = int(begin_step)
        self.end_step = int(end_step)
        self.frequency = int(frequency)

    def turn(self, ops, step):
        return self.in_pruning_turn(ops, step, self.begin_step, self.end_step, self.frequency)

    def sparsity_reached(self):
        """The sparsity the masks have once the schedule has run its course."""
        last = self.end_step if self.end_step != -1 else self.begin_step
        last -= (last - self.begin_step) % self.frequency
        return self.sparsity(last)


@keras.saving.register_keras_serializable(package="kdist")
class ConstantSparsity(_StepRange):
    """Prunes to `target_sparsity` at every pruning turn.

    Answers as every `PruningSchedule` does (`schedule(step)`,
    `should_prune(step)`, `sparsity(step)`, tfmot's `get_config()` format);
    `sparsity_reached()` is the sparsity the masks end at.

    Args:
        target_sparsity: fraction of each kernel set to zero, in [0, 1).
        begin_step: first step at which masks are computed, an integer >= 0.
        end_step: last step at which they may change; -1 for never stopping.
        frequency: steps between mask updates, an integer > 0.

    Raises:
        ValueError: `target_sparsity` outside [0, 1), a negative or fractional
            `begin_step`, an `end_step` that is neither -1 nor >= `begin_step`,
            or a `frequency` below 1.

    Example:

        >>> schedule = ConstantSparsity(0.5, begin_step=10, frequency=5)
        >>> should, sparsity = schedule(10)
        >>> bool(should), float(sparsity)
        (True, 0.5)
        >>> schedule.should_prune(12), schedule.sparsity(12)
        (False, 0.5)
    """

    def __init__(self, target_sparsity, begin_step, end_step=-1, frequency=100):
        super().__init__(begin_step, end_step, frequency, open_end=True)
        _check_sparsity(target_sparsity, "target_sparsity")
        self.target_sparsity = float(target_sparsity)

    def rule(self, ops, step):
        return self.turn(ops, step), self.target_sparsity

    def get_config(self):
        return self._config(target_sparsity=self.target_sparsity, begin_step=self.begin_step,
                            end_step=self.end_step, frequency=self.frequency)


@keras.saving.register_keras_serializable(package="kdist")
class PolynomialDecay(_StepRange):
    """Raises sparsity from `initial_sparsity` to `final_sparsity` on a polynomial.

    `sparsity = final + (initial - final) * (1 - p) ** power` with
    `p = clip((step - begin_step) / (end_step - begin_step), 0, 1)`: fast
    at first, while many weights are small, and slowly near the end. With
    `end_step == begin_step` the final sparsity applies at once.

    Answers as every `PruningSchedule` does (`schedule(step)`,
    `should_prune(step)`, `sparsity(step)`, tfmot's `get_config()` format);
    `sparsity_reached()` is the sparsity the masks end at, which is
    `final_sparsity` only if `end_step` falls on a pruning turn.

    Args:
        initial_sparsity: the sparsity at `begin_step`, in [0, 1).
        final_sparsity: the sparsity from `end_step` on, in [0, 1).
        begin_step: where the ramp starts, an integer >= 0.
        end_step: where the ramp ends; it may not precede `begin_step` (and
            cannot be -1).
        power: exponent of the ramp, > 0 (3 is the usual choice).
        frequency: steps between mask updates, an integer > 0.

    Raises:
        ValueError: a sparsity outside [0, 1), a negative or fractional
            `begin_step`, an `end_step` before `begin_step`, `power <= 0`, or
            a `frequency` below 1.

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
        self.power = power

    def rule(self, ops, step):
        length = max(self.end_step - self.begin_step, 1)
        progress = ops.clip((step - self.begin_step) / length, 0.0, 1.0)
        if self.end_step == self.begin_step:
            progress = ops.where(step >= self.end_step, 1.0, 0.0)
        change = self.initial_sparsity - self.final_sparsity
        return self.turn(ops, step), self.final_sparsity + change * (1.0 - progress) ** self.power

    def get_config(self):
        return self._config(initial_sparsity=self.initial_sparsity,
                            final_sparsity=self.final_sparsity, begin_step=self.begin_step,
                            end_step=self.end_step, power=self.power, frequency=self.frequency)
