"""Every use kdist makes of Keras's private API, in one place.

Keras releases minor versions on its own schedule, and `pip install -U keras` can move
what is not public. What kdist needs and Keras does not offer publicly is reached here
and nowhere else, each through one small function whose docstring names the internal it
relies on, so that a Keras release that moves one breaks one function here.
`tests/test_layers.py` fails if another kdist module imports `keras.src` or touches the
private names below. `benchmarks/versions.py` runs the core features against the newest
Keras.
"""


def is_functional(model):
    """Whether `model` is a functional or Sequential model (a graph of layers that
    `keras.models.clone_model` can rebuild), not a subclassed one.

    Relies on `keras.src.models.functional.Functional`, their common class.
    """
    try:
        from keras.src.models.functional import Functional
    except ImportError:  # pragma: no cover - a Keras that moved it
        return False
    return isinstance(model, Functional)


def flatten_layers(layer, include_self=True, recursive=True):
    """Every layer in `layer`, nested models' layers included when `recursive`.

    Relies on `Layer._flatten_layers(include_self, recursive)`.
    """
    return list(layer._flatten_layers(include_self=include_self, recursive=recursive))


def compile_loss_and_metrics():
    """The classes `Model.compile` wraps its loss and metrics in, for a model that
    computes them itself (a pipeline's last stage).

    Relies on `keras.src.trainers.compile_utils.CompileLoss` and `CompileMetrics`.
    """
    from keras.src.trainers.compile_utils import CompileLoss, CompileMetrics

    return CompileLoss, CompileMetrics


def compile_arguments(model):
    """The keyword arguments `model` was compiled with, as Keras keeps them for saving.

    Relies on `Model._compile_config.config`.
    """
    return dict(model._compile_config.config)


def set_initial_epoch(model, epoch):
    """Makes the `fit` that is starting continue at `epoch` (callbacks see it, and the
    progress bar counts from it), as `fit(initial_epoch=epoch)` would.

    Relies on `Model._initial_epoch`, which `fit` reads after `on_train_begin`.
    """
    model._initial_epoch = epoch


def initial_epoch(model):
    """The epoch the starting `fit` continues at when a callback set one (Keras's
    `BackupAndRestore` does when it restores a backup), else None.

    Relies on `Model._initial_epoch`, as `set_initial_epoch`.
    """
    return getattr(model, "_initial_epoch", None)


def optimizer_iterations(optimizer):
    """The variable behind `optimizer.iterations` where the property returns a value
    rather than the variable (under a loss-scale wrapper).

    Relies on `Optimizer._iterations`.
    """
    return optimizer._iterations


def optimizer_variable_index(optimizer, variable):
    """The position of `variable` among those `optimizer` was built for (the index of
    its slots).

    Relies on `Optimizer._get_variable_index`.
    """
    return optimizer._get_variable_index(variable)


def producing_layer_name(tensor):
    """The name of the layer (operation) whose output the symbolic `tensor` is; None
    for a tensor with no history.

    Relies on `KerasTensor._keras_history.operation`.
    """
    history = getattr(tensor, "_keras_history", None)
    return None if history is None else history.operation.name


def inbound_tensors(layer):
    """The symbolic tensors `layer` has been called on, in every model it is part of.

    Relies on `Layer._inbound_nodes` and `Node.input_tensors`.
    """
    import keras

    tensors = []
    for node in getattr(layer, "_inbound_nodes", []):
        tensors.extend(keras.tree.flatten(node.input_tensors))
    return tensors


def pass_on_input_shape(wrapper, layer):
    """Makes `wrapper`, put in the place of `layer`, give a Sequential model an input as
    `layer` would when made with `input_shape=`: the shape given to the wrapper itself
    wins, else the layer's.

    Keras keeps the `input_shape=` argument of a layer only privately, for `Sequential`
    to add its `InputLayer`; nothing public reads or sets it. Relies on
    `Layer._input_shape_arg`.
    """
    wrapper._input_shape_arg = (getattr(wrapper, "_input_shape_arg", None)
                                or getattr(layer, "_input_shape_arg", None))


def stored_kernel(layer):
    """The variable a Keras layer keeps its kernel in (`Dense`, `EinsumDense`, the
    convolutions), or None for a layer without one.

    The public `kernel` of these layers is a property that returns a computed tensor,
    not the variable, when LoRA or quantization is on; the variable has no public name.
    Relies on `Layer._kernel`.
    """
    return getattr(layer, "_kernel", None)


def own_layer_variables(layer):
    """The variables `layer` saves as its own, without its sublayers', in the order
    `save_own_variables` writes them: the trainable ones, then the others.

    The public `trainable_weights` and `non_trainable_weights` include sublayers' and
    follow `trainable`. Relies on `Layer._trainable_variables` and
    `_non_trainable_variables`, the lists `Layer.load_own_variables` reads.
    """
    return layer._trainable_variables + layer._non_trainable_variables


def attention_uses_gate(layer):
    """Whether a `keras.layers.MultiHeadAttention` was made with `use_gate=True`
    (False for a Keras without the argument).

    The layer has no public attribute for it; its `get_config` holds it, but a
    subclass's `get_config` may leave it out or need arguments the layer lacks.
    Relies on `MultiHeadAttention._use_gate`.
    """
    return getattr(layer, "_use_gate", False)


class MomentsThrough:
    """`keras.layers.BatchNormalization` mixin: in training, the mean and variance a
    batch is normalized with come from `self.batch_moments(inputs, mask, axes)`
    (`axes` those Keras reduces over), which returns None to leave them to Keras.

    `BatchNormalization` has no public hook for its statistics. Relies on
    `BatchNormalization._moments(inputs, mask)`, which `call` takes them from, and
    `_reduction_axes`, which `build` sets.
    """

    def _moments(self, inputs, mask):
        moments = self.batch_moments(inputs, mask, self._reduction_axes)
        return super()._moments(inputs, mask) if moments is None else moments


def optimizer_own_variables(optimizer):
    """The variables `optimizer` made itself (the list Keras keeps, not a copy), without
    those of an optimizer it wraps, which a loss-scale optimizer's `variables` include.

    Relies on `Optimizer._variables`, the list the base class's `variables` copies.
    """
    return optimizer._variables


def optimizer_built_variables(optimizer):
    """The variables `optimizer` was built for (`build(var_list)`), in their order: those
    `apply` updates when it is given no variables.

    Keras has no public name for them. Relies on `Optimizer._trainable_variables`.
    """
    return optimizer._trainable_variables


def tensorboard_train_writer(callback):
    """The summary writer of a `keras.callbacks.TensorBoard`'s training run, for a
    subclass that writes its own scalars next to Keras's, in the same event files.

    The callback does not expose its writers. Relies on `TensorBoard._train_writer`.
    """
    return callback._train_writer


TF_KERAS_BATCH_MODES = ("train", "test", "predict")


class AnswersTfKeras:
    """Callback mixin: a Keras callback that tf_keras's `fit` can drive too (for a
    tf_keras model, which kdist hands to tensorflow-model-optimization).

    tf_keras's `CallbackList` asks each callback whether it takes its logs as tensors
    (no: as NumPy values) and whether to call its batch hooks of each mode ("train",
    "test", "predict"); the class using this mixin answers the latter with
    `self.calls_batch_hooks(mode)`. Keras 3's callbacks have no such questions.

    Relies on tf_keras's `Callback._supports_tf_logs` and
    `_implements_train_batch_hooks`, `_implements_test_batch_hooks` and
    `_implements_predict_batch_hooks`.
    """

    _supports_tf_logs = False

    def _implements_train_batch_hooks(self):
        return self.calls_batch_hooks("train")

    def _implements_test_batch_hooks(self):
        return self.calls_batch_hooks("test")

    def _implements_predict_batch_hooks(self):
        return self.calls_batch_hooks("predict")


def calls_batch_hooks(callback, mode):
    """A tf_keras callback's answer to whether tf_keras calls its batch hooks of `mode`
    (one of `TF_KERAS_BATCH_MODES`), for a callback that hands its work to it.

    Relies on tf_keras's `Callback._implements_<mode>_batch_hooks`, as `AnswersTfKeras`.
    """
    if mode not in TF_KERAS_BATCH_MODES:
        raise ValueError(f"mode is one of {TF_KERAS_BATCH_MODES}; got {mode!r}.")
    return getattr(callback, f"_implements_{mode}_batch_hooks")()


def is_loss_scale_finite_check(fn):
    """Whether `fn`, run through a strategy, is Keras's loss-scale optimizer checking its
    gradients for overflow (which every rank must decide alike).

    Relies on `LossScaleOptimizer.check_finite` being the method it runs.
    """
    import keras

    owner = getattr(fn, "__self__", None)
    return (getattr(fn, "__name__", "") == "check_finite"
            and isinstance(owner, keras.optimizers.LossScaleOptimizer))


def is_predict_step(fn):
    """Whether `fn` is Keras's prediction step (`predict` runs it through `strategy.run`).

    Relies on the step's name, `Model.predict_step`, or on its being made inside
    `make_predict_function`.
    """
    import inspect

    fn = inspect.unwrap(getattr(fn, "python_function", fn))
    return (getattr(fn, "__name__", "") == "predict_step"
            or "make_predict_function" in getattr(fn, "__qualname__", ""))


def load_optimizer_weights_from_h5(group):
    """The optimizer weights stored in an open `.h5` file (Keras's legacy format), as
    arrays.

    Relies on `keras.src.legacy.saving.legacy_h5_format.load_optimizer_weights_from_hdf5_group`.
    """
    from keras.src.legacy.saving import legacy_h5_format

    return legacy_h5_format.load_optimizer_weights_from_hdf5_group(group)
