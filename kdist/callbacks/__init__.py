"""Keras callbacks for distributed training with `model.fit`, named as in Horovod.

Horovod's callbacks, with Horovod's arguments:

- `BroadcastGlobalVariablesCallback`: every rank starts from one rank's weights and
  optimizer state.
- `MetricAverageCallback`: each epoch's metrics averaged over the ranks.
- `LearningRateScheduleCallback`, `LearningRateWarmupCallback`: learning-rate schedules
  in fractional epochs, for large global batches; `scale_learning_rate` gives the rate
  for several ranks from the rate for one.

And kdist's own:

- `Agreement`: keeps the ranks of a `fit` in agreement at each epoch's end (the same
  logs, one decision to stop, the same learning rates and weights) and lets each
  checkpoint file be written once.
- `Checkpoint`, `latest_checkpoint`: atomic checkpoints of the whole training state,
  and resuming from them by rerunning the same command.
- `ModelCheckpoint`, `BackupAndRestore`, `save_model`, `save_weights`, `writing_once`:
  Keras's saving, with each file written once, whole, by one rank.
- `GradientNoiseScale`, `estimate_noise_scale`: the gradient noise scale, which tells
  whether the global batch is too small or too large.
- `TensorBoard`: Keras's TensorBoard written by rank 0, with every rank's step time.

**Epoch-end join.** `BroadcastGlobalVariablesCallback`, `MetricAverageCallback`,
`Checkpoint` and `Agreement` (and `kdist.elastic.UpdateEpochStateCallback`) join the
ranks at the end of every epoch, as `kdist.join` does, before any collective of their
own; however many of them a `fit` holds, the ranks join once per epoch. A rank that ran
out of batches first waits there, feeding zeros into the other ranks' remaining gradient
reductions instead of starting a collective they are not ready for. If some rank ran out
early, the ranks then take the model's and the optimizer's variables from the rank that
joined last (the variables each rank keeps to itself excepted), since the others missed
updates. In a world of one rank, or for a model whose ranks train apart (gossip), nothing
is joined.

**Saving once.** The ranks of a data-parallel job hold the same weights, and Keras's
`model.save`, `save_weights`, `ModelCheckpoint` and `BackupAndRestore` write them
wherever they run: on every rank, to the same path, at the same moment, which can leave
a file that no longer loads. kdist's saving writes each file once, as in TensorFlow's
multi-worker convention:

- of the ranks given the same path (compared as absolute paths), the lowest writes it;
  ranks given paths of their own (`f"replica-{rank}.keras"`) each write theirs;
- the writer writes a temporary file beside the path and renames it into place, so the
  path holds the previous complete file until the new one is whole, even when the writer
  is killed mid-save (a remote path, `scheme://...`, is written directly);
- the ranks are those that train the model together (its kdist optimizer's or
  `kdist.distribute.MPIStrategy`'s communicator), else the whole job; under a
  multi-worker `tf.distribute` strategy without MPI, TensorFlow's chief writes;
- a model whose ranks hold different parts of it (`ranks_hold_different_weights`, such
  as a pipeline stage) is saved on every rank, each rank its own part.
"""

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
