"""Which ranks train a model together, asked of the model's own objects.

A model is trained in step by several ranks when one of its optimizers
reduces gradients through kdist (it says so with `reduces_gradients = True`)
or when its distribution strategy is one whose replicas are kdist ranks (it
says so with `kdist_replicas_in_step = True` and a `comm`). Both are markers
that kdist's own classes carry, so this layer needs no class from above.
"""

import logging
import weakref

from kdist.comm import processes

logger = logging.getLogger(__name__)

# Models trained by steps without collectives (gossip replicas): no rank can be
# left inside a step's collective, so there is nothing to join at an epoch's end.
_independent = weakref.WeakSet()
# kdist optimizers whose fit runs under kdist.callbacks.Agreement (it says who saves).
_agreed = weakref.WeakSet()
_advised = False  # the advice on saving is given once per process


def optimizers_of(model):
    """`model`'s optimizers: its `optimizers` list (a GAN's), else its `optimizer`."""
    optimizers = getattr(model, "optimizers", None)
    if isinstance(optimizers, (list, tuple)):
        return list(optimizers)
    optimizer = getattr(model, "optimizer", None)
    return [] if optimizer is None else [optimizer]


def reducing_core(optimizer):
    """The kdist optimizer that reduces gradients inside `optimizer`, or None."""
    while optimizer is not None:
        if getattr(optimizer, "reduces_gradients", False):
            return optimizer
        optimizer = getattr(optimizer, "inner_optimizer", None)
    return None


def distributed_core(model):
    """The kdist optimizer inside `model`'s optimizer (wrappers unwrapped), or None."""
    return reducing_core(getattr(model, "optimizer", None))


def strategy_in_step(model):
    """`model`'s strategy when its replicas are kdist ranks trained in step, else None."""
    try:
        strategy = model.distribute_strategy
    except (AttributeError, ValueError):
        return None
    return strategy if getattr(strategy, "kdist_replicas_in_step", False) else None


def trained_together(model):
    """Whether several ranks train `model` in step through kdist: one of its optimizers
    reduces through kdist, or its strategy's replicas are kdist ranks."""
    if any(reducing_core(o) is not None for o in optimizers_of(model)):
        return True
    return strategy_in_step(model) is not None


def comm_of(model):
    """The communicator of the ranks that train `model` together: its kdist optimizer's
    (a search's team, a process set), its strategy's, else the world."""
    for optimizer in optimizers_of(model):
        core = reducing_core(optimizer)
        if core is not None and getattr(core, "comm", None) is not None:
            return core.comm
    strategy_comm = getattr(strategy_in_step(model), "comm", None)
    return strategy_comm if strategy_comm is not None else processes.world()


def steps_independently(model, independent=True):
    """Marks `model` as trained by steps without collectives, where no rank can be left
    inside a step's collective and joining (a collective of its own, which would hold
    every rank to the slowest once per epoch) has nothing to do."""
    if independent:
        _independent.add(model)
    else:
        _independent.discard(model)


def independent(model):
    """Whether `model`'s ranks train apart (see `steps_independently`)."""
    return model in _independent


def under_agreement(model):
    """Records that `model`'s fit runs with `kdist.callbacks.Agreement`'s callbacks."""
    for optimizer in optimizers_of(model):
        core = reducing_core(optimizer)
        if core is not None:
            _agreed.add(core)


def advise_on_saving(core):
    """Once per job, on rank 1: says how to save once when ranks other than 0 save a model
    that the whole job trains together without the agreement (which would tell them who
    writes). A model of a smaller team (a search's trial, a process set) is left alone:
    such teams' ranks keep files apart themselves."""
    global _advised
    comm = getattr(core, "comm", None)
    if _advised or comm is None or comm.size < 2 or comm.rank != 1 or core in _agreed \
            or comm.size != processes.size():
        return
    _advised = True
    logger.warning(
        "kdist: rank 1 saves a model that %d ranks train together. If every rank saves to "
        "the same path, the ranks write one file at once and can leave it broken: save on "
        "rank 0 only (if kdist.rank() == 0), or pass fit's callbacks through "
        "kdist.callbacks.Agreement().around([...]), which lets one rank write each file.",
        comm.size)
