"""The variables that define a model in training, and digests to compare them across ranks."""

import hashlib
import weakref

import keras
import numpy as np

from kdist.comm import collectives
from kdist.coordination import consistency, team

_local = weakref.WeakKeyDictionary()  # model -> ids of the variables each rank keeps to itself


def model_state(model):
    """The variables that define a model in training: its own and its optimizers'.

    A model with several optimizers (`kdist.gan.GAN`) lists them in an
    `optimizers` attribute. Without a distribution strategy Keras builds the
    optimizer only when it traces the first train step, after
    `on_train_begin`; it is built here so that its state can be broadcast and
    restored before the first step.
    """
    variables = list(model.variables)
    optimizers = getattr(model, "optimizers", None)
    if optimizers is None:
        optimizer = getattr(model, "optimizer", None)
        optimizers = [] if optimizer is None else [optimizer]
        if optimizers and not optimizer.built and model.built and model.trainable_variables:
            # In the optimizer's own name scope, as Keras builds it in a train step, so
            # that its variables have the same paths whoever builds it (checkpoints
            # match by path).
            with keras.name_scope(optimizer.name, caller=optimizer):
                optimizer.build(model.trainable_variables)
    for optimizer in optimizers:
        if optimizer.built:
            variables += list(optimizer.variables)
    return variables


def built(model):
    """Whether `model` has its variables (a model without `Input` gets them in its first step)."""
    return bool(model.built and model.variables)


def keep_local(model, variables):
    """Leaves `variables` out when the model is copied from one rank to the others."""
    _local[model] = {id(v) for v in variables}


def local_ids(model):
    """Ids of the variables of `model` that each rank keeps to itself (see `keep_local`)."""
    return set(_local.get(model, ()))


def learning_rates(model):
    """The current learning rate of each of `model`'s optimizers, as floats."""
    rates = []
    for optimizer in team.optimizers_of(model):
        try:
            rate = optimizer.learning_rate
        except (AttributeError, ValueError):
            continue
        rates.append(float(np.asarray(keras.ops.convert_to_numpy(rate))))
    return rates


def digest(array):
    """An exact 8-byte digest of an array's bytes (BLAKE2b): equal for equal bytes."""
    array = np.ascontiguousarray(array)
    return hashlib.blake2b(memoryview(array).cast("B"), digest_size=8).hexdigest()


def state_digests(model):
    """`[(name, digest)]` of each variable that every rank must hold identically:
    the model's trainable variables and its optimizers' variables, without those
    each rank keeps to itself. Empty for models whose ranks hold different parts
    (pipeline stages) or train apart (gossip)."""
    if getattr(model, "ranks_hold_different_weights", False) or team.independent(model):
        return []
    return [(collectives.variable_name(v), digest(v.numpy())) for v in shared_state(model)]


def shared_state(model):
    """The variables `state_digests` covers.

    Left out: variables kept local through `BroadcastGlobalVariablesCallback`
    or the optimizer's `register_local_var` (with their optimizer slots), the
    optimizer's local gradient sums, and non-trainable model variables (batch
    normalisation's moving statistics are each rank's own unless synchronised).
    """
    local = local_ids(model)
    prefixes = []
    optimizers = team.optimizers_of(model)
    for optimizer in optimizers:
        core = team.reducing_core(optimizer)
        if core is None:
            continue
        local |= consistency.excluded(core)
        ids, paths = core.local_variable_keys()
        local |= set(ids)
        for v in model.trainable_variables:
            if id(v) in ids or collectives.variable_name(v) in paths:
                local.add(id(v))
                prefixes.append(collectives.variable_name(v).replace("/", "_") + "_")
    variables = [v for v in model.trainable_variables if id(v) not in local]
    for optimizer in optimizers:
        if not getattr(optimizer, "built", False):
            continue
        for v in optimizer.variables:
            name = getattr(v, "name", "") or ""
            if id(v) in local or "gradient_accumulator" in name or \
                    any(name.startswith(p) for p in prefixes):
                continue
            variables.append(v)
    return variables
