"""The gradient noise scale (McCandlish et al. 2018): the largest batch worth its cost.

Data-parallel training already holds two gradient estimates each step: every
rank's own, from its batch `b`, and their average, from the global batch
`B = b * N`. Their squared norms give unbiased estimates of the true
gradient's squared norm and of the per-example gradient variance:

    |G|^2 ~ (B |G_B|^2 - b |G_b|^2) / (B - b)
    S     ~ (|G_b|^2 - |G_B|^2) / (1 / b - 1 / B)

and `B_noise = S / |G|^2` is the batch size at which one step's noise equals
its signal. Well below it a larger batch trains in proportionally fewer steps;
well above it, more data per step buys little.
"""

import logging
import math

import keras

from kdist import _args
from kdist.comm import processes

logger = logging.getLogger(__name__)


def estimate_noise_scale(local_norm_sq, global_norm_sq, batch_size, global_batch_size):
    """`(B_noise, |G|^2, S)` from mean squared gradient norms at two batch sizes.

    `local_norm_sq` is the mean over steps (and ranks) of `|G_b|^2`, the
    squared norm of a gradient computed on a batch of `batch_size` examples
    (`b`); `global_norm_sq` is that of `|G_B|^2` at `global_batch_size`
    (`B`). Their unbiased combinations estimate the true gradient's squared
    norm and the trace of the per-example gradient covariance
    (McCandlish et al. 2018):

        |G|^2   = (B |G_B|^2 - b |G_b|^2) / (B - b)
        S       = (|G_b|^2 - |G_B|^2) / (1/b - 1/B)
        B_noise = S / |G|^2

    `B_noise`, the gradient noise scale, is the batch size at which one
    step's noise equals its signal. It is NaN when the estimate of `|G|^2` is
    not positive (the noise drowns the gradient) or that of `S` is negative
    (too few steps to tell).

    Raises:
        ValueError: `global_batch_size` is not larger than `batch_size`, or
            `batch_size` is not positive.

    Example:

        >>> # per-example variance 4, true gradient norm^2 1: |G_b|^2 = 1 + 4 / b
        >>> [round(v, 6) for v in estimate_noise_scale(1 + 4 / 8, 1 + 4 / 32, 8, 32)]
        [4.0, 1.0, 4.0]
    """
    small, big = float(batch_size), float(global_batch_size)
    if not big > small > 0:
        raise ValueError(f"The global batch ({global_batch_size}) must be larger than the "
                         f"per-rank batch ({batch_size}); that needs 2 ranks or more.")
    signal = (big * global_norm_sq - small * local_norm_sq) / (big - small)
    variance = (local_norm_sq - global_norm_sq) / (1.0 / small - 1.0 / big)
    scale = variance / signal if signal > 0 and variance >= 0 else math.nan
    return scale, signal, variance


class GradientNoiseScale(keras.callbacks.Callback):
    """Logs the gradient noise scale every epoch, and what it says about the batch size.

    The gradient noise scale `B_noise = S / |G|^2` (McCandlish et al. 2018)
    is the batch size at which one step's noise equals its signal: well below
    it, a larger batch trains in proportionally fewer steps; well above it,
    more data per step buys little. Data-parallel training holds two gradient
    estimates each step, every rank's own from its batch `b` and their
    average from the global batch `B = b * size()`, and
    `estimate_noise_scale` turns their squared norms into the estimate.

    The model's optimizer must be a `kdist.DistributedOptimizer` (possibly
    inside a loss-scale optimizer) on 2 ranks or more. The optimizer then
    keeps the sums of `|G_b|^2` and `|G_B|^2` over the epoch's steps (two
    scalars per step, no extra communication); a train function traced before
    the callback started is traced again so that it records them. At each
    epoch's end the callback averages them over the steps and the ranks and
    adds to the logs `gradient_noise_scale` (in examples), `gradient_norm_sq`
    (`|G|^2`) and `gradient_variance` (`S`, the trace of the per-example
    gradient covariance); an epoch without steps adds nothing.

    The estimate describes the current weights: it grows as training
    converges (the gradient shrinks faster than its noise), so a batch that
    was too large early can suit later epochs.

    Args:
        batch_size: the batch each rank trains on per step (a whole number, at
            least 1).
        verbose: if true, rank 0 prints the estimate at each epoch's end and
            whether the global batch is well below it (under half), near it,
            or well above it (over twice).

    Attributes:
        history: each epoch's estimate of `B_noise`, in order (NaN when there
            was none).

    Raises:
        ValueError: when training begins, if the model's optimizer is not a
            `kdist.DistributedOptimizer`, if it reduces over fewer than 2
            ranks, or if it uses `backward_passes_per_step > 1`; at once, if
            `batch_size` is below 1 or a fraction.
        TypeError: `batch_size` is not a number.

    Example:

        >>> import kdist
        >>> callback = kdist.callbacks.GradientNoiseScale(batch_size=32)
    """

    def __init__(self, batch_size, verbose=1):
        super().__init__()
        self.batch_size = _args.whole_number(batch_size, "batch_size", minimum=1)
        self.verbose = verbose
        self.history = []

    def _optimizer(self):
        optimizer = self.model.optimizer
        while optimizer is not None and not hasattr(optimizer, "track_gradient_norms"):
            optimizer = getattr(optimizer, "inner_optimizer", None)
        if optimizer is None:
            raise ValueError("GradientNoiseScale reads the gradients kdist.DistributedOptimizer "
                             "averages; compile the model with kdist.DistributedOptimizer(...).")
        return optimizer

    def on_train_begin(self, logs=None):
        optimizer = self._optimizer()
        if optimizer.comm.size < 2:
            raise ValueError("The gradient noise scale compares each rank's gradient with "
                             "their average; it needs 2 ranks or more.")
        if optimizer.track_gradient_norms():
            # A train function traced earlier does not record the norms.
            self.model.make_train_function(force=True)
        optimizer.gradient_norms(reset=True)

    def on_epoch_end(self, epoch, logs=None):
        optimizer = self._optimizer()
        local, reduced, steps = optimizer.gradient_norms(reset=True)
        if steps == 0:
            return
        comm = optimizer.comm
        local = sum(comm.allgather_object(local / steps)) / comm.size
        reduced /= steps
        global_batch = self.batch_size * comm.size
        scale, signal, variance = estimate_noise_scale(local, reduced, self.batch_size,
                                                       global_batch)
        self.history.append(scale)
        if logs is not None:
            logs.update(gradient_noise_scale=scale, gradient_norm_sq=signal,
                        gradient_variance=variance)
        if self.verbose and processes.rank() == 0:
            print(f"\nEpoch {epoch + 1}: {advice(scale, global_batch)}")


def advice(scale, global_batch):
    """One line on the global batch against the noise scale."""
    if not math.isfinite(scale):
        return ("gradient noise scale: no estimate this epoch (too few steps, or the "
                "gradient is below its noise, when a larger batch would help).")
    line = f"gradient noise scale ~{scale:.0f} examples; global batch {global_batch}"
    if global_batch < scale / 2:
        return line + " is well below it: a larger batch would train in fewer steps."
    if global_batch > 2 * scale:
        return line + " is well above it: a smaller batch would use the data better."
    return line + " is near it: a good trade-off between steps and data."
