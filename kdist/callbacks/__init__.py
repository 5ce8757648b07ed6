"""Keras callbacks for distributed training, named as in Horovod."""

from kdist._exports import declare as _declare

_EXPORTS = {
    "Agreement": "kdist.callbacks.agreement",
    "BroadcastGlobalVariablesCallback": "kdist.callbacks.broadcast",
    "MetricAverageCallback": "kdist.callbacks.broadcast",
    "Checkpoint": "kdist.callbacks.checkpoint",
    "latest_checkpoint": "kdist.callbacks.checkpoint",
    "LearningRateScheduleCallback": "kdist.callbacks.learning_rate",
    "LearningRateWarmupCallback": "kdist.callbacks.learning_rate",
    "scale_learning_rate": "kdist.callbacks.learning_rate",
    "estimate_noise_scale": "kdist.callbacks.noise_scale",
    "GradientNoiseScale": "kdist.callbacks.noise_scale",
    "BackupAndRestore": "kdist.callbacks.saving",
    "ModelCheckpoint": "kdist.callbacks.saving",
    "save_model": "kdist.callbacks.saving",
    "save_weights": "kdist.callbacks.saving",
    "writing_once": "kdist.callbacks.saving",
    "TensorBoard": "kdist.callbacks.tensorboard",
}

__all__, __getattr__, __dir__ = _declare(__name__, _EXPORTS)
