"""tf_keras models go to tensorflow-model-optimization, which only knows them.

Install the `tfmot` extra (`tensorflow-model-optimization` and `tf_keras`).
kdist's schedules are translated to tfmot's, which share their semantics.
"""

import os


def is_tf_keras(obj):
    """True for tf_keras (Keras 2) models and layers; never imports tf_keras."""
    return any(cls.__module__.split(".")[0] == "tf_keras" for cls in type(obj).__mro__)


def tfmot():
    # tensorflow-model-optimization sets TF_USE_LEGACY_KERAS=1 when imported,
    # which would make `tf.keras` mean tf_keras in every process started later.
    legacy = os.environ.get("TF_USE_LEGACY_KERAS")
    try:
        import tensorflow_model_optimization as module
    except ImportError as error:
        raise ImportError(
            "This is a tf_keras model: kdist hands it to tensorflow-model-optimization, "
            "which is not installed. Install kdist's 'tfmot' extra "
            "(pip install 'kdist[tfmot]'), or build the model with Keras 3.") from error
    finally:
        if legacy is None:
            os.environ.pop("TF_USE_LEGACY_KERAS", None)
        else:
            os.environ["TF_USE_LEGACY_KERAS"] = legacy
    return module


def schedule(kdist_schedule):
    """tfmot's schedule of the same kind; a user's subclass goes as it is
    (tfmot calls it with a step tensor, as kdist's base class allows)."""
    name = type(kdist_schedule).__name__
    if type(kdist_schedule).__module__ != "kdist.sparsity.schedules":
        return kdist_schedule
    return getattr(tfmot().sparsity.keras, name)(**kdist_schedule.get_config()["config"])


def prune(model, kdist_schedule, skip, pattern):
    if skip:
        raise ValueError("skip= is not available for tf_keras models; tensorflow-model-"
                         "optimization prunes what `prune_low_magnitude` is given: wrap "
                         "the chosen layers with `tf_keras.models.clone_model`.")
    return tfmot().sparsity.keras.prune_low_magnitude(
        model, pruning_schedule=schedule(kdist_schedule), **pattern)


def strip(model):
    return tfmot().sparsity.keras.strip_pruning(model)


def quantize(model, bits, per_channel, activations):
    if bits != 8 or not per_channel or not activations:
        raise ValueError("For tf_keras models kdist uses tensorflow-model-optimization's "
                         "default scheme: 8 bits, per-channel weights, quantised activations. "
                         f"Got bits={bits}, per_channel={per_channel}, "
                         f"activations={activations}.")
    return tfmot().quantization.keras.quantize_model(model)


def update_step_callback():
    return tfmot().sparsity.keras.UpdatePruningStep()
