"""Keeps ranks in step at epoch boundaries, whatever order callbacks run in."""

import weakref

import keras

from kdist.comm import collectives, joining
from kdist.comm import processes

_joined = weakref.WeakKeyDictionary()  # model -> the last epoch it joined at
_local = weakref.WeakKeyDictionary()  # model -> ids of the variables each rank keeps to itself
_independent = weakref.WeakSet()  # models whose steps hold no collective (gossip replicas)
_averaged = weakref.WeakKeyDictionary()  # model -> the last epoch whose logs were averaged


def join_once(model, epoch, comm=None):
    """Runs `kdist.join()` once per model and epoch before any epoch-end collective.

    A rank that ran out of batches first reaches the end of the epoch; joining
    there lets it feed zeros into the other ranks' remaining gradient steps
    instead of starting a collective they are not ready for. Every kdist
    callback with an epoch-end collective calls this first; the first call in
    an epoch does the work. Ranks that fed zeros missed updates, so the
    model and optimizer state are then copied from the rank that joined last.
    `comm`: the ranks that run the calling callback, for a model whose optimizer
    does not say which ranks train it (a callback built for a process set).
    """
    if processes.size() == 1 or model in _independent:
        return
    if _joined.get(model) == epoch:
        return
    # The ranks that train this model: its kdist optimizer's (a search's team, a
    # process set), else the caller's, else the whole job.
    core = distributed_core(model)
    comm = getattr(core, "comm", None) or comm or processes.world()
    last, anyone_fell_behind = joining.join_and_tell(comm)
    if anyone_fell_behind:
        local = _local.get(model, ())
        shared = [v for v in model_state(model) if id(v) not in local]
        collectives.broadcast_variables(shared, root_rank=last, comm=comm)
    _joined[model] = epoch


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


def steps_independently(model, independent=True):
    """Marks `model` as trained by steps without collectives, where no rank can be left
    inside a step's collective and joining (a collective of its own, which would hold
    every rank to the slowest once per epoch) has nothing to do."""
    if independent:
        _independent.add(model)
    else:
        _independent.discard(model)


def forget(model):
    _joined.pop(model, None)
    _averaged.pop(model, None)


def comm_of(model):
    """The communicator of the ranks that train `model` together: its kdist optimizer's
    (a search's team, a process set), its `MPIStrategy`'s, else the world."""
    for optimizer in _optimizers(model):
        core = reducing_core(optimizer)
        if core is not None and getattr(core, "comm", None) is not None:
            return core.comm
    strategy_comm = getattr(_strategy(model), "comm", None)
    return strategy_comm if strategy_comm is not None else processes.world()


def trained_together(model):
    """Whether `model` is trained by several ranks in step: its optimizer (or one of a
    GAN's) reduces through kdist, or its strategy is kdist's `MPIStrategy`."""
    if any(reducing_core(o) is not None for o in _optimizers(model)):
        return True
    return _strategy(model) is not None


def _optimizers(model):
    optimizers = getattr(model, "optimizers", None)
    if isinstance(optimizers, (list, tuple)):
        return list(optimizers)
    optimizer = getattr(model, "optimizer", None)
    return [] if optimizer is None else [optimizer]


def _strategy(model):
    """`model`'s strategy when it is kdist's `MPIStrategy`, else None."""
    from kdist.distribute.mpi_strategy import MPIStrategy

    try:
        strategy = model.distribute_strategy
    except (AttributeError, ValueError):
        return None
    return strategy if isinstance(strategy, MPIStrategy) else None


def mark_averaged(model, epoch):
    """Records that `model`'s logs of `epoch` hold the average over its ranks."""
    _averaged[model] = epoch


def averaged(model, epoch):
    return _averaged.get(model) == epoch


def keep_local(model, variables):
    """Leaves `variables` out when the model is copied from the last rank to join."""
    _local[model] = {id(v) for v in variables}


def built(model):
    """Whether `model` has its variables (a model without `Input` gets them in its first step)."""
    return bool(model.built and model.variables)


def distributed_core(model):
    """The kdist optimizer inside `model`'s optimizer (wrappers unwrapped), or None."""
    return reducing_core(getattr(model, "optimizer", None))


def reducing_core(optimizer):
    """The kdist optimizer that reduces gradients inside `optimizer`, or None."""
    while optimizer is not None:
        if getattr(optimizer, "reduces_gradients", False):
            return optimizer
        optimizer = getattr(optimizer, "inner_optimizer", None)
    return None
