"""The callback that moves pruning masks along their schedules, and sparsity reports."""

import logging

import keras
import numpy as np

from kdist.sparsity import bridge
from kdist.sparsity.pruning import pruned_layers

logger = logging.getLogger(__name__)


def sparsity_of(model):
    """Fraction of zeros in the kernel each pruned layer computes with, by layer name."""
    return {wrapper.base_layer.name: float(np.mean(
        keras.ops.convert_to_numpy(wrapper.effective_kernel()) == 0))
        for wrapper in pruned_layers(model)}


class UpdatePruning(keras.callbacks.Callback):
    """Updates the masks of a `prune()`d model on its schedule's steps.

    Steps are the optimizer's `iterations`, so a resumed run (see
    `kdist.callbacks.Checkpoint`) continues the schedule where it stopped. At
    each epoch's end the sparsity of every pruned layer goes into the logs as
    `sparsity/<layer>` (History, CSVLogger, TensorBoard) and to the log.

    Under data parallelism every rank computes the same masks from the same
    weights. Under `kdist.ps.ParameterServerStrategy` the master owns the
    masks: it updates them from the central weights, counting its updates as
    steps, and this callback (given to `fit` as a master callback) only
    reports. A tf_keras model is driven by tensorflow-model-optimization's
    `UpdatePruningStep`.

    Example:

    >>> import keras, kdist
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8)])
    >>> model = kdist.sparsity.prune(model, kdist.sparsity.ConstantSparsity(0.5, 0, frequency=1))
    >>> model.compile("sgd", "mse")
    >>> _ = model.fit(np.ones((8, 4)), np.ones((8, 8)), verbose=0,
    ...               callbacks=[kdist.sparsity.UpdatePruning()])
    >>> list(kdist.sparsity.sparsity_of(model).values())
    [0.5]
    """

    # tf_keras's CallbackList asks these of every callback it is given.
    _supports_tf_logs = False

    def _implements_train_batch_hooks(self):
        return True

    def _implements_test_batch_hooks(self):
        return False

    def _implements_predict_batch_hooks(self):
        return False

    def __init__(self, log_sparsity=True):
        super().__init__()
        self.log_sparsity = bool(log_sparsity)
        self._wrappers = []
        self._delegate = None
        self._last_step = None
        self._pending = {}

    def on_train_begin(self, logs=None):
        if bridge.is_tf_keras(self.model):
            self._delegate = bridge.update_step_callback()
            self._delegate.set_model(self.model)
            self._delegate.on_train_begin(logs)
            return
        self._wrappers = pruned_layers(self.model)
        if not self._wrappers:
            raise ValueError("UpdatePruning: the model has no layer wrapped by "
                             "kdist.sparsity.prune; prune the model before compiling it.")
        if getattr(self.model, "optimizer", None) is None:
            raise ValueError("UpdatePruning counts steps with the model's optimizer; "
                             "compile the model first.")
        self._last_step = None
        self._pending = {}

    def on_train_batch_begin(self, batch, logs=None):
        if self._delegate is not None:
            self._delegate.on_train_batch_begin(batch, logs)
            return
        step = int(keras.ops.convert_to_numpy(self.model.optimizer.iterations))
        # With steps_per_execution > 1 batches are reported in groups: catch up.
        first = step if self._last_step is None else min(step, self._last_step + 1)
        for wrapper in self._wrappers:
            due = [s for s in range(first, step + 1) if wrapper.schedule.should_prune(s)]
            if due:
                self._pending[id(wrapper)] = wrapper.schedule.sparsity(due[-1])
            # A subclassed model builds its layers in its first step: prune them after it.
            if wrapper.built and id(wrapper) in self._pending:
                wrapper.update_mask(self._pending.pop(id(wrapper)))
        self._last_step = step

    def on_epoch_end(self, epoch, logs=None):
        if self._delegate is not None:
            self._delegate.on_epoch_end(epoch, logs)
            return
        if not self.log_sparsity:
            return
        report = sparsity_of(self.model)
        if logs is not None:
            logs.update({f"sparsity/{name}": value for name, value in report.items()})
        logger.info("epoch %d sparsity: %s", epoch + 1,
                    ", ".join(f"{name} {value:.3f}" for name, value in report.items()))
