"""Horovod's `load_model`: a saved model comes back with a distributed optimizer."""

import warnings

import keras

from kdist import _keras_private, _registration
from kdist.optimizers.distributed import AllreduceOptimizer, DistributedOptimizer, _assign


def load_model(filepath, custom_optimizers=None, custom_objects=None, compression=None):
    """Loads a saved model and makes its optimizer average gradients across ranks.

    Horovod's `hvd.load_model`, also `kdist.load_model`. The model is loaded with
    `keras.models.load_model` (`.keras` or legacy `.h5`). If it was saved
    with a plain Keras optimizer, that optimizer is wrapped in
    `kdist.DistributedOptimizer(..., compression=compression)` and keeps its
    state (step count, slots, and the loss scale of a
    `keras.optimizers.LossScaleOptimizer`), so training resumes where it stopped,
    and the model is compiled again with its loss and metrics; a
    `kdist.gan.GAN` gets both its optimizers wrapped. A model saved with
    kdist's optimizer loads as it was saved, its own compression included
    (`compression` does not change it).

    From `.h5` the plain optimizer's slots are read from the file, which Keras's own
    `.h5` loader does not do: it restores only the step count and leaves an optimizer
    that cannot train the model.

    Args:
        filepath: the saved model (`.keras`, `.h5` or `.hdf5`).
        custom_optimizers: optimizer classes that the saved model may use
            besides Keras's own (each a `keras.optimizers.Optimizer` subclass).
        custom_objects: other custom classes or functions, by name, as for
            `keras.models.load_model`.
        compression: `kdist.Compression.none` (default), `.fp16` or
            `.topk(ratio)` for the optimizer that gets wrapped.

    Returns:
        The loaded, compiled model.

    Raises:
        TypeError: something in `custom_optimizers` is not a subclass of
            `keras.optimizers.Optimizer`.

    Example:

        >>> import os, tempfile, keras, numpy as np, kdist
        >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        >>> model.compile(keras.optimizers.Adam(0.01), "mse")
        >>> _ = model.fit(np.ones((4, 3)), np.ones((4, 1)), epochs=2, verbose=0)
        >>> path = os.path.join(tempfile.mkdtemp(), "model.keras")
        >>> model.save(path)
        >>> loaded = kdist.load_model(path, compression=kdist.Compression.fp16)
        >>> type(loaded.optimizer).__name__, int(loaded.optimizer.iterations)
        ('AllreduceOptimizer', 2)
    """
    objects = {}
    for cls in custom_optimizers or ():
        if not (isinstance(cls, type) and issubclass(cls, keras.optimizers.Optimizer)):
            raise TypeError("custom_optimizers takes Keras optimizer classes (subclasses of "
                            f"keras.optimizers.Optimizer); got {cls!r}.")
        objects[cls.__name__] = cls
    objects.update(custom_objects or {})
    # Every class kdist writes into saved models, registered even where kdist leaves
    # Keras's imports alone (KDIST_KERAS_REGISTRATION=0).
    _registration.register()
    with warnings.catch_warnings():
        # kdist's advice to load with this very function; the state is restored below.
        warnings.filterwarnings("ignore", message="Keras's .h5 loader built the plain")
        model = keras.models.load_model(filepath, custom_objects=objects)
    with keras.saving.custom_object_scope(objects):
        replaced = {name: _distributed(optimizer, variables, filepath, compression)
                    for name, optimizer, variables in _plain_optimizers(model)}
    if replaced:
        _recompile(model, replaced)
    return model


def _is_distributed(optimizer):
    return isinstance(optimizer, AllreduceOptimizer) or isinstance(
        getattr(optimizer, "inner_optimizer", None), AllreduceOptimizer)


def _has_two_models(model):
    """A `kdist.gan.GAN`, told by what it has (gan sits above optimizers)."""
    return all(hasattr(model, name) for name in ("d_optimizer", "g_optimizer",
                                                  "discriminator", "generator"))


def _plain_optimizers(model):
    """(compile argument, optimizer, variables it updates) for each plain optimizer."""
    if _has_two_models(model):
        found = [] if not model.compiled else [
            ("d_optimizer", model.d_optimizer, model.discriminator),
            ("g_optimizer", model.g_optimizer, model.generator)]
    else:
        optimizer = getattr(model, "optimizer", None)
        found = [] if optimizer is None else [("optimizer", optimizer, model)]
    return [(name, optimizer, owner.trainable_variables if owner.built else None)
            for name, optimizer, owner in found if not _is_distributed(optimizer)]


def _distributed(optimizer, variables, filepath, compression):
    """`optimizer` wrapped in a DistributedOptimizer that holds the state it was saved with."""
    state = _saved_state(optimizer, filepath)
    # A fresh copy: Keras's .h5 loader builds an optimizer for no variables,
    # and such an optimizer refuses the model's.
    fresh = type(optimizer).from_config(optimizer.get_config())
    wrapped = DistributedOptimizer(fresh, compression=compression)
    if variables is None:
        return wrapped  # an unbuilt model: no state was saved for its variables
    wrapped.build(variables)
    # Both lists hold the loss scale's own variables first (if there is a loss
    # scale), then the plain optimizer's; the wrapper's own lie in between.
    plain_old = optimizer.inner_optimizer if _scaled(optimizer) else optimizer
    plain_new = wrapped.inner_optimizer.inner_optimizer if _scaled(wrapped) else (
        wrapped.inner_optimizer)
    scale_count = len(optimizer.variables) - len(plain_old.variables)
    if scale_count and _scaled(wrapped):
        own = len(wrapped.variables) - len(wrapped.inner_optimizer.variables)
        _assign(wrapped.variables[:own], state[:scale_count], wrapped.name)
    _assign(plain_new.variables, state[scale_count:], wrapped.name)
    return wrapped


def _scaled(optimizer):
    return isinstance(optimizer, keras.optimizers.LossScaleOptimizer)


def _saved_state(optimizer, filepath):
    """The optimizer's saved values, in the order of its `variables` when built."""
    if not str(filepath).endswith((".h5", ".hdf5")):
        return [keras.ops.convert_to_numpy(v) for v in optimizer.variables]
    # Keras's .h5 loader restores only the variables that exist before the
    # optimizer is built: read the rest from the file.
    import h5py
    import numpy as np
    with h5py.File(filepath, "r") as f:
        if "optimizer_weights" not in f:
            return [keras.ops.convert_to_numpy(v) for v in optimizer.variables]
        return [np.asarray(value)
                for value in _keras_private.load_optimizer_weights_from_h5(f)]


def _recompile(model, optimizers):
    if _has_two_models(model):
        arguments = dict(model._compile_args)
    else:
        # What the model was compiled with, as Keras keeps it for saving.
        arguments = _keras_private.compile_arguments(model)
    arguments.update(optimizers)
    model.compile(**arguments)
