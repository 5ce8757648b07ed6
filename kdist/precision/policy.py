"""Dtype policies and loss scaling agreed across ranks.

Under `mixed_float16`, gradients can overflow. Keras's `LossScaleOptimizer`
skips such a step and halves the loss scale, but it looks only at this rank's
gradients: if one rank overflows and another does not, the first skips the
step while the second waits in the gradient allreduce for ever. kdist's
`LossScaleOptimizer` averages the gradients across ranks *before* looking: an
infinity or NaN on any rank makes the average non-finite on every rank, so all
ranks skip the same steps and halve their scale together, at no extra
collective.
"""

import logging
import warnings

import keras

from kdist import _keras_private
from kdist.comm import processes


logger = logging.getLogger(__name__)

POLICIES = ("mixed_float16", "mixed_bfloat16", "float32")

_DESCRIPTIONS = {
    "mixed_float16": "layers compute in float16 and keep float32 variables; the loss is "
                     "scaled dynamically and overflow is decided by all ranks together",
    "mixed_bfloat16": "layers compute in bfloat16 and keep float32 variables; no loss "
                      "scaling is needed",
    "float32": "layers compute and keep variables in float32",
}


def enable(policy="mixed_float16"):
    """Sets Keras's global dtype policy and says what it did.

    Call it before building models and before creating a
    `kdist.DistributedOptimizer`, which then also scales the loss. The order
    matters: an optimizer created before the policy was set would check for
    overflow on each rank alone, and on more than one rank it raises
    `ValueError` when it is built under `mixed_float16`. It starts kdist
    (`kdist.init`) if that has not happened, and logs what the policy does
    (on a machine without a GPU, also that `mixed_float16` is slower there
    than `float32`).

    Args:
        policy: "mixed_float16" (the default), "mixed_bfloat16" or "float32".

    Returns:
        the `keras.DTypePolicy` now in force.

    Raises:
        ValueError: any other `policy`.

    Example:

        >>> import kdist
        >>> kdist.precision.enable("mixed_bfloat16").name
        'mixed_bfloat16'
        >>> kdist.precision.enable("float32").name
        'float32'
    """
    if policy not in POLICIES:
        raise ValueError(f"Unknown precision policy {policy!r}; use one of {POLICIES}.")
    processes.init()
    keras.mixed_precision.set_global_policy(policy)
    logger.info("dtype policy %s: %s", policy, _DESCRIPTIONS[policy])
    if policy == "mixed_float16":
        import tensorflow as tf

        try:
            has_gpu = bool(tf.config.list_physical_devices("GPU"))
        except RuntimeError:
            has_gpu = True
        if not has_gpu:
            logger.info("mixed_float16 runs on this CPU but is slower than float32 here; "
                           "it pays off on GPUs with float16 units.")
    return keras.mixed_precision.global_policy()


def loss_scaling_enabled():
    """True when Keras's global dtype policy needs loss scaling (`mixed_float16`).

    `kdist.DistributedOptimizer` asks it when it is created, to decide whether to wrap
    the optimizer in `kdist.precision.LossScaleOptimizer`.

    Example:

        >>> import kdist
        >>> _ = kdist.precision.enable("float32")
        >>> kdist.precision.loss_scaling_enabled()
        False
    """
    return keras.config.dtype_policy().name == "mixed_float16"


@keras.saving.register_keras_serializable(package="kdist")
class LossScaleOptimizer(keras.optimizers.LossScaleOptimizer):
    """Keras's dynamic loss scaling, with overflow decided by all ranks together.

    A `keras.optimizers.LossScaleOptimizer`. Around a `kdist.optimizers.AllreduceOptimizer`
    it averages the gradients across ranks *before* checking them: an infinity or NaN on
    any rank makes the average non-finite on every rank, so every rank skips the same
    steps and halves its scale together, with no extra collective; after
    `dynamic_growth_steps` finite steps in a row the scale doubles. This works with
    `kdist.join` (ranks with uneven data). With `backward_passes_per_step > 1` the
    gradients are averaged at every backward pass, not once per update. Around any other
    optimizer it behaves exactly as Keras's.

    `kdist.DistributedOptimizer` creates one under the `mixed_float16` policy, or from a
    Keras `LossScaleOptimizer` it is given, keeping that one's settings. To build one
    yourself:

    ```python
    opt = kdist.precision.LossScaleOptimizer(
        kdist.optimizers.AllreduceOptimizer(keras.optimizers.Adam(1e-3)),
        initial_scale=2.0**10)
    ```

    It is registered with Keras serialization (once kdist is imported) and saves to
    `.keras` and `.h5` with its loss scale and its inner optimizer's state;
    `set_weights(values)` sets both, in the order of `variables`. From `.h5`, a plain
    Keras optimizer
    inside it keeps its step count but loses its slots (Keras's `.h5` loader builds it
    for no variables, and the model cannot train until it is compiled again): loading
    warns and says to save to `.keras` or to load with `kdist.load_model`, which
    restores everything.

    Args:
        inner_optimizer: the optimizer whose loss it scales, usually an
            `AllreduceOptimizer`.
        initial_scale: the loss scale to start from.
        dynamic_growth_steps: how many finite steps in a row double the scale.
        name: the optimizer's name.
        **kwargs: passed on to `keras.optimizers.LossScaleOptimizer`.

    Example:

        >>> import keras, kdist
        >>> opt = kdist.precision.LossScaleOptimizer(keras.optimizers.SGD(0.1))
        >>> opt.initial_scale
        32768.0
    """

    def __init__(self, inner_optimizer, initial_scale=2.0**15, dynamic_growth_steps=2000,
                 name=None, **kwargs):
        super().__init__(inner_optimizer, initial_scale=initial_scale,
                         dynamic_growth_steps=dynamic_growth_steps, name=name, **kwargs)
        inner_optimizer.loss_scale_agreed = True

    def build(self, var_list):
        if getattr(self, "dynamic_scale", None) is None:
            super().build(var_list)  # the loss scale's variables, then the inner optimizer's
        else:
            self.inner_optimizer.build(var_list)
            super(keras.optimizers.LossScaleOptimizer, self).build(var_list)
        if not var_list:
            # Keras's .h5 loader builds with no variables (see AllreduceOptimizer.build):
            # stay unbuilt so that `fit` builds the inner optimizer for the model's.
            self.built = False

    def set_weights(self, weights):
        """Sets the loss scale's state and the inner optimizer's, in the order of `variables`.

        Raises:
            ValueError: `build` has not made the loss scale's variables yet, or
                `weights` holds fewer values than the loss scale has variables.
        """
        weights = list(weights)
        own = _keras_private.optimizer_own_variables(self)
        if getattr(self, "dynamic_scale", None) is None:
            raise ValueError(f"Build optimizer {self.name!r} before setting its weights: "
                             "call optimizer.build(model.trainable_variables).")
        if len(weights) < len(own):
            raise ValueError(f"Optimizer {self.name!r} has {len(own)} variables of its own "
                             f"but got {len(weights)} values.")
        for variable, value in zip(own, weights):
            variable.assign(value)
        inner = self.inner_optimizer
        if not self.built and not getattr(inner, "reduces_gradients", False):
            warnings.warn(
                f"Keras's .h5 loader built the plain optimizer {inner.name!r} inside "
                f"{self.name!r} for no variables: it keeps its step count but loses its slots, "
                "and the model cannot train until it is compiled again. Save to a .keras "
                "file, or load with kdist.load_model(path), which restores the whole state.",
                stacklevel=2)
        inner.set_weights(weights[len(own):])

    def apply(self, grads, trainable_variables=None):
        inner = self.inner_optimizer
        if not getattr(inner, "reduces_gradients", False):
            return super().apply(grads, trainable_variables)
        grads = inner.allreduce_gradients(list(grads), trainable_variables)
        with inner.reduced_upstream():
            return super().apply(grads, trainable_variables)
