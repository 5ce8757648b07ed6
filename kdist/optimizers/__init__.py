"""Optimizers for distributed training: gradient averaging across ranks."""

from kdist.optimizers.distributed import AllreduceOptimizer, DistributedOptimizer
from kdist.optimizers.loading import load_model
