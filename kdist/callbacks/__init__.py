"""Keras callbacks for distributed training, named as in Horovod."""

from kdist.callbacks.broadcast import BroadcastGlobalVariablesCallback, MetricAverageCallback
from kdist.callbacks.checkpoint import Checkpoint, latest_checkpoint
from kdist.callbacks.learning_rate import (
    LearningRateScheduleCallback,
    LearningRateWarmupCallback,
)
from kdist.callbacks.tensorboard import TensorBoard

__all__ = [
    "BroadcastGlobalVariablesCallback", "Checkpoint", "LearningRateScheduleCallback",
    "LearningRateWarmupCallback", "MetricAverageCallback", "TensorBoard", "latest_checkpoint",
]
