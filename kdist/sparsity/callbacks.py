"""The callback that moves pruning masks along their schedules, and sparsity reports."""

import logging
import os

import keras
import numpy as np

from kdist import _keras_private
from kdist.comm import collectives, processes
from kdist.sparsity import bridge
from kdist.sparsity.pruning import pruned_layers
from kdist.sparsity.quantization import QuantizeAware
from kdist.sparsity.wrapping import wrappers_in

logger = logging.getLogger(__name__)


def sparsity_of(model):
    """Fraction of zeros in the kernels each pruned layer computes with, by layer name."""
    return {wrapper.base_layer.name: float(np.mean(np.concatenate([
        keras.ops.convert_to_numpy(wrapper.effective_kernel(False, index)).ravel()
        for index in range(len(wrapper.targets))]) == 0))
        for wrapper in pruned_layers(model) if wrapper.targets}


class UpdatePruning(_keras_private.AnswersTfKeras, keras.callbacks.Callback):
    """Updates the masks of a `prune()`d model on its schedule's steps.

    Steps are counted by each pruned layer (`pruning_step`, saved with the
    model) and advance with the optimizer's `iterations`, so a resumed run
    (see `kdist.callbacks.Checkpoint`), a recompiled model and a pruned model
    that is then quantised continue the schedule where it stopped. At
    each epoch's end the sparsity of every pruned layer goes into the logs as
    `sparsity/<layer>` (History, CSVLogger, TensorBoard) and to the log.

    Under data parallelism every rank computes the same masks from the same
    weights. Under `kdist.ps.ParameterServerStrategy` the master owns the
    masks: it updates them from the central weights, counting its updates as
    steps, and this callback (given to `fit` as a master callback) only
    reports. A tf_keras model is driven by tensorflow-model-optimization's
    `UpdatePruningStep`.

    The first training batch is step 0 for the schedules. An m-by-n pattern
    (`sparsity_m_by_n`) is set on the schedule's turns. `kdist.tfmot`'s
    `UpdatePruningStep` is a subclass with tfmot's rules instead: it does
    nothing for a model with no pruned layer, counts the first batch as step
    1, and sets an m-by-n pattern once, at step 1.

    Args:
        log_sparsity: put each pruned layer's sparsity into the logs and the
            log at each epoch's end.

    Raises:
        ValueError: at the start of training, when the model has no layer
            wrapped by `prune` or is not compiled.

    Example:

        >>> import keras, numpy as np, kdist
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8)])
        >>> model = kdist.sparsity.prune(
        ...     model, kdist.sparsity.ConstantSparsity(0.5, 0, frequency=1))
        >>> model.compile("sgd", "mse")
        >>> _ = model.fit(np.ones((8, 4)), np.ones((8, 8)), verbose=0,
        ...               callbacks=[kdist.sparsity.UpdatePruning()])
        >>> list(kdist.sparsity.sparsity_of(model).values())
        [0.5]
    """

    # The step number a schedule sees on the first batch: kdist counts steps
    # from 0, tfmot's wrapper from 1 (kdist.tfmot's callback says so).
    _first_step = 0

    def calls_batch_hooks(self, mode):
        """Whether tf_keras's `fit` calls this callback's batch hooks of `mode`:
        of training only."""
        return mode == "train"

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
        newly = [w for w in self._wrappers if not w.step_callback_attached]
        for wrapper in newly:
            wrapper.step_callback_attached = True
        if newly and getattr(self.model, "train_function", None) is not None:
            # A train step traced without this callback fails by design; trace anew.
            self.model.make_train_function(force=True)
        if getattr(self.model, "optimizer", None) is None:
            raise ValueError("UpdatePruning counts steps with the model's optimizer; "
                             "compile the model first.")
        self._last_step = None
        self._pending = {}
        # The layers' own step counts go on from where they are, whatever
        # optimizer this run has: step = iterations - origin. Layers that have
        # not counted yet (new, or saved before they counted) follow the optimizer.
        done = max((max(0, int(keras.ops.convert_to_numpy(w.pruning_step)))
                    for w in self._wrappers if w.built), default=0)
        self._origin = self._optimizer_steps() - done if done else 0

    def _optimizer_steps(self):
        return int(keras.ops.convert_to_numpy(self.model.optimizer.iterations))

    def on_train_batch_begin(self, batch, logs=None):
        if self._delegate is not None:
            self._delegate.on_train_batch_begin(batch, logs)
            return
        step = self._optimizer_steps() - self._origin
        # With steps_per_execution > 1 batches are reported in groups: catch up.
        first = step if self._last_step is None else min(step, self._last_step + 1)
        shift = self._first_step
        for wrapper in self._wrappers:
            due = self._turns(wrapper, range(first + shift, step + shift + 1))
            if due:
                self._pending[id(wrapper)] = wrapper.schedule.sparsity(due[-1])
            # A subclassed model builds its layers in its first step: prune them after it.
            if wrapper.built and id(wrapper) in self._pending:
                wrapper.update_mask(self._pending.pop(id(wrapper)))
            if wrapper.built:
                wrapper.pruning_step.assign(step + 1)
        self._last_step = step

    def _turns(self, wrapper, steps):
        """The steps among `steps` at which `wrapper`'s masks are recomputed."""
        return [s for s in steps if wrapper.schedule.should_prune(s)]

    def on_epoch_end(self, epoch=-1, logs=None, batch=None):
        # tfmot's callback names its first argument `batch`; its custom-loop
        # recipe calls `on_epoch_end(batch=-1)`.
        if self._delegate is not None:
            self._delegate.on_epoch_end(epoch if batch is None else batch, logs)
            return
        if not self.log_sparsity:
            return
        report = sparsity_of(self.model)
        if logs is not None:
            logs.update({f"sparsity/{name}": value for name, value in report.items()})
        when = f"epoch {epoch + 1} " if epoch is not None and epoch >= 0 else ""
        logger.info("%ssparsity: %s", when,
                    ", ".join(f"{name} {value:.3f}" for name, value in report.items()))


class SyncQuantizeRanges(keras.callbacks.Callback):
    """Keeps the output ranges of `quantize()`d layers equal on every rank.

    Each rank's layers track the range of the batches that rank sees. Under
    data parallelism (`kdist.DistributedOptimizer`, `MPIStrategy`) the ranks'
    ranges would drift apart, and each rank would end with a different
    integer model. After every training step this callback averages them
    over the ranks that train together: the optimizer's communicator, or all
    ranks. The ranges are moving averages, which are linear, so the result is
    the moving average of the ranks' batches taken together. On one process
    it does nothing. Give it to every rank; the parameter server needs it
    not, since its master holds the one copy of the ranges.

    Raises:
        ValueError: at the start of training, when the model has no layer
            quantised by `quantize` with `activations=True`.

    Example:

        >>> import keras, numpy as np, kdist
        >>> model = kdist.sparsity.quantize(keras.Sequential([keras.Input((4,)),
        ...                                                   keras.layers.Dense(2)]))
        >>> model.compile("sgd", "mse")
        >>> _ = model.fit(np.ones((8, 4)), np.ones((8, 2)), verbose=0,
        ...               callbacks=[kdist.sparsity.SyncQuantizeRanges()])
    """

    def __init__(self):
        super().__init__()
        self._layers, self._comm = [], None

    def on_train_begin(self, logs=None):
        self._layers = [w for w in wrappers_in(self.model, QuantizeAware) if w.activations]
        if not self._layers:
            raise ValueError("SyncQuantizeRanges: the model has no layer quantised with "
                             "activations=True by kdist.sparsity.quantize.")
        comm = getattr(getattr(self.model, "optimizer", None), "comm", None)
        comm = comm if comm is not None else processes.world()
        self._comm = comm if comm.size > 1 else None

    def on_train_batch_end(self, batch, logs=None):
        if self._comm is None:
            return
        variables = [v for w in self._layers if w.built
                     for v in (w.output_min, w.output_max, w.range_seen)]
        values = np.array([float(keras.ops.convert_to_numpy(v)) for v in variables])
        averaged = collectives.allreduce(values, comm=self._comm,
                                         name="kdist_quantize_ranges")
        for variable, value in zip(variables, averaged):
            variable.assign(value)


def _tensorboard_installed():
    import importlib.util

    return importlib.util.find_spec("tensorboard") is not None


class PruningSummaries(keras.callbacks.TensorBoard):
    """TensorBoard logging that adds each pruned layer's sparsity.

    Writes everything `keras.callbacks.TensorBoard` writes, and at each
    epoch's end a scalar `sparsity/<layer>` per pruned layer to the training
    run. Give it after `UpdatePruning` in the callback list. Under data
    parallelism give it to rank 0 only, like any TensorBoard callback.

    Args:
        log_dir: directory of the TensorBoard event files.
        update_freq: `"epoch"`, `"batch"` or a number of batches, for the
            metrics TensorBoard writes (sparsity is written once per epoch).
        **kwargs: any other `keras.callbacks.TensorBoard` argument.

    Raises:
        ValueError: `log_dir` is empty or not a path; at the start of
            training, the model has no layer wrapped by `prune`.
        ImportError: the tensorboard package is not installed (the `tfmot`
            extra installs it).
    """

    def __init__(self, log_dir, update_freq="epoch", **kwargs):
        if not isinstance(log_dir, (str, os.PathLike)) or not str(log_dir):
            raise ValueError(f"PruningSummaries needs a log_dir to write to; got {log_dir!r}.")
        if not _tensorboard_installed():
            # TensorFlow stopped installing it in 2.21; otherwise the first summary fails.
            raise ImportError("PruningSummaries writes TensorBoard event files, which needs "
                              "the tensorboard package: pip install tensorboard (kdist's "
                              "'tfmot' extra installs it).")
        super().__init__(log_dir=log_dir, update_freq=update_freq, **kwargs)

    def on_train_begin(self, logs=None):
        if not pruned_layers(self.model):
            raise ValueError("PruningSummaries: the model has no layer wrapped by "
                             "kdist.sparsity.prune; prune the model before training it.")
        super().on_train_begin(logs)

    def on_epoch_end(self, epoch, logs=None):
        import tensorflow as tf

        # UpdatePruning put the same values in `logs`: written once, below.
        kept = {k: v for k, v in (logs or {}).items() if not k.startswith("sparsity/")}
        super().on_epoch_end(epoch, kept)
        with _keras_private.tensorboard_train_writer(self).as_default():
            for name, value in sparsity_of(self.model).items():
                tf.summary.scalar(f"sparsity/{name}", value, step=epoch)
