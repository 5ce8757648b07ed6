"""tensorflow-model-optimization's Keras API, for Keras 3 models.

tfmot works only on tf_keras models. This module gives its import paths
over `kdist.sparsity`, so a tfmot pruning or quantization-aware training
script runs on Keras 3 after changing its import line:

    import kdist.tfmot as tfmot     # was: import tensorflow_model_optimization as tfmot

>>> import keras
>>> import kdist.tfmot as tfmot
>>> model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16),
...                           keras.layers.Dense(1)])
>>> schedule = tfmot.sparsity.keras.PolynomialDecay(
...     initial_sparsity=0.5, final_sparsity=0.8, begin_step=0, end_step=100)
>>> pruned = tfmot.sparsity.keras.prune_low_magnitude(model, pruning_schedule=schedule)
>>> pruned.compile("adam", "mse")  # fit with callbacks=[tfmot.sparsity.keras.UpdatePruningStep()]
>>> plain = tfmot.sparsity.keras.strip_pruning(pruned)
>>> qat = tfmot.quantization.keras.quantize_model(plain)

The submodules are importable too: `from kdist.tfmot.sparsity.keras import
prune_low_magnitude` works.

## tfmot's names and kdist's

Under `tfmot.sparsity.keras`:

| tfmot's name | what it is here |
|---|---|
| `prune_low_magnitude` | `kdist.sparsity.prune`'s wrapping, with tfmot's rules (below) |
| `prune_scope` | a custom-object scope, kept for scripts: kdist's classes load without it |
| `strip_pruning` | `kdist.sparsity.strip`, for a model only |
| `PrunableLayer` | `kdist.sparsity.PrunableLayer` |
| `PruningSchedule`, `ConstantSparsity`, `PolynomialDecay` | `kdist.sparsity`'s classes |
| `UpdatePruningStep` | a subclass of `kdist.sparsity.UpdatePruning` with tfmot's counting |
| `PruningSummaries` | `kdist.sparsity.PruningSummaries` |

Under `tfmot.quantization.keras`:

| tfmot's name | what it is here |
|---|---|
| `quantize_model` | every layer quantised in 8 bits, inputs through a `quantize_layer` |
| `quantize_annotate_layer`, `quantize_annotate_model` | `kdist.sparsity`'s functions |
| `quantize_apply` | `kdist.sparsity.quantize_apply`, plus what tfmot's scheme adds |
| `quantize_scope` | a scope with kdist's quantisation classes and any dicts given |
| `QuantizeConfig` | `kdist.sparsity.QuantizeConfig` |
| `fix_input_output_range`, `remove_input_range` | `kdist.sparsity`'s functions |
| `quantizers.Quantizer`, `LastValueQuantizer` | `kdist.sparsity`'s quantizers |
| `quantizers.MovingAverageQuantizer`, `AllValuesQuantizer` | `kdist.sparsity`'s quantizers |
| `quantizers.FixedQuantizer` | `kdist.sparsity.FixedQuantizer` |
| `default_8bit.Default8BitQuantizeRegistry` | `kdist.sparsity.QuantizeRegistry` |
| `default_8bit.Default8BitQuantizeScheme` | a name for kdist's one scheme |
| `QuantizeWrapper`, `QuantizeWrapperV2` | a `QuantizeWithConfig` (see below) |

And `tfmot.experimental.combine.Default8BitPrunePreserveQuantizeScheme`, another
name for kdist's one scheme. The two scheme classes are what `quantize_apply(model,
scheme)` accepts for a Keras 3 model: both name kdist's scheme, 8-bit symmetric
per-channel kernels that keep a pruned kernel's zeros, with moving-average output
ranges; another scheme raises `ValueError`, and so does
`Default8BitQuantizeScheme(disable_per_axis=True)`. `isinstance(layer,
QuantizeWrapper)` is true of every quantised layer, `QuantizeAware` ones included, so
checks written for tfmot find them all.

A tf_keras model, layer or callback's model is handed to
tensorflow-model-optimization itself (extra `tfmot`), with every argument, so a script
that still builds tf_keras models runs too. Names this module does not offer (tfmot's
`clustering`, its other schemes and `default_8bit` names) come from tfmot itself when it
is installed, for tf_keras models only; otherwise they raise `AttributeError`.

## As in tfmot

- `prune_low_magnitude(model)` returns a new, uncompiled model around the model's own
  layers: they, and their weights, are shared with it. Every layer is wrapped, those with
  nothing to prune (Dropout, pooling, Add) included; layers already pruned are kept as
  they are. Wrappers are named `prune_low_magnitude_<layer>`. Anything but a Sequential
  or functional model, a layer or a list of layers raises `ValueError`; so does a layer
  tfmot does not prune (a custom layer that is not a `PrunableLayer`, the ConvLSTM
  layers), before anything is copied.
- Its wrappers fail a training step with `tf.errors.InvalidArgumentError` until an
  `UpdatePruningStep` callback has started (`require_step_callback=True` of
  `kdist.sparsity.PruneLowMagnitude`).
- `UpdatePruningStep` does nothing for a model with no pruned layer, counts the first
  batch as step 1 (`kdist.sparsity.UpdatePruning` counts it as step 0, and raises
  `ValueError` for such a model) and sets an m-by-n pattern once, at step 1.
- `quantize_model` and `quantize_apply` start untrained output ranges at [-6, 6], so a
  model converted before training is int8 too. Layers without weights are treated as
  `kdist.sparsity.QuantizeRegistry` says (`kdist.sparsity.quantize_apply` leaves them in
  float). Wrappers are named `quant_<layer>` (`quantized_layer_name_prefix`).
- `quantize_apply` also quantises the output of an unmarked layer that is the one input
  of a marked layer (a `QuantizeWrapper` with an `OutputOnlyConfig` of the registry's
  config; its weights stay float), so the marked layer reads values on an 8-bit grid;
  inputs get a `quantize_layer` only where quantised layers read them.
- A custom layer marked without a `QuantizeConfig` raises `ValueError` when Keras does not
  know its class (the model cannot be copied: register it or name it in
  `quantize_scope`), and `RuntimeError` when it does; a MultiHeadAttention without a
  config raises `RuntimeError`.
- `None`, a layer where a model is expected or the reverse, a subclassed model, a model
  inside the model to quantise, and a model not yet built (`quantize_model`,
  `quantize_apply`) raise `ValueError`. `kdist.sparsity`'s own functions are more lenient
  (they quantise the layers of inner models) and raise `TypeError` for an object of the
  wrong kind.

## Differences from tfmot

- One scheme for layers marked without a `QuantizeConfig`: 8-bit symmetric per-channel
  kernels (tfmot's default is per tensor for Dense) that keep their zeros, as tfmot's
  `Default8BitPrunePreserveQuantizeScheme` does, with or without a scheme given.
- A config's `set_quantize_weights` is never called: a Keras 3 layer's kernel cannot be
  assigned, so kdist gives the layer its quantised weights itself.
- No pruning policies: `pruning_policy` raises `ValueError` for Keras 3 models.
- `prune_low_magnitude` passes further keyword arguments (`input_shape`, `name`) to a
  single layer's wrapper; with a model or a list they raise `TypeError`, where tfmot
  ignores them.
- `prune_scope` and `quantize_scope` are not needed to load saved models.
- `prune_low_magnitude`, `quantize_model`, `quantize_annotate_model` and `quantize_apply`
  raise `RuntimeError` inside a TF1-style graph (`tf.Graph().as_default()`,
  `tf.compat.v1` graph mode): Keras 3 builds models eagerly; call them outside it.
"""

import contextlib
import functools
import sys
import types

import keras

from kdist import _keras_private
from kdist import sparsity as _sparsity
from kdist.sparsity import annotation as _annotation
from kdist.sparsity import bridge as _bridge
from kdist.sparsity import configured as _configured
from kdist.sparsity import inputs as _inputs
from kdist.sparsity import quantizers as _quantizers
from kdist.sparsity import registry as _registry
from kdist.sparsity import weightless as _weightless
from kdist.sparsity import wrapping as _wrapping

__all__ = ["experimental", "quantization", "sparsity"]


def _real(obj):
    """tensorflow-model-optimization itself when `obj` is a tf_keras object, else None."""
    items = obj if isinstance(obj, (list, tuple)) else [obj]
    return _bridge.tfmot() if any(_bridge.is_tf_keras(item) for item in items) else None


# tfmot checks its arguments before it works, and raises ValueError for each
# of these; kdist.sparsity accepts more (inner models, unbuilt models) or says
# TypeError, so the checks are made here, for Keras 3 objects only.
def _check_model(value, argument, layer_hint=""):
    if value is None:
        raise ValueError(f"`{argument}` cannot be None.")
    if not isinstance(value, keras.Model):
        raise ValueError(f"`{argument}` can only be a Keras model; got "
                         f"{type(value).__name__}.{layer_hint}")
    if not (isinstance(value, keras.Sequential) or _keras_private.is_functional(value)):
        raise ValueError(f"`{argument}` can only be a Sequential or functional model; "
                         f"{type(value).__name__} is a subclassed model. Wrap its layers "
                         "where the model creates them.")


def _check_flat(model, argument):
    inner = [layer.name for layer in model.layers if isinstance(layer, keras.Model)]
    if inner:
        raise ValueError(f"`{argument}` holds the models {inner}: as in tfmot, quantising a "
                         "model inside another is not supported here. kdist.sparsity.quantize "
                         "quantises the layers of inner models too.")


def _check_built(model, argument):
    if not model.built:
        raise ValueError(f"`{argument}` must be a built model: give it an Input layer or "
                         "call model.build(input_shape) first.")


def _check_eager(caller):
    """Keras 3 builds and copies models eagerly; a tf.compat.v1 graph context cannot."""
    import tensorflow as tf

    if not tf.executing_eagerly():
        raise RuntimeError(
            f"{caller}: Keras 3 models are built and copied eagerly, and this runs inside "
            "a TF1-style graph (tf.Graph().as_default() or tf.compat.v1 graph mode). Call "
            "it outside the graph; Keras 3 traces the model into graphs itself when it "
            "trains (model.fit, or a tf.function around your own step).")


def prune_low_magnitude(to_prune, pruning_schedule=None, block_size=(1, 1),
                        block_pooling_type="AVG", pruning_policy=None, sparsity_m_by_n=None,
                        **kwargs):
    """tfmot's `prune_low_magnitude`: a model, a layer or a list of layers, wrapped
    for pruning.

    As in tfmot, a pruned model is a new model around the given model's own
    layers (pruning it prunes them), and layers already wrapped are kept.

    `pruning_schedule` defaults to `ConstantSparsity(0.5, begin_step=0)`, as
    in tfmot; `block_size`, `block_pooling_type` and `sparsity_m_by_n` are
    `kdist.sparsity.prune`'s. Further keyword arguments go to the wrapper of
    a single layer, as Keras layer arguments (`input_shape` for the first
    layer of a Sequential model, `name`, ...); with a model or a list they
    raise `TypeError`, where tfmot ignores them. A `pruning_policy` is
    refused for Keras 3 models rather than ignored; tf_keras models go to
    tfmot with every argument.
    """
    if pruning_schedule is None:
        pruning_schedule = _sparsity.ConstantSparsity(0.5, begin_step=0)
    real = _real(to_prune)
    if real is not None:
        return real.sparsity.keras.prune_low_magnitude(
            to_prune, pruning_schedule=_bridge.schedule(pruning_schedule),
            block_size=block_size, block_pooling_type=block_pooling_type,
            pruning_policy=pruning_policy, sparsity_m_by_n=sparsity_m_by_n, **kwargs)
    if pruning_policy is not None:
        raise ValueError("prune_low_magnitude: pruning_policy is not supported for Keras 3 "
                         "models (kdist does not check layers against XNNPack); leave it out.")
    _check_eager("prune_low_magnitude")
    pattern = dict(block_size=block_size, block_pooling_type=block_pooling_type,
                   sparsity_m_by_n=sparsity_m_by_n)
    is_layer = isinstance(to_prune, keras.layers.Layer)
    is_model = isinstance(to_prune, keras.Model)
    if not (is_layer or isinstance(to_prune, list)) or (is_model and not (
            isinstance(to_prune, keras.Sequential) or _keras_private.is_functional(to_prune))):
        # A subclassed model's layers are pruned one by one where the model creates them.
        raise ValueError(
            "prune_low_magnitude prunes a Sequential or functional model, a layer or a list "
            f"of layers; got an object of type {type(to_prune).__name__}. Inside a "
            "subclassed model, wrap its layers where it creates them.")
    if kwargs and not (is_layer and not isinstance(to_prune, keras.Model)):
        raise TypeError(f"prune_low_magnitude passes {sorted(kwargs)} to the wrapper of a "
                        "single layer; a model or a list of layers takes none.")

    def wrap(layer, **arguments):
        _check_prunable(layer)
        if not hasattr(layer, "get_prunable_weights"):
            # tfmot gives each Keras layer it wraps this method, and scripts call it.
            layer.get_prunable_weights = functools.partial(_wrapping.kernel_targets, layer)
        arguments.setdefault("name", f"prune_low_magnitude_{layer.name}")  # tfmot's name
        return _sparsity.PruneLowMagnitude(layer, pruning_schedule, **pattern,
                                           require_step_callback=True, **arguments)

    # As tfmot, every layer is wrapped, those with nothing to prune (Dropout, pooling,
    # Add) included, and a layer already pruned is kept as it is.
    if isinstance(to_prune, list):
        return [layer if isinstance(layer, _sparsity.PruneLowMagnitude) else
                _wrapping.wrap_layers(layer, wrap, _sparsity.PruneLowMagnitude, (), "prune",
                                      every_layer=True)
                for layer in to_prune]
    if is_model:
        _check_prunable_model(to_prune)  # before anything is copied, as tfmot refuses it
    # kwargs is empty for a model (refused above). As tfmot's, the pruned model wraps the
    # model's own layers: they, and their weights, are shared with it.
    return _uncompiled(_wrapping.wrap_layers(
        to_prune, lambda layer: wrap(layer, **kwargs), _sparsity.PruneLowMagnitude, (),
        "prune", every_layer=True, share_layers=True))


def _uncompiled(model):
    """`model`'s graph as a model that is not compiled, as tfmot returns its copies (the
    optimizer of the original has no business training the copy)."""
    if not isinstance(model, keras.Model) or not model.compiled:
        return model
    if not isinstance(model, keras.Sequential):
        return keras.Model(model.input, model.output, name=model.name)
    start = []
    if model.built and model.inputs:
        first = model.inputs[0]
        start = [keras.Input(batch_shape=first.shape, dtype=first.dtype,
                             name=_keras_private.producing_layer_name(first))]
    return keras.Sequential(start + model.layers, name=model.name)


def _check_prunable_model(model):
    for layer in model.layers:
        if isinstance(layer, keras.Model):
            _check_prunable_model(layer)
        elif not isinstance(layer, (keras.layers.InputLayer, _sparsity.PruneLowMagnitude)):
            _check_prunable(layer)


_CONV_LSTM = ("ConvLSTM1D", "ConvLSTM2D", "ConvLSTM3D")


def _check_prunable(layer):
    """tfmot prunes the Keras layers it lists and layers that name their own weights
    (`PrunableLayer`, `get_prunable_weights`); it refuses the rest, subclasses of
    listed layers and the ConvLSTM layers included. So does this facade."""
    if hasattr(layer, "get_prunable_weights"):
        return
    kind = type(layer)
    from_keras = kind.__module__.split(".")[0] == "keras"
    if from_keras and kind.__name__ not in _CONV_LSTM:
        return
    why = ("tfmot does not prune ConvLSTM layers" if from_keras else
           f"{kind.__name__} is not one of the Keras layers tfmot prunes")
    raise ValueError(
        f"prune_low_magnitude: {why} ({kind.__module__}.{kind.__name__}). Make the layer a "
        "tfmot.sparsity.keras.PrunableLayer that returns its weights from "
        "get_prunable_weights(), or use kdist.sparsity.prune, which prunes every layer with "
        "a kernel.")


def _check_quantizable(layers):
    """tfmot quantises the Keras layers it knows and refuses others (custom layers, and
    subclasses of Keras layers) unless they were annotated with a QuantizeConfig."""
    for layer in layers:
        if getattr(layer, "quantize_config", None) is not None:
            continue
        if isinstance(layer, _annotation.QuantizeAnnotate):
            layer = layer.layer
        kind = type(layer)
        if isinstance(layer, keras.layers.MultiHeadAttention):
            raise RuntimeError(
                f"Layer {layer.name}:{kind.__module__}.{kind.__name__} is not supported, as "
                "in tfmot: annotate it with your own tfmot.quantization.keras.QuantizeConfig "
                "(quantize_annotate_layer), or use kdist.sparsity.quantize(model), which "
                "quantises the other layers and keeps attention in float.")
        if kind.__module__.split(".")[0] in ("keras", "kdist"):
            continue
        if keras.saving.get_registered_object(keras.saving.get_registered_name(kind)) is not kind:
            # The model is copied through Keras's registry, which cannot name this class;
            # tfmot refuses such a layer with a ValueError too.
            raise ValueError(
                f"Layer {layer.name} ({kind.__module__}.{kind.__name__}) is not known to "
                "Keras, so the model cannot be copied to quantise it: register the class "
                "(@keras.saving.register_keras_serializable()) or name it in "
                "tfmot.quantization.keras.quantize_scope({...}), and give the layer a "
                "QuantizeConfig with quantize_annotate_layer(layer, quantize_config).")
        raise RuntimeError(
            f"Layer {layer.name} ({kind.__module__}.{kind.__name__}) is not supported by the "
            "default scheme, which knows Keras's own layers only: mark it with "
            "quantize_annotate_layer(layer, quantize_config), giving a QuantizeConfig that "
            "says how to quantise it.")


def _float_feeders(model):
    """Names of the unmarked layers whose output is the one input of a marked layer."""
    names = set()
    for wrapper in _wrapping.wrappers_in(model, _annotation.QuantizeAnnotate):
        tensors = _keras_private.inbound_tensors(wrapper)
        if len(tensors) == 1:
            names.add(_keras_private.producing_layer_name(tensors[0]))
    return names


def _with_tfmot_configs(model):
    """`model` with the configs tfmot's default scheme gives layers it marks itself.

    A marked layer without weights gets its output quantised (pooling, Add, ReLU,
    ...) or nothing (Reshape, Dropout, ...). An unmarked layer whose output a marked
    layer reads gets that output quantised, its weights left in float
    (`OutputOnlyConfig`): the marked layer then reads values on an 8-bit grid, as an
    integer engine gives it.
    """
    feeders = _float_feeders(model)
    registry = _registry.QuantizeRegistry()

    def configure(layer):
        if isinstance(layer, _annotation.QuantizeAnnotate):
            if layer.quantize_config is not None or layer.layer.weights:
                return None
            config = _weightless.weightless_config(layer.layer)
            if config is None:
                return None
            fresh = _wrapping.fresh_copy(layer.layer)
            return _annotation.QuantizeAnnotate(fresh, config), fresh, None
        if layer.name not in feeders or not registry.supports(layer):
            return None
        config = registry.get_quantize_config(layer)
        if isinstance(config, _weightless.NoQuantizeConfig) and not isinstance(
                config, _weightless.OutputQuantizeConfig):
            return None  # its output is on its input's grid already
        fresh = _wrapping.fresh_copy(layer)
        return (_annotation.QuantizeAnnotate(fresh, _inputs.OutputOnlyConfig(config)), fresh,
                layer.get_weights() if layer.built else None)

    return _wrapping.rewrite(model, configure, "quantize_apply")


def strip_pruning(model):
    """tfmot's `strip_pruning`: the model without its wrappers (`kdist.sparsity.strip`).

    As in tfmot it takes a model only (`kdist.sparsity.strip` also takes a
    wrapper layer).
    """
    if not _bridge.is_tf_keras(model):
        _check_model(model, "model")
    return _sparsity.strip(model)


@contextlib.contextmanager
def _scope(extra, real_scope):
    objects = {cls.__name__: cls for cls in (
        _sparsity.PruneLowMagnitude, _sparsity.QuantizeAware, _annotation.QuantizeAnnotate,
        _sparsity.ConstantSparsity, _sparsity.PolynomialDecay, _configured.QuantizeWithConfig,
        _configured.QuantizeAwareActivation, _quantizers.LastValueQuantizer,
        _quantizers.MovingAverageQuantizer, _quantizers.AllValuesQuantizer,
        _quantizers.FixedQuantizer, _inputs.QuantizeLayer, _inputs.FixedRangeConfig,
        _weightless.OutputQuantizeConfig, _weightless.NoQuantizeConfig)}
    for entry in extra:
        if not isinstance(entry, dict):
            raise TypeError(f"quantize_scope takes dicts of custom objects; got {entry!r}.")
        objects.update(entry)
    with contextlib.ExitStack() as stack:
        if "tf_keras" in sys.modules:  # tf_keras models load through tfmot's own scope
            stack.enter_context(real_scope(_bridge.tfmot())(*extra))
        stack.enter_context(keras.saving.custom_object_scope(objects))
        yield


def prune_scope():
    """tfmot's `prune_scope`: a scope in which saved pruned models load.

    kdist's classes are registered with Keras, so Keras 3 models load
    without it; it is kept so that tfmot scripts run unchanged.
    """
    return _scope((), lambda real: real.sparsity.keras.prune_scope)


def quantize_scope(*args):
    """tfmot's `quantize_scope`: kdist's quantisation classes plus any dicts given."""
    return _scope(args, lambda real: real.quantization.keras.quantize_scope)


def quantize_model(to_quantize, quantized_layer_name_prefix="quant_"):
    """tfmot's `quantize_model`: every layer with a kernel trained in 8 bits.

    See `kdist.sparsity.quantize`. A pruned model (stripped or not) keeps its
    zeros. Wrappers are named `<quantized_layer_name_prefix><layer>`. The model
    starts with a `quantize_layer`; layers without weights are quantised as
    `kdist.sparsity.QuantizeRegistry` says; untrained output ranges start at
    [-6, 6], as tfmot's do, so a model converted before training is int8 too.

    Raises:
        ValueError: `to_quantize` is None, a layer, a subclassed model, holds
            another model, or is not built; a custom layer whose class Keras
            does not know.
        RuntimeError: a custom layer or a MultiHeadAttention (give it a
            `QuantizeConfig` with `quantize_annotate_layer`); called inside a
            TF1-style graph.
    """
    real = _real(to_quantize)
    if real is not None:
        return real.quantization.keras.quantize_model(to_quantize, quantized_layer_name_prefix)
    _check_eager("quantize_model")
    _check_model(to_quantize, "to_quantize", " To quantise one layer use "
                 "quantize_annotate_layer and quantize_apply.")
    _check_flat(to_quantize, "to_quantize")
    _check_built(to_quantize, "to_quantize")
    _check_quantizable(to_quantize.layers)
    annotated = _annotation.quantize_annotate_model(to_quantize)
    return _ranges_from_six(_inputs.quantize_inputs(
        _annotation.quantize_apply(_with_tfmot_configs(annotated),
                                   name_prefix=quantized_layer_name_prefix)))


def _ranges_from_six(model):
    """`model` with its layers' untrained output ranges starting at [-6, 6], where tfmot's
    moving averages start (kdist's own start at the first batch's range). A model
    converted before any training is then quantised over that range, as in tfmot."""
    for wrapper in _wrapping.wrappers_in(model, _sparsity.QuantizeAware):
        if wrapper.built and wrapper.activations and float(wrapper.range_seen.value) == 0:
            wrapper.output_min.assign(-6.0)
            wrapper.output_max.assign(6.0)
            wrapper.range_seen.assign(1.0)
    return model


def quantize_annotate_layer(to_annotate, quantize_config=None):
    """tfmot's `quantize_annotate_layer` (see `kdist.sparsity.quantize_annotate_layer`)."""
    real = _real(to_annotate)
    if real is not None:
        return real.quantization.keras.quantize_annotate_layer(to_annotate, quantize_config)
    if not isinstance(to_annotate, keras.layers.Layer) or isinstance(to_annotate, keras.Model):
        raise ValueError("`to_annotate` can only be a Keras layer; got "
                         f"{type(to_annotate).__name__}. Use quantize_annotate_model for a "
                         "model.")
    if quantize_config is not None and not isinstance(quantize_config,
                                                      _configured.QuantizeConfig):
        raise ValueError("`quantize_config` can only be a "
                         "tfmot.quantization.keras.QuantizeConfig instance; got "
                         f"{type(quantize_config).__name__}.")
    return _annotation.quantize_annotate_layer(to_annotate, quantize_config)


def quantize_annotate_model(to_annotate):
    """tfmot's `quantize_annotate_model` (see `kdist.sparsity.quantize_annotate_model`)."""
    real = _real(to_annotate)
    if real is not None:
        return real.quantization.keras.quantize_annotate_model(to_annotate)
    _check_eager("quantize_annotate_model")
    _check_model(to_annotate, "to_annotate", " Use quantize_annotate_layer for a layer.")
    _check_flat(to_annotate, "to_annotate")
    return _uncompiled(_annotation.quantize_annotate_model(to_annotate))


def quantize_apply(model, scheme=None, quantized_layer_name_prefix="quant_"):
    """tfmot's `quantize_apply`: the marked layers of `model` trained in 8 bits.

    For Keras 3 models `scheme` is left out or is one of the two names of
    kdist's one scheme, `quantization.keras.default_8bit.Default8BitQuantizeScheme()`
    and `experimental.combine.Default8BitPrunePreserveQuantizeScheme()`: 8-bit
    symmetric per-channel kernels that keep a pruned kernel's zeros. As tfmot's
    scheme does, it also quantises the output of an unmarked layer that is the one
    input of a marked layer (its weights stay float), and puts a `quantize_layer`
    after each input that a quantised layer reads.

    Raises:
        ValueError: another scheme; `model` is None, not a Sequential or
            functional model, or not built; a custom layer marked without a
            `QuantizeConfig` whose class Keras does not know.
        RuntimeError: a custom layer marked without a `QuantizeConfig` whose class
            Keras knows, or a MultiHeadAttention without one; called inside a
            TF1-style graph.
    """
    real = _real(model)
    if real is not None:
        options = {} if scheme is None else {"scheme": _tfmot_scheme(scheme)}
        return real.quantization.keras.quantize_apply(
            model, quantized_layer_name_prefix=quantized_layer_name_prefix, **options)
    _check_eager("quantize_apply")
    _check_model(model, "model")
    _check_built(model, "model")
    if scheme is not None and not isinstance(scheme, _KdistScheme):
        raise ValueError(
            f"quantize_apply: kdist does not offer the scheme {type(scheme).__name__} for "
            "Keras 3 models. It has one scheme (8-bit symmetric per-channel weights that keep "
            "their zeros, moving-average output ranges), named as tfmot names it: "
            "quantization.keras.default_8bit.Default8BitQuantizeScheme() or "
            "experimental.combine.Default8BitPrunePreserveQuantizeScheme(), or leave scheme "
            "out. Give a layer other quantizers with quantize_annotate_layer(layer, "
            "quantize_config).")
    _check_quantizable(_wrapping.wrappers_in(model, _annotation.QuantizeAnnotate))
    return _ranges_from_six(_inputs.quantize_inputs(
        _annotation.quantize_apply(_with_tfmot_configs(model),
                                   name_prefix=quantized_layer_name_prefix),
        only_before_quantized=True))


class _KdistScheme:
    # tfmot's 8-bit schemes, under their names: for a Keras 3 model each is
    # kdist's one scheme; for a tf_keras model, tfmot's own class of that name.
    _path = ""

    def __repr__(self):
        return f"{type(self).__name__}()"


class Default8BitQuantizeScheme(_KdistScheme):
    """tfmot's default 8-bit scheme: for Keras 3 models, kdist's scheme (8-bit symmetric
    per-channel kernels that keep their zeros, moving-average output ranges)."""

    _path = "quantization.keras.default_8bit"

    def __init__(self, disable_per_axis=False):
        if disable_per_axis:
            raise ValueError(
                "Default8BitQuantizeScheme(disable_per_axis=True): kdist's scheme quantises "
                "kernels per output channel only; for one scale per kernel, use "
                "kdist.sparsity.quantize(model, per_channel=False).")


class Default8BitPrunePreserveQuantizeScheme(_KdistScheme):
    """tfmot's pruning-preserving 8-bit scheme: kdist's scheme, which keeps a pruned
    kernel's zeros through quantization-aware training."""

    _path = "experimental.combine"


def _tfmot_scheme(scheme):
    """tfmot's own scheme for one of kdist's names, handed on with a tf_keras model."""
    if isinstance(scheme, _KdistScheme):
        return _from_tfmot(scheme._path, type(scheme).__name__)()
    return scheme


class UpdatePruningStep(_sparsity.UpdatePruning):
    """tfmot's `UpdatePruningStep` (see `kdist.sparsity.UpdatePruning`).

    As in tfmot, a model with no pruned layer trains with it as without it;
    kdist's own callback refuses such a model, which is more often a
    mistake than not. Also as in tfmot, schedules count the first batch as
    step 1: `ConstantSparsity(0.5, 0, frequency=100)` prunes on the 100th
    batch, and `PolynomialDecay(..., begin_step=1)` prunes on the first;
    and an m-by-n pattern (`sparsity_m_by_n`) is set once, at step 1,
    whatever the schedule. kdist's own callback counts the first batch as
    step 0 and sets patterns on the schedule's turns.
    """

    _first_step = 1

    def _turns(self, wrapper, steps):
        if getattr(wrapper, "sparsity_m_by_n", None) is not None:
            return [s for s in steps if s == 1]
        return super()._turns(wrapper, steps)

    def __init__(self, log_sparsity=True):
        super().__init__(log_sparsity)
        self._idle = False

    def on_train_begin(self, logs=None):
        self._idle = (not _bridge.is_tf_keras(self.model)
                      and not _sparsity.pruned_layers(self.model))
        if not self._idle:
            super().on_train_begin(logs)

    def on_train_batch_begin(self, batch, logs=None):
        if not self._idle:
            super().on_train_batch_begin(batch, logs)

    def on_epoch_end(self, epoch=-1, logs=None, batch=None):
        if not self._idle:
            super().on_epoch_end(epoch, logs, batch)


class PruningSummaries(_keras_private.AnswersTfKeras, _sparsity.PruningSummaries):
    """tfmot's `PruningSummaries` (see `kdist.sparsity.PruningSummaries`); for a
    tf_keras model, tfmot's own callback does the writing."""

    def __init__(self, log_dir, update_freq="epoch", **kwargs):
        super().__init__(log_dir, update_freq=update_freq, **kwargs)
        self._arguments = dict(log_dir=log_dir, update_freq=update_freq, **kwargs)
        self._delegate = None

    def set_model(self, model):
        real = _real(model)
        if real is None:
            return super().set_model(model)
        self._delegate = real.sparsity.keras.PruningSummaries(**self._arguments)
        self._delegate.set_model(model)

    def calls_batch_hooks(self, mode):
        """tfmot's callback's answer for a tf_keras model; True before there is one."""
        if self._delegate is not None:
            return _keras_private.calls_batch_hooks(self._delegate, mode)
        return True


def _forward(name):
    own = getattr(_sparsity.PruningSummaries, name, None)

    def hook(self, *args, **kwargs):
        if self._delegate is not None:
            return getattr(self._delegate, name)(*args, **kwargs)
        return own(self, *args, **kwargs) if own is not None else True

    hook.__name__ = name
    return hook


for _hook in ("set_params", "on_train_begin", "on_train_end", "on_epoch_begin", "on_epoch_end",
              "on_test_begin", "on_test_end", "on_predict_begin", "on_predict_end",
              "on_train_batch_begin", "on_train_batch_end", "on_test_batch_begin",
              "on_test_batch_end", "on_predict_batch_begin", "on_predict_batch_end"):
    setattr(PruningSummaries, _hook, _forward(_hook))


def _from_tfmot(path, name):
    """`name` under `path` in tensorflow-model-optimization, for what kdist does not offer."""
    if name.startswith("__"):
        raise AttributeError(name)
    try:
        found = _bridge.tfmot()
    except ImportError:
        raise AttributeError(
            f"kdist.tfmot{path and '.' + path}.{name}: kdist does not offer it for Keras 3 "
            "models; tf_keras models get it from tensorflow-model-optimization, which is not "
            "installed (extra 'tfmot').") from None
    for part in [p for p in path.split(".") if p] + [name]:
        found = getattr(found, part)
    return found


def __getattr__(name):
    return _from_tfmot("", name)


def _namespace(name, doc, **members):
    module = types.ModuleType(f"{__name__}.{name}", doc)
    module.__dict__.update(members)
    # Names kdist does not offer (tfmot's custom quantizers, clustering) come from
    # tfmot itself; they work on tf_keras models only.
    module.__getattr__ = lambda attribute: _from_tfmot(name, attribute)
    module.__all__ = sorted(k for k in members if not isinstance(members[k], types.ModuleType))
    sys.modules[module.__name__] = module
    return module


sparsity = _namespace("sparsity", "tfmot.sparsity over kdist.sparsity.", keras=_namespace(
    "sparsity.keras", "tfmot.sparsity.keras over kdist.sparsity.",
    prune_low_magnitude=prune_low_magnitude,
    prune_scope=prune_scope,
    strip_pruning=strip_pruning,
    PrunableLayer=_sparsity.PrunableLayer,
    PruningSchedule=_sparsity.PruningSchedule,
    ConstantSparsity=_sparsity.ConstantSparsity,
    PolynomialDecay=_sparsity.PolynomialDecay,
    UpdatePruningStep=UpdatePruningStep,
    PruningSummaries=PruningSummaries))

class _EitherQuantizeWrapper(type(_configured.QuantizeWithConfig)):
    # tfmot has one wrapper class for every quantised layer; kdist has two (its
    # own scheme's and a QuantizeConfig's), and tfmot's name answers for both.
    def __instancecheck__(cls, instance):
        return isinstance(instance, (_configured.QuantizeWithConfig, _sparsity.QuantizeAware))

    def __subclasscheck__(cls, subclass):
        return issubclass(subclass, (_configured.QuantizeWithConfig, _sparsity.QuantizeAware))


@keras.saving.register_keras_serializable(package="kdist.tfmot")
class QuantizeWrapper(_configured.QuantizeWithConfig, metaclass=_EitherQuantizeWrapper):
    """tfmot's `QuantizeWrapper(layer, quantize_config)`: a `QuantizeWithConfig`.

    `isinstance(layer, QuantizeWrapper)` is true of every quantised layer,
    `quantize_model`'s `QuantizeAware` ones included.
    """


class Default8BitQuantizeRegistry(_registry.QuantizeRegistry):
    """tfmot's default 8-bit registry: `kdist.sparsity.QuantizeRegistry`'s configs for
    Keras 3 layers; a tf_keras layer gets tensorflow-model-optimization's own answer."""

    def supports(self, layer):
        if _bridge.is_tf_keras(layer):
            return self._real().supports(layer)
        return super().supports(layer)

    def get_quantize_config(self, layer):
        if _bridge.is_tf_keras(layer):
            return self._real().get_quantize_config(layer)
        return super().get_quantize_config(layer)

    def _real(self):
        return _bridge.tfmot().quantization.keras.default_8bit.Default8BitQuantizeRegistry()


quantization = _namespace("quantization", "tfmot.quantization over kdist.sparsity.",
                          keras=_namespace(
    "quantization.keras", "tfmot.quantization.keras over kdist.sparsity.",
    quantize_model=quantize_model,
    quantize_annotate_layer=quantize_annotate_layer,
    quantize_annotate_model=quantize_annotate_model,
    quantize_apply=quantize_apply,
    quantize_scope=quantize_scope,
    QuantizeConfig=_configured.QuantizeConfig,
    fix_input_output_range=_inputs.fix_input_output_range,
    remove_input_range=_inputs.remove_input_range,
    # What quantize_apply wraps layers in, under tfmot's two names for it.
    QuantizeWrapper=QuantizeWrapper,
    QuantizeWrapperV2=QuantizeWrapper,
    default_8bit=_namespace(
        "quantization.keras.default_8bit", "tfmot's default 8-bit scheme's registry over "
        "kdist.sparsity.QuantizeRegistry.",
        Default8BitQuantizeRegistry=Default8BitQuantizeRegistry,
        Default8BitQuantizeScheme=Default8BitQuantizeScheme),
    quantizers=_namespace(
        "quantization.keras.quantizers", "tfmot.quantization.keras.quantizers over "
        "kdist.sparsity.quantizers.",
        Quantizer=_quantizers.Quantizer,
        LastValueQuantizer=_quantizers.LastValueQuantizer,
        MovingAverageQuantizer=_quantizers.MovingAverageQuantizer,
        AllValuesQuantizer=_quantizers.AllValuesQuantizer,
        FixedQuantizer=_quantizers.FixedQuantizer)))
experimental = _namespace("experimental", "tfmot.experimental over kdist.sparsity.",
                          combine=_namespace(
    "experimental.combine", "tfmot's collaborative-optimization schemes: for Keras 3 models, "
    "kdist's scheme, which keeps the zeros of a pruned model.",
    Default8BitPrunePreserveQuantizeScheme=Default8BitPrunePreserveQuantizeScheme))
