"""Learning-rate schedules for large global batches (Goyal et al. 2017)."""

import logging

import keras

from kdist.comm import processes

logger = logging.getLogger(__name__)


def _set_learning_rate(model, value):
    # Keras itself refuses (TypeError) when the optimizer was given a schedule.
    model.optimizer.learning_rate = value


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Sets `lr = initial_lr * multiplier(epoch)` between `start_epoch` and `end_epoch`.

    Args:
        initial_lr: the learning rate the multiplier scales (usually already
            scaled by `kdist.size()`).
        multiplier: a number, or a function of the (fractional) epoch.
        start_epoch, end_epoch: the epochs this schedule governs (end excluded;
            None means until training ends).
        staircase: change once per epoch (True) or after every batch (False).
        steps_per_epoch: batches per epoch, when Keras cannot tell.

    Example:

    >>> import kdist
    >>> decay = kdist.callbacks.LearningRateScheduleCallback(
    ...     initial_lr=0.1, multiplier=lambda epoch: 0.1 ** (epoch // 30), start_epoch=5)
    """

    def __init__(self, initial_lr, multiplier, start_epoch=0, end_epoch=None, staircase=True,
                 momentum_correction=None, steps_per_epoch=None, verbose=0):
        super().__init__()
        if float(initial_lr) <= 0:
            raise ValueError(f"initial_lr must be positive; got {initial_lr}.")
        if end_epoch is not None and end_epoch <= start_epoch:
            raise ValueError(f"end_epoch ({end_epoch}) must come after start_epoch "
                             f"({start_epoch}).")
        self.initial_lr = float(initial_lr)
        self.multiplier = multiplier if callable(multiplier) else (lambda epoch: multiplier)
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.steps_per_epoch = steps_per_epoch
        self.verbose = verbose
        self._epoch = 0
        if momentum_correction:
            logger.warning("momentum_correction is not applied: Keras 3 optimizers compile "
                           "their momentum into the train step.")

    def _in_range(self, epoch):
        return epoch >= self.start_epoch and (self.end_epoch is None or epoch < self.end_epoch)

    def _steps(self):
        steps = self.steps_per_epoch or (self.params or {}).get("steps")
        if not steps:
            raise ValueError("Could not tell the number of batches per epoch; pass "
                             "steps_per_epoch= to the learning-rate callback.")
        return steps

    def learning_rate_at(self, epoch):
        """The learning rate this schedule gives at a (fractional) epoch."""
        return self.initial_lr * float(self.multiplier(epoch))

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        if self._in_range(epoch) and self.staircase:
            _set_learning_rate(self.model, self.learning_rate_at(epoch))

    def on_train_batch_begin(self, batch, logs=None):
        if self.staircase or not self._in_range(self._epoch):
            return
        _set_learning_rate(self.model, self.learning_rate_at(self._epoch + batch / self._steps()))

    def on_epoch_end(self, epoch, logs=None):
        value = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))
        if logs is not None:
            logs["learning_rate"] = value
        if self.verbose and self._in_range(epoch) and processes.rank() == 0:
            print(f"\nEpoch {epoch + 1}: learning rate is {value:.6g}.")


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Ramps the learning rate from `initial_lr / size` to `initial_lr` over the first epochs.

    A large global batch wants a large learning rate, but not from the first
    step; the ramp is linear in the (fractional) epoch and updated every batch.

    Example:

    >>> import kdist
    >>> warmup = kdist.callbacks.LearningRateWarmupCallback(initial_lr=0.4, warmup_epochs=5)
    >>> round(warmup.learning_rate_at(0.0), 4) == round(0.4 / kdist.size(), 4)
    True
    """

    def __init__(self, initial_lr, warmup_epochs=5, momentum_correction=None,
                 steps_per_epoch=None, verbose=0):
        if warmup_epochs <= 0:
            raise ValueError(f"warmup_epochs must be positive; got {warmup_epochs}.")
        self.warmup_epochs = warmup_epochs

        def ramp(epoch):
            size = processes.size()
            return (1.0 + epoch * (size - 1) / warmup_epochs) / size

        super().__init__(initial_lr, ramp, start_epoch=0, end_epoch=warmup_epochs,
                         staircase=False, momentum_correction=momentum_correction,
                         steps_per_epoch=steps_per_epoch, verbose=verbose)

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.warmup_epochs - 1:
            _set_learning_rate(self.model, self.initial_lr)
        super().on_epoch_end(epoch, logs)
        if epoch == self.warmup_epochs - 1 and self.verbose and processes.rank() == 0:
            print(f"\nEpoch {epoch + 1}: finished warming up to learning rate "
                  f"{self.initial_lr:.6g}.")
