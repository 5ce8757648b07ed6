"""Learning-rate schedules for large global batches (Goyal et al. 2017).

Epochs here are fractional: batch `b` of epoch `e` starts at position
`e + b / steps_per_epoch`. A schedule governs the positions from
`start_epoch` (included) to `end_epoch` (excluded), so schedules with
fractional bounds hand over to one another in the middle of an epoch.
"""

import logging
import math
import numbers

import keras

from kdist import _args
from kdist.comm import processes

logger = logging.getLogger(__name__)


def _set_learning_rate(model, value):
    # Keras itself refuses (TypeError) when the optimizer was given a schedule.
    model.optimizer.learning_rate = value


def _epoch_bound(value, name):
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or value != value:
        raise TypeError(f"{name} must be a number of epochs; got {value!r}.")
    if value < 0:
        raise ValueError(f"{name} must be 0 or more; got {value!r}.")
    return int(value) if float(value).is_integer() else float(value)


SCALING_RULES = ("linear", "sqrt")


def scale_learning_rate(learning_rate, rule="linear", size=None):
    """The learning rate for `size` ranks, from the one that suits one rank.

    With `size` times the global batch, `"linear"` multiplies the rate by
    `size` (Goyal et al. 2017; SGD with momentum), `"sqrt"` by `sqrt(size)`
    (Adam-like optimizers, or when linear scaling diverges). `size` defaults to
    the number of ranks (`kdist.size()`).

    Raises:
        ValueError: `learning_rate` is not positive, `rule` is neither
            `"linear"` nor `"sqrt"`, or `size` is below 1 or a fraction.
        TypeError: `learning_rate` or `size` is not a number.

    Example:

        >>> from kdist.callbacks import scale_learning_rate
        >>> scale_learning_rate(0.1, "linear", size=8), scale_learning_rate(0.1, "sqrt", size=4)
        (0.8, 0.2)
    """
    learning_rate = _args.positive_number(learning_rate, "learning_rate")
    if rule not in SCALING_RULES:
        raise ValueError(f"rule must be one of {SCALING_RULES}; got {rule!r}.")
    size = processes.size() if size is None else _args.whole_number(size, "size", minimum=1)
    return learning_rate * (size if rule == "linear" else math.sqrt(size))


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Sets `lr = initial_lr * multiplier(epoch)` between `start_epoch` and `end_epoch`.

    Epochs are fractional: batch `b` of epoch `e` starts at
    `e + b / steps_per_epoch`. The schedule governs the batches that start from
    `start_epoch` (included) up to `end_epoch` (excluded); with fractional
    bounds it starts and stops at the batch that reaches them, so consecutive
    schedules hand over to one another in the middle of an epoch. Outside
    its range it leaves the learning rate alone.

    At each epoch's end the optimizer's current learning rate is added to the
    logs as `"learning_rate"`. The optimizer's learning rate must be a number,
    not a `keras.optimizers.schedules.LearningRateSchedule` (Keras refuses to
    set it then, with `TypeError`).

    Args:
        initial_lr: the learning rate the multiplier scales (usually already
            scaled by `kdist.size()`); a positive number.
        multiplier: a number, or a function of the epoch.
        start_epoch: the (possibly fractional) epoch this schedule starts at;
            0 or more.
        end_epoch: the (possibly fractional) epoch it stops at, excluded, after
            `start_epoch`; None means until training ends.
        staircase: change once per epoch, passing the multiplier the whole
            epoch number (True), or before every batch, passing the
            fractional epoch (False).
        momentum_correction: accepted for compatibility with Horovod; a true
            value logs a warning and is not applied (Keras 3 optimizers compile
            their momentum into the train step).
        steps_per_epoch: batches per epoch (a whole number, at least 1), when
            Keras cannot tell (a dataset of unknown length). A per-batch
            schedule or fractional bounds need it then.
        verbose: if true, rank 0 prints the learning rate at the end of each
            epoch in the schedule's range.

    Raises:
        ValueError: `initial_lr` is not positive; a bound is negative;
            `end_epoch <= start_epoch`; `steps_per_epoch` is below 1 or a
            fraction; at the first batch that needs the number of batches per
            epoch, when neither Keras nor `steps_per_epoch` gives it.
        TypeError: `initial_lr`, a bound or `steps_per_epoch` is not a number
            (a NaN bound included); `multiplier` is neither a number nor
            callable.

    Example:

        >>> import kdist
        >>> decay = kdist.callbacks.LearningRateScheduleCallback(
        ...     initial_lr=0.1, multiplier=lambda epoch: 0.1 ** (epoch // 30), start_epoch=5)
        >>> round(decay.learning_rate_at(30), 6)
        0.01
    """

    def __init__(self, initial_lr, multiplier, start_epoch=0, end_epoch=None, staircase=True,
                 momentum_correction=None, steps_per_epoch=None, verbose=0):
        super().__init__()
        self.initial_lr = _args.positive_number(initial_lr, "initial_lr")
        if callable(multiplier):
            self.multiplier = multiplier
        elif isinstance(multiplier, numbers.Real) and not isinstance(multiplier, bool):
            self.multiplier = lambda epoch: multiplier
        else:
            raise TypeError("multiplier must be a number or a function of the epoch; got "
                            f"{type(multiplier).__name__}.")
        self.start_epoch = _epoch_bound(start_epoch, "start_epoch")
        self.end_epoch = None if end_epoch is None else _epoch_bound(end_epoch, "end_epoch")
        if self.end_epoch is not None and self.end_epoch <= self.start_epoch:
            raise ValueError(f"end_epoch ({end_epoch}) must come after start_epoch "
                             f"({start_epoch}).")
        self.staircase = bool(staircase)
        self.steps_per_epoch = (None if steps_per_epoch is None else _args.whole_number(
            steps_per_epoch, "steps_per_epoch", minimum=1))
        self.verbose = verbose
        self._epoch = 0
        if momentum_correction:
            logger.warning("momentum_correction is not applied: Keras 3 optimizers compile "
                           "their momentum into the train step.")

    def _governs(self, position):
        return position >= self.start_epoch and (self.end_epoch is None
                                                 or position < self.end_epoch)

    def _fractional_bounds(self):
        return any(isinstance(bound, float) for bound in (self.start_epoch, self.end_epoch))

    def _steps(self):
        steps = self.steps_per_epoch or (self.params or {}).get("steps")
        if not steps:
            raise ValueError("Could not tell the number of batches per epoch; pass "
                             "steps_per_epoch= to the learning-rate callback.")
        return steps

    def _multiplier_epoch(self, epoch, batch):
        """The epoch the multiplier is evaluated at for this batch."""
        if self.staircase:
            return epoch
        return epoch + batch / self._steps()

    def learning_rate_at(self, epoch):
        """The learning rate this schedule gives at a (fractional) epoch:
        `initial_lr * multiplier(epoch)`, whether or not `epoch` is in range."""
        return self.initial_lr * float(self.multiplier(epoch))

    def _adjust(self, epoch, batch):
        position = epoch if batch == 0 else epoch + batch / self._steps()
        if self._governs(position):
            _set_learning_rate(self.model,
                               self.learning_rate_at(self._multiplier_epoch(epoch, batch)))

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        self._adjust(epoch, 0)

    def on_train_batch_begin(self, batch, logs=None):
        if batch == 0 or (self.staircase and not self._fractional_bounds()):
            return  # the epoch's first batch was handled when the epoch began
        self._adjust(self._epoch, batch)

    def on_epoch_end(self, epoch, logs=None):
        value = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))
        if logs is not None:
            logs["learning_rate"] = value
        if self.verbose and self._governs(epoch) and processes.rank() == 0:
            print(f"\nEpoch {epoch + 1}: learning rate is {value:.6g}.")


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Ramps the learning rate from `initial_lr / size` to `initial_lr` over the first epochs.

    A large global batch wants a large learning rate, but not from the first
    step (Goyal et al., 2017). Over the first `warmup_epochs` epochs the rate
    climbs linearly in the fractional epoch, updated before every batch:

        lr(epoch) = initial_lr * (1 + epoch * (size - 1) / warmup_epochs) / size

    where `size` is `kdist.size()`. Each batch trains with the rate reached
    at its end (`epoch = e + (b + 1) / steps_per_epoch` for batch `b` of
    epoch `e`), so the last batch of the warm-up trains with exactly
    `initial_lr`, also when `warmup_epochs` is fractional (2.5, say). The
    rate never exceeds `initial_lr`; with a whole `warmup_epochs`, the last
    warm-up epoch leaves it at `initial_lr` even when that epoch had fewer
    batches than announced. After the warm-up the callback leaves the rate alone, so that a
    `LearningRateScheduleCallback` starting at `warmup_epochs` can take over.

    With a `scaling` rule (`"linear"` or `"sqrt"`, see
    `scale_learning_rate`), `initial_lr` is instead the rate that suits one
    rank, and the ramp climbs from it to
    `scale_learning_rate(initial_lr, scaling)`.

    Args:
        initial_lr: the rate reached at the end of the warm-up (with
            `scaling`: the rate for one rank); a positive number.
        warmup_epochs: the length of the warm-up in (possibly fractional)
            epochs; a positive number.
        momentum_correction: as for `LearningRateScheduleCallback`: not
            applied, with a warning.
        steps_per_epoch: as for `LearningRateScheduleCallback`; the warm-up is
            per batch, so it is needed when Keras cannot tell the number of
            batches per epoch.
        verbose: if true, rank 0 prints the rate at the end of each warm-up
            epoch, and `Epoch N: finished warming up to learning rate ...` at
            the end of the epoch in which the warm-up ends.
        scaling: None, `"linear"` or `"sqrt"`.

    Raises:
        ValueError: `warmup_epochs` or `initial_lr` is not positive, or
            `scaling` is another rule.
        TypeError: `warmup_epochs` or `initial_lr` is not a number.

    Example:

        On 2 ranks, the rate climbs from `0.4 / 2` to `0.4` over 5 epochs:

        >>> import kdist
        >>> kdist.init()
        >>> warmup = kdist.callbacks.LearningRateWarmupCallback(initial_lr=0.4, warmup_epochs=5)
        >>> [round(warmup.learning_rate_at(epoch), 4) for epoch in (0.0, 2.5, 5.0)]
        [0.2, 0.3, 0.4]

        From one rank's rate `0.1` to `0.1 * sqrt(2)`:

        >>> warmup = kdist.callbacks.LearningRateWarmupCallback(
        ...     initial_lr=0.1, warmup_epochs=5, scaling="sqrt")
        >>> [round(warmup.learning_rate_at(epoch), 4) for epoch in (0.0, 5.0)]
        [0.1, 0.1414]
    """

    def __init__(self, initial_lr, warmup_epochs=5, momentum_correction=None,
                 steps_per_epoch=None, verbose=0, scaling=None):
        warmup_epochs = _args.positive_number(warmup_epochs, "warmup_epochs")
        if warmup_epochs.is_integer():
            warmup_epochs = int(warmup_epochs)
        self.warmup_epochs = warmup_epochs
        self.scaling = scaling
        target = (initial_lr if scaling is None
                  else scale_learning_rate(initial_lr, scaling))

        def ramp(epoch):
            if epoch >= warmup_epochs:
                return 1.0
            # Horovod's ramp starts at a size-th of the target; a rule starts at one rank's.
            factor = processes.size() if scaling is None else target / initial_lr
            return (1.0 + epoch * (factor - 1) / warmup_epochs) / factor

        super().__init__(target, ramp, start_epoch=0, end_epoch=warmup_epochs,
                         staircase=False, momentum_correction=momentum_correction,
                         steps_per_epoch=steps_per_epoch, verbose=verbose)

    def _multiplier_epoch(self, epoch, batch):
        return epoch + (batch + 1) / self._steps()

    def on_epoch_end(self, epoch, logs=None):
        if epoch + 1 == self.warmup_epochs:
            # Also when the epoch had fewer batches than announced.
            _set_learning_rate(self.model, self.initial_lr)
        super().on_epoch_end(epoch, logs)
        finished = epoch < self.warmup_epochs <= epoch + 1
        if finished and self.verbose and processes.rank() == 0:
            print(f"\nEpoch {epoch + 1}: finished warming up to learning rate "
                  f"{self.initial_lr:.6g}.")
