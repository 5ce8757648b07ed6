"""Mixed precision with loss scaling that all ranks agree on.

Under `mixed_float16`, gradients can overflow. Keras's `LossScaleOptimizer` then skips
the step and halves the loss scale, but it looks only at this rank's gradients: if one
rank overflows and another does not, the first skips the step while the second waits
in the gradient allreduce for ever. kdist's `LossScaleOptimizer` averages the
gradients across ranks before it looks, so every rank skips the same steps.

- `enable(policy)`: sets Keras's global dtype policy. Call it before building models
  and before creating a `kdist.DistributedOptimizer`, which then comes wrapped in
  kdist's `LossScaleOptimizer`.
- `loss_scaling_enabled()`: whether the global policy needs loss scaling.
- `LossScaleOptimizer`: Keras's dynamic loss scaling with overflow decided by all
  ranks together.

```python
import keras, kdist

kdist.precision.enable("mixed_float16")
model = build_model()  # layers compute in float16, variables stay float32
model.compile(kdist.DistributedOptimizer(keras.optimizers.Adam(1e-3)), "mse")
```

The order matters: a `DistributedOptimizer` created before the policy was set is not
wrapped in kdist's `LossScaleOptimizer` (Keras's own would check each rank alone), so
building it under `mixed_float16` on more than one rank raises `ValueError`.
`mixed_bfloat16` needs no loss scaling.
"""

from kdist._exports import declare as _declare

_EXPORTS = {
    "enable": "kdist.precision.policy",
    "loss_scaling_enabled": "kdist.precision.policy",
    "LossScaleOptimizer": "kdist.precision.policy",
}

__all__, __getattr__, __dir__ = _declare(__name__, _EXPORTS)
