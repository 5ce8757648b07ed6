"""Where the ranks of a `fit` meet at an epoch's end, whatever order callbacks run in."""

import weakref

from kdist.comm import collectives, joining, processes, protocol
from kdist.coordination import model_state, team

_joined = weakref.WeakKeyDictionary()  # model -> the last epoch it joined at
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
    if processes.size() == 1 or team.independent(model):
        return
    if _joined.get(model) == epoch:
        return
    # The ranks that train this model: its kdist optimizer's (a search's team, a
    # process set), else the caller's, else the whole job.
    core = team.distributed_core(model)
    comm = getattr(core, "comm", None) or comm or processes.world()
    last, anyone_fell_behind = joining.join_and_tell(comm)
    if anyone_fell_behind:
        local = model_state.local_ids(model)
        shared = [v for v in model_state.model_state(model) if id(v) not in local]
        collectives.broadcast_variables(shared, root_rank=last, comm=comm)
    _joined[model] = epoch


def forget(model):
    """Starts `model`'s epoch count again (a new `fit`)."""
    _joined.pop(model, None)
    _averaged.pop(model, None)


def mark_averaged(model, epoch):
    """Records that `model`'s logs of `epoch` hold the average over its ranks."""
    _averaged[model] = epoch


def averaged(model, epoch):
    """Whether `model`'s logs of `epoch` were averaged already."""
    return _averaged.get(model) == epoch


def note_ending(model, last_epoch, epochs, stopper=None):
    """Keeps one line on how this rank's `fit` of `model` ended (`last_epoch` counted from
    0, None before the first epoch ended), for the report should the rank leave the job
    while others still wait for it. `stopper`: who set `stop_training`, if known."""
    last = 0 if last_epoch is None else last_epoch + 1
    of = f" of {epochs}" if epochs else ""
    if getattr(model, "stop_training", False):
        protocol.set_note(f"its last fit stopped after epoch {last}{of}: "
                          f"{stopper or 'a callback'} set stop_training")
    else:
        protocol.set_note(f"its last fit ran to epoch {last}{of}")
