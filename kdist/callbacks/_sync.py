"""Keeps ranks in step at epoch boundaries, whatever order callbacks run in."""

from kdist.comm import collectives, fusion
from kdist.comm import processes

_joined = {}
_local = {}  # id(model) -> ids of the variables each rank keeps to itself


def join_once(model, epoch):
    """Runs `kdist.join()` once per model and epoch before any epoch-end collective.

    A rank that ran out of batches first reaches the end of the epoch; joining
    there lets it feed zeros into the other ranks' remaining gradient steps
    instead of starting a collective they are not ready for. Every kdist
    callback with an epoch-end collective calls this first; the first call in
    an epoch does the work. Ranks that fed zeros missed updates, so the
    model and optimizer state are then copied from the rank that joined last.
    """
    if processes.size() == 1:
        return
    key = id(model)
    if _joined.get(key) == epoch:
        return
    last, anyone_fell_behind = fusion.join_and_tell()
    if anyone_fell_behind:
        from kdist.callbacks.broadcast import model_state

        local = _local.get(key, ())
        shared = [v for v in model_state(model) if id(v) not in local]
        collectives.broadcast_variables(shared, root_rank=last)
    _joined[key] = epoch


def forget(model):
    _joined.pop(id(model), None)


def keep_local(model, variables):
    """Leaves `variables` out when the model is copied from the last rank to join."""
    _local[id(model)] = {id(v) for v in variables}
