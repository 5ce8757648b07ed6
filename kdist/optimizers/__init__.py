"""Optimizers for distributed training: gradient averaging across ranks, LARS."""

from kdist._exports import declare as _declare

_EXPORTS = {
    "LocalGradientAggregator": "kdist.optimizers.aggregation",
    "AllreduceOptimizer": "kdist.optimizers.distributed",
    "DistributedOptimizer": "kdist.optimizers.distributed",
    "PartialDistributedOptimizer": "kdist.optimizers.distributed",
    "LARS": "kdist.optimizers.lars",
    "load_model": "kdist.optimizers.loading",
    "DistributedGradientTape": "kdist.optimizers.tape",
    "PartialDistributedGradientTape": "kdist.optimizers.tape",
}

__all__, __getattr__, __dir__ = _declare(__name__, _EXPORTS)
