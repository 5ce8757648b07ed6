"""Optimizers for distributed training: gradient averaging across ranks."""

from kdist.optimizers.distributed import AllreduceOptimizer, DistributedOptimizer
