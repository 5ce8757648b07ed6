"""Mixed precision with loss scaling that all ranks agree on."""

from kdist.precision.policy import LossScaleOptimizer, enable, loss_scaling_enabled

__all__ = [
    "LossScaleOptimizer", "enable", "loss_scaling_enabled",
]
