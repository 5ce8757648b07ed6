"""Cutting a model into pipeline stages, and numbering their layers across stages."""

import keras


def split(model, cuts):
    """Cuts a `keras.Sequential` model into consecutive stages.

    Args:
        model: a built `keras.Sequential` (give it an `Input`).
        cuts: where each stage after the first begins: layer indices into
            `model.layers`, or layer names.

    Returns:
        One `keras.Sequential` per stage, sharing the model's layers (and so
            its weights).

    Raises:
        TypeError: `model` is not a `keras.Sequential`.
        ValueError: the model is not built; a cut names no layer, or the cuts
            are not increasing positions between 1 and the number of layers - 1.

    >>> import keras
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8),
    ...                           keras.layers.Dense(8), keras.layers.Dense(2)])
    >>> first, second = split(model, [1])
    >>> len(first.layers), len(second.layers)
    (1, 2)
    """
    if not isinstance(model, keras.Sequential):
        raise TypeError("split() cuts keras.Sequential models; for another model, build one "
                        f"keras.Model per stage and pass the list (got {type(model).__name__}).")
    if not model.built:
        raise ValueError("Build the model before cutting it: start it with keras.Input(shape).")
    layers = model.layers
    names = [layer.name for layer in layers]
    positions = []
    for cut in cuts:
        if isinstance(cut, str):
            if cut not in names:
                raise ValueError(f"No layer is named {cut!r}; the layers are {names}.")
            cut = names.index(cut)
        positions.append(int(cut))
    if positions != sorted(set(positions)) or not all(0 < p < len(layers) for p in positions):
        raise ValueError(f"Cuts must be increasing layer positions between 1 and "
                         f"{len(layers) - 1} (the model has {len(layers)} layers); got "
                         f"{list(cuts)}.")
    bounds = [0] + positions + [len(layers)]
    stages = []
    shape = model.inputs[0].shape[1:]
    dtype = model.inputs[0].dtype
    for index, (start, stop) in enumerate(zip(bounds, bounds[1:])):
        stage = keras.Sequential([keras.Input(shape, dtype=dtype)] + layers[start:stop],
                                 name=f"{model.name}_stage_{index}")
        shape, dtype = stage.outputs[0].shape[1:], stage.outputs[0].dtype
        stages.append(stage)
    return stages


def build_stage(stage, index, tensor_group=None):
    """The stage's model: `stage` itself, or what a builder function returns.

    With a `tensor_group` (the `Communicator` of the ranks that split the stage),
    a builder is called with it, to pass to its tensor-parallel layers' `group`.
    """
    if callable(stage) and not isinstance(stage, keras.Model):
        stage = stage() if tensor_group is None else stage(tensor_group)
    elif tensor_group is not None:
        raise TypeError(f"Stage {index} is split over {tensor_group.size} ranks: give a "
                        "function that takes the group and builds the stage with "
                        "tensor-parallel layers over it, not a built model.")
    if not isinstance(stage, keras.Model):
        raise TypeError(f"Stage {index} must be a keras.Model or a function that builds one; "
                        f"got {type(stage).__name__}.")
    if not stage.built:
        raise ValueError(f"Stage {index} ({stage.name}) is not built; start it with "
                         "keras.Input(shape) so that its weights exist before training.")
    return stage


def weighted_layers(model):
    """The layers of `model` that own weights, in order, descending into nested models."""
    found = []
    for layer in model.layers:
        if isinstance(layer, keras.Model):
            found += weighted_layers(layer)
        elif layer.weights:
            found.append(layer)
    return found
