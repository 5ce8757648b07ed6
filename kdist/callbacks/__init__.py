"""Keras callbacks for distributed training, named as in Horovod."""

from kdist.callbacks.agreement import Agreement
from kdist.callbacks.broadcast import BroadcastGlobalVariablesCallback, MetricAverageCallback
from kdist.callbacks.checkpoint import Checkpoint, latest_checkpoint
from kdist.callbacks.learning_rate import (
    LearningRateScheduleCallback,
    LearningRateWarmupCallback,
    scale_learning_rate,
)
from kdist.callbacks.saving import (
    BackupAndRestore,
    ModelCheckpoint,
    save_model,
    save_weights,
    writing_once,
)
from kdist.callbacks.noise_scale import GradientNoiseScale, estimate_noise_scale
from kdist.callbacks.tensorboard import TensorBoard

__all__ = [
    "Agreement", "BackupAndRestore", "BroadcastGlobalVariablesCallback", "Checkpoint",
    "GradientNoiseScale", "ModelCheckpoint", "save_model", "save_weights", "writing_once",
    "LearningRateScheduleCallback",
    "LearningRateWarmupCallback", "MetricAverageCallback", "TensorBoard", "latest_checkpoint",
    "estimate_noise_scale", "scale_learning_rate",
]
