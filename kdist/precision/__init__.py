"""Mixed precision with loss scaling that all ranks agree on."""

from kdist._exports import declare as _declare

_EXPORTS = {
    "enable": "kdist.precision.policy",
    "loss_scaling_enabled": "kdist.precision.policy",
    "LossScaleOptimizer": "kdist.precision.policy",
}

__all__, __getattr__, __dir__ = _declare(__name__, _EXPORTS)
