"""Optimizers for distributed training: gradient averaging across ranks, LARS."""

from kdist.optimizers.aggregation import LocalGradientAggregator
from kdist.optimizers.distributed import (
    AllreduceOptimizer,
    DistributedOptimizer,
    PartialDistributedOptimizer,
)
from kdist.optimizers.lars import LARS
from kdist.optimizers.tape import DistributedGradientTape, PartialDistributedGradientTape
from kdist.optimizers.loading import load_model

__all__ = [
    "AllreduceOptimizer", "DistributedGradientTape", "DistributedOptimizer", "LARS",
    "LocalGradientAggregator", "PartialDistributedGradientTape", "PartialDistributedOptimizer",
    "load_model",
]
