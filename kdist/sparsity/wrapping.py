"""Layers that change what their wrapped layer sees as its kernel.

A `KernelWrapper` calls its layer with the kernel replaced by a transformed
value (masked, fake-quantised) inside a `keras.StatelessScope`, so the
layer's own code runs unchanged and gradients reach the real kernel through
the transform. Wrappers nest: the outermost applies every transform of the
chain, innermost first, in one scope.

`rewrite` copies a Sequential or functional model with some layers replaced,
carrying every weight over; `strip` uses it to drop the wrappers again.
"""

import inspect
import warnings

import keras

from kdist import _keras_private
from kdist.sparsity import bridge


# What Keras's layers call the weight to prune, in order of preference after the
# variable behind `kernel` (see `_kernel_candidates`): a SeparableConv's pointwise
# kernel holds most of its weights.
_KERNEL_NAMES = ("kernel", "pointwise_kernel", "depthwise_kernel", "embeddings")
_INITIALIZER_NAMES = ("kernel_initializer", "pointwise_initializer", "depthwise_initializer",
                      "embeddings_initializer")


_RECURRENT = (keras.layers.RNN, keras.layers.Bidirectional)
# Layers whose weights to transform sit in several sublayers: pruning handles them,
# quantisation (one kernel, one output per layer) leaves them in float.
_SEVERAL_KERNELS = _RECURRENT + (keras.layers.MultiHeadAttention,)


def target_variables(layer):
    """The weights a wrapper of `layer` transforms, kernel first; [] for none.

    A layer that names its own weights to prune (`get_prunable_weights`, as
    `kdist.sparsity.PrunableLayer` asks) gets those. A recurrent layer (LSTM,
    GRU, SimpleRNN, ConvLSTM, Bidirectional) gets its cells' input and
    recurrent kernels; a MultiHeadAttention its query, key, value and output
    kernels.
    """
    chosen = getattr(layer, "get_prunable_weights", None)
    if callable(chosen) and layer.built:
        return list(chosen())
    return kernel_targets(layer)


def kernel_targets(layer):
    """The weights `target_variables` finds in a Keras layer by its kind, not asking
    the layer's own `get_prunable_weights`."""
    if isinstance(layer, keras.layers.Bidirectional):
        return target_variables(layer.forward_layer) + target_variables(layer.backward_layer)
    if isinstance(layer, keras.layers.MultiHeadAttention):
        if not layer.built:
            return []
        return [dense.kernel for dense in (layer.query_dense, layer.key_dense,
                                           layer.value_dense, layer.output_dense)]
    if isinstance(layer, keras.layers.RNN):
        cells = getattr(layer.cell, "cells", [layer.cell])  # StackedRNNCells holds several
        return [variable for cell in cells for name in ("kernel", "recurrent_kernel")
                for variable in [getattr(cell, name, None)]
                if isinstance(variable, keras.Variable) and variable.trainable]
    for value in _kernel_candidates(layer):
        if isinstance(value, keras.Variable) and value.trainable:
            return [value]
    return []


def _kernel_candidates(layer):
    # The variable first: under LoRA or quantization a layer's `kernel` is a tensor
    # computed from it. Read one at a time, as computing that tensor costs.
    yield _keras_private.stored_kernel(layer)
    for name in _KERNEL_NAMES:
        yield getattr(layer, name, None)


def builds_from_several_inputs(layer):
    """Whether `layer.build` needs more than one shape (MultiHeadAttention's query and
    value): a wrapper, given one input shape when it builds, cannot build it."""
    parameters = inspect.signature(layer.build).parameters.values()
    return sum(p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
               for p in parameters) > 1


def build_from_call(layer, inputs, *args, **kwargs):
    """Builds `layer` from the shapes of the tensors it is called on, each passed to
    the `build` argument named after it (`value` to `value_shape`), as Keras does."""
    bound = inspect.signature(layer.call).bind(inputs, *args, **kwargs).arguments
    accepted = inspect.signature(layer.build).parameters
    layer.build(**{f"{name}_shape": tuple(value.shape) for name, value in bound.items()
                   if f"{name}_shape" in accepted and hasattr(value, "shape")})


def kernel_variable(layer):
    """The kernel `Variable` of `layer` (the first of `target_variables`), or None."""
    targets = target_variables(layer)
    return targets[0] if targets else None


def fresh_copy(layer):
    """A new, unbuilt layer configured as `layer`.

    A kdist wrapper copies the layer it wraps through that layer's own
    class and keeps its object arguments (a `QuantizeConfig`) as they are,
    so copying a model needs no registration of custom classes.
    """
    if getattr(layer, "copied_by_kdist", False):
        config = layer.get_config()
        config["layer"] = fresh_copy(layer.layer)
        config.update(layer.object_arguments())
        return type(layer).from_config(config)
    if isinstance(layer, keras.layers.Lambda):
        # Its function is this process's own object, not code read from a file.
        copy = keras.layers.Lambda.from_config(layer.get_config(), safe_mode=False)
    else:
        copy = type(layer).from_config(layer.get_config())
    build_config = layer.get_build_config() if layer.built else None
    if build_config and "shapes_dict" in build_config:
        # Built from several inputs (query and value): a wrapper, which sees one
        # input shape when it builds, could not build the copy itself.
        copy.build_from_config(build_config)
    return copy


def wrapper_from_config(cls, config, custom_objects=None):
    """A `cls` wrapper from its config, its wrapped layer deserialised first (unless
    the config holds the layer itself)."""
    config = dict(config)
    if not isinstance(config["layer"], keras.layers.Layer):
        config["layer"] = keras.saving.deserialize_keras_object(
            config["layer"], custom_objects=custom_objects)
    return cls(**config)


def check_buildable(wrapper, layer):
    """Refuses to build `wrapper` around `layer` when only its first input's shape is
    known and `layer` needs more (a wrapper with weights of its own builds first)."""
    if not layer.built and builds_from_several_inputs(layer):
        raise ValueError(
            f"{type(wrapper).__name__} needs {type(layer).__name__} {layer.name!r} built "
            "first: it builds from several inputs (a query and a value), and a wrapper is "
            "given one input shape. Call the layer on them (or wrap the model it is used "
            "in) before wrapping it.")


class KernelWrapper(keras.layers.Wrapper):
    """Base class of `PruneLowMagnitude` and `QuantizeAware`: a layer seen through a
    transformed kernel.

    A wrapper calls its layer with the kernel replaced by a transformed value
    (masked, fake-quantised) inside a `keras.StatelessScope`, so the layer's
    own code runs unchanged and gradients reach the real kernel through the
    transform. Wrappers nest: the outermost applies every transform of the
    chain, innermost first, in one scope. `kdist.sparsity.strip` replaces a
    chain by a plain layer computing what it computes at inference.

    A subclass gives `transform_kernel` (and `transform_bias`,
    `transform_output` and `build_state` as it needs). A wrapper transforms
    each of its layer's `targets` (one kernel, or the input and recurrent
    kernels of a recurrent layer); `index` says which.

    Args:
        layer: the layer to wrap, or another `KernelWrapper`.
        **kwargs: Keras wrapper arguments (`name`, `dtype`); the dtype policy
            defaults to the layer's.
    """

    copied_by_kdist = True
    # Whether a layer with nothing to transform (Dropout, pooling, BatchNormalization)
    # may be wrapped, to compute just what it computes.
    accepts_no_targets = False

    def __init__(self, layer, **kwargs):
        kwargs.setdefault("dtype", layer.dtype_policy)
        super().__init__(layer, **kwargs)
        # A first layer given `input_shape=` still gives its Sequential model an input.
        # Given to the wrapper itself (tfmot passes layer arguments on), it wins.
        _keras_private.pass_on_input_shape(self, layer)

    def __call__(self, *args, **kwargs):
        if not args:
            # Called with its inputs by keyword (`query=`, `value=`), as its layer may be:
            # the first goes where the wrapper's `call` takes it.
            first = next(iter(inspect.signature(self.base_layer.call).parameters), None)
            if first in kwargs:
                args = (kwargs.pop(first),)
        return super().__call__(*args, **kwargs)

    @property
    def base_layer(self):
        """The plain layer at the bottom of the wrapper chain."""
        layer = self.layer
        while isinstance(layer, KernelWrapper):
            layer = layer.layer
        return layer

    @property
    def targets(self):
        """The variables this wrapper transforms, kernel first."""
        return target_variables(self.base_layer)

    @property
    def kernel(self):
        return kernel_variable(self.base_layer)

    def _chain(self):
        chain, layer = [self], self.layer
        while isinstance(layer, KernelWrapper):
            chain.append(layer)
            layer = layer.layer
        return chain[::-1]  # innermost first

    def build(self, input_shape=None):
        check_buildable(self, self.base_layer)
        super().build(input_shape)
        if not self.targets and not self.accepts_no_targets:
            raise ValueError(f"{type(self).__name__} needs a layer with a kernel; "
                             f"{self.base_layer.name} has none.")
        self.build_state(self.targets)
        self.built = True

    def object_arguments(self):
        """Constructor arguments that `fresh_copy` passes on as objects."""
        return {}

    def build_state(self, targets):
        """Creates the wrapper's own variables once the target weights exist."""

    def transform_kernel(self, value, training, index=0):
        return value

    def transform_bias(self, value, training):
        return value

    def transform_output(self, outputs, training):
        return outputs

    @property
    def bias(self):
        bias = getattr(self.base_layer, "bias", None)
        return bias if isinstance(bias, keras.Variable) else None

    def effective_kernel(self, training=False, index=0):
        """The kernel (or `targets[index]`) the wrapped layer computes with."""
        value = self.targets[index].value
        for wrapper in self._chain():
            value = wrapper.transform_kernel(value, training, index)
        return value

    def effective_bias(self, training=False):
        """The bias the wrapped layer computes with (None when it has none)."""
        if self.bias is None:
            return None
        value = self.bias.value
        for index, target in enumerate(self.targets):
            if target is self.bias:  # a custom layer that prunes its bias
                value = self.effective_kernel(training, index)
        for wrapper in self._chain():
            value = wrapper.transform_bias(value, training)
        return value

    def call(self, inputs, *args, training=None, **kwargs):
        training = bool(training)
        base, bias = self.base_layer, self.bias
        given = {id(target): self.effective_kernel(training, index)
                 for index, target in enumerate(self.targets)}
        if bias is not None:
            given[id(bias)] = self.effective_bias(training)
        mapping = []
        for variable in base.variables:
            given.setdefault(id(variable), variable.value)
            mapping.append((variable, given[id(variable)]))
        with keras.StatelessScope(mapping, collect_losses=True) as scope:
            outputs = base(inputs, *args, training=training, **kwargs)
        # What the layer assigned inside the scope (statistics, seeds) is applied now.
        for variable in base.variables:
            updated = scope.get_current_value(variable)
            if updated is not None and updated is not given[id(variable)]:
                variable.assign(updated)
        for loss in scope.losses:
            self.add_loss(loss)
        for wrapper in self._chain():
            outputs = wrapper.transform_output(outputs, training)
        return outputs

    def compute_output_shape(self, input_shape):
        return self.base_layer.compute_output_shape(input_shape)

    def compute_output_spec(self, inputs, *args, **kwargs):
        # The base layer's own rule, for layers called on several inputs.
        return self.base_layer.compute_output_spec(inputs, *args, **kwargs)

    @classmethod
    def from_config(cls, config, custom_objects=None):
        return wrapper_from_config(cls, config, custom_objects)

    def restore_config(self, config):
        """The base layer's config as it is to be once this wrapper is gone."""
        return config

    def stripped_layer(self):
        """A new plain layer computing what this wrapper chain computes at inference."""
        config = self.base_layer.get_config()
        for wrapper in self._chain():
            config = wrapper.restore_config(config)
        return type(self.base_layer).from_config(config)

    def strip_weights(self):
        """The base layer's weights with the effective kernel and bias in their places."""
        effective = {id(target): self.effective_kernel(False, index)
                     for index, target in enumerate(self.targets)}
        if self.bias is not None:
            effective[id(self.bias)] = self.effective_bias(False)
        return [keras.ops.convert_to_numpy(effective.get(id(v), v)).astype(v.dtype)
                for v in self.base_layer.weights]


def wrappers_in(model, kind=KernelWrapper):
    """Every wrapper of type `kind` in `model`, nested ones included."""
    if isinstance(model, keras.layers.Layer):
        return [layer for layer in _keras_private.flatten_layers(model)
                if isinstance(layer, kind)]
    raise TypeError(f"Expected a Keras model or layer; got {type(model).__name__}.")


def fresh_inputs(model):
    """New `keras.Input`s in the structure of `model.input`, each with the shape, dtype
    and layer name of the input it stands for (Keras's own copy names them after
    their tensors, `keras_tensor_7`), so a copied model keeps its input names."""
    return keras.tree.map_structure(
        lambda tensor: keras.Input(batch_shape=tensor.shape, dtype=tensor.dtype,
                                   name=_keras_private.producing_layer_name(tensor)),
        model.input)


def rewrite(model, replace, caller):
    """A copy of `model` with `replace(layer)` substituted where it is not None.

    `replace(layer)` returns `(new_layer, target, weights)`: once the copy is
    built, `target.set_weights(weights)`. Every other layer is re-created from
    its config and gets its weights copied.
    """
    if isinstance(model, keras.Model) and not (
            isinstance(model, keras.Sequential)
            or _keras_private.is_functional(model)):
        raise TypeError(
            f"{caller}() rewrites Sequential and functional models; "
            f"{type(model).__name__} is a subclassed model. Wrap its layers where you create "
            f"them instead, e.g. `self.dense = kdist.sparsity.{caller}(keras.layers.Dense(64), "
            "...)`.")
    fills = []

    def clone(layer):
        found = replace(layer)
        if found is None:
            try:
                fresh = fresh_copy(layer)
            except (TypeError, NotImplementedError) as error:
                # A custom layer without a working get_config: the copy uses the layer
                # itself, as tfmot's copies do every layer they leave alone.
                warnings.warn(f"{caller}(): layer {layer.name!r} cannot be made again from "
                              f"its config ({type(error).__name__}: {error}); the copy shares "
                              "it, and its weights, with the original model.", stacklevel=4)
                return layer
            found = (fresh, fresh, layer.get_weights() if layer.built else None)
        new, target, weights = found
        if weights is not None:
            fills.append((target, weights))
        return new

    inputs = None if isinstance(model, keras.Sequential) else fresh_inputs(model)
    copy = keras.models.clone_model(model, input_tensors=inputs, clone_function=clone,
                                    recursive=True)
    for target, weights in fills:
        if weights and target.built:
            target.set_weights(weights)
    return copy


def wrap_layers(model, wrap, kind, skip, verb, several_kernels=True, every_layer=False,
                share_layers=False):
    """`wrap(layer)` around every layer with a kernel that is not already a `kind`.

    A Sequential or functional model is copied (weights included) with its
    layers wrapped; a single layer is wrapped as it is. `skip` holds layer
    names or classes to leave alone. `verb` names the caller in errors.
    `several_kernels`: whether `kind` handles layers with several kernels
    (recurrent layers, MultiHeadAttention). `every_layer`: wrap the layers
    without a kernel too (not inner models, whose layers are wrapped).
    `share_layers`: the new model wraps or reuses `model`'s own layer objects (and
    so its weights) instead of copies, as tensorflow-model-optimization's pruning does.
    """
    skip = tuple(skip) if isinstance(skip, (list, tuple, set)) else (skip,)
    for entry in skip:
        if not isinstance(entry, (str, type)):
            raise TypeError(f"skip takes layer names or layer classes; got {entry!r}.")

    def skipped(layer):
        return any(layer.name == s if isinstance(s, str) else isinstance(layer, s)
                   for s in skip)

    def wanted(layer):
        if isinstance(layer, kind) or skipped(layer):
            return False
        base = layer.base_layer if isinstance(layer, KernelWrapper) else layer
        if isinstance(base, _SEVERAL_KERNELS):
            return several_kernels
        if every_layer:
            return not isinstance(base, (keras.Model, keras.layers.InputLayer))
        return kernel_variable(base) is not None or (not base.built and (
            any(hasattr(base, name) for name in _INITIALIZER_NAMES)
            or hasattr(base, "get_prunable_weights")))

    if isinstance(model, keras.Model):
        chosen = []

        def replace(layer):
            if not wanted(layer):
                return (layer, layer, None) if share_layers else None
            if share_layers:
                chosen.append(layer.name)
                return wrap(layer), layer, None
            fresh = fresh_copy(layer)
            chosen.append(layer.name)
            return wrap(fresh), fresh, layer.get_weights() if layer.built else None

        wrapped = rewrite(model, replace, verb)
        left = [layer.name for layer in _keras_private.flatten_layers(model, include_self=False)
                if isinstance(layer, _SEVERAL_KERNELS) and not skipped(layer)]
        if left and not several_kernels:
            warnings.warn(
                f"{verb}() leaves the layers {left} as they are: it handles one kernel "
                "per layer, and a recurrent layer keeps two in its cell, a "
                "MultiHeadAttention four in its sublayers. Skip them explicitly to silence "
                "this.", stacklevel=3)
        if not chosen:
            raise ValueError(f"Nothing to {verb} in model {model.name!r}: no layer with a "
                             f"kernel is left after skip={list(skip)}.")
        return wrapped
    if isinstance(model, keras.layers.Layer):
        if not wanted(model):
            raise ValueError(f"Cannot {verb} layer {model.name!r}: it has no kernel, is "
                             f"already wrapped for it, or is in skip.")
        return wrap(model)
    raise TypeError(f"{verb}() takes a Keras model or layer; got {type(model).__name__}.")


def strip(model):
    """A plain model: every kdist wrapper replaced by its layer, computing as before.

    A pruned kernel gets its zeros, a quantised one its values on the grid
    (activations are no longer quantised). The result predicts exactly what
    the wrapped model predicts at inference (without activation
    quantisation). A tf_keras model goes to tensorflow-model-optimization's
    `strip_pruning`.

    Args:
        model: a Sequential or functional model (a copy is returned), or a
            single kdist wrapper layer (its plain layer is returned).

    Raises:
        TypeError: anything else, a subclassed model included.

    Example:

        >>> import keras, kdist
        >>> model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
        >>> pruned = kdist.sparsity.prune(model, kdist.sparsity.ConstantSparsity(0.5, 0))
        >>> plain = kdist.sparsity.strip(pruned)
        >>> [type(layer).__name__ for layer in plain.layers]
        ['Dense']
    """
    if bridge.is_tf_keras(model):
        return bridge.strip(model)
    if hasattr(model, "strip_weights"):  # a KernelWrapper or a QuantizeWithConfig
        base = model.base_layer
        layer = model.stripped_layer()
        if model.built:
            layer.build_from_config(base.get_build_config())
            layer.set_weights(model.strip_weights())
        return layer
    if not isinstance(model, keras.Model):
        raise TypeError(f"strip() takes a Keras model or a kdist wrapper layer; "
                        f"got {type(model).__name__}.")

    def replace(layer):
        if not hasattr(layer, "strip_weights"):
            return None
        fresh = layer.stripped_layer()
        return fresh, fresh, layer.strip_weights() if layer.built else None

    return rewrite(model, replace, "strip")
