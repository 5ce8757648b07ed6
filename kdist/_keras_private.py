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
