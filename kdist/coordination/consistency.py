"""Every rank trains the same model: deferred broadcasts and a first-step check.

Keras builds a model that has no `Input` (and most subclassed models) only
when the first train step is traced, after callbacks' `on_train_begin`. A
broadcast that runs there finds nothing to send. kdist therefore lets
callbacks defer work until the variables exist: the first time a kdist
optimizer applies gradients with initialised variables (while that step is
being traced, before it first runs), it runs the deferred work and then
checks that every rank holds the same values: where they differ (no broadcast
ran, as in Horovod's elastic example, which syncs only later), rank 0's values
are broadcast with a warning, so that ranks never train on from different
starting points.
"""

import hashlib
import logging
import weakref

import numpy as np
import tensorflow as tf

from kdist.comm import collectives, processes

logger = logging.getLogger(__name__)

_hooks = weakref.WeakKeyDictionary()  # optimizer -> callables to run before its first update
_excluded = weakref.WeakKeyDictionary()  # optimizer -> ids of variables ranks keep to themselves
# optimizer -> the world generation it was checked in: an elastic job that
# lost or gained ranks checks again, on every rank, the newcomers included.
_checked = weakref.WeakKeyDictionary()


def before_first_update(optimizer, hook):
    """Runs `hook()` the first time `optimizer` applies gradients (variables then exist)."""
    _hooks.setdefault(optimizer, []).append(hook)


def exclude(optimizer, variables):
    """Leaves `variables` (each rank's own, by design) out of `optimizer`'s first-step check."""
    _excluded.setdefault(optimizer, set()).update(id(v) for v in variables)


def excluded(optimizer):
    """Ids of the variables left out of `optimizer`'s first-step check (see `exclude`)."""
    return set(_excluded.get(optimizer, ()))


def initialized(variables):
    """Whether every variable holds a value (not so in the first trace that creates them)."""
    with tf.init_scope():
        for v in variables:
            handle = getattr(v, "handle", None)
            if handle is None:
                continue
            if not bool(tf.raw_ops.VarIsInitializedOp(resource=handle)):
                return False
    return True


def first_update(optimizer, variables, comm):
    """Runs `optimizer`'s deferred hooks, then checks that ranks agree, once.

    Called from the optimizer's `apply`; returns quietly while the variables
    are not initialised yet (TensorFlow then traces the step again).
    """
    if _checked.get(optimizer) == processes.world_generation():
        return
    excluded = _excluded.get(optimizer, ())
    variables = [v for v in variables if id(v) not in excluded]
    if not initialized(variables):
        return
    with tf.init_scope():
        for hook in _hooks.pop(optimizer, []):
            hook()
        if comm.size > 1:
            differing = first_difference(variables, comm)
            if differing is not None:
                # Horovod lets ranks train apart until something broadcasts (its elastic
                # example syncs only once its state exists); kdist starts them together.
                rank, name = differing
                if comm.rank == 0:
                    logger.warning(
                        "Rank %d held other values of '%s' than rank 0 at the first update "
                        "(no broadcast ran before it); every rank now starts from rank 0's "
                        "weights. Add kdist.callbacks.BroadcastGlobalVariablesCallback(0) to "
                        "fit's callbacks, or call kdist.broadcast_variables(model.variables, "
                        "root_rank=0) once the model is built, to say so.", rank, name)
                collectives.broadcast_variables(variables, root_rank=0, comm=comm)
    _checked[optimizer] = processes.world_generation()


def fingerprint(v):
    array = np.ascontiguousarray(v.numpy() if hasattr(v, "numpy") else np.asarray(v))
    return hashlib.blake2b(array.tobytes(), digest_size=8).hexdigest()


def first_difference(variables, comm, values=True):
    """`(rank, variable name)` of the first variable some rank holds with other values than
    rank 0 (with `values`), or None. Collective. Raises `ValueError` on every rank when
    the names, shapes or dtypes differ: no broadcast can mend that."""
    variables = list(variables)
    signature = [(collectives.variable_name(v), tuple(v.shape),
                  np.dtype(getattr(v.dtype, "as_numpy_dtype", v.dtype)).str) for v in variables]
    digests = [fingerprint(v) for v in variables] if values else []
    everyone = comm.allgather_object((signature, digests))
    collectives.compare_signatures([s for s, _ in everyone], 0, what="in the model")
    for rank, (_, theirs) in enumerate(everyone):
        for index, (mine, root) in enumerate(zip(theirs, everyone[0][1])):
            if mine != root:
                return rank, signature[index][0]
    return None


def check_identical(variables, comm, advice="", values=True):
    """Raises `ValueError` on every rank when ranks hold different variables.

    Compares names, shapes and dtypes (and, with `values`, the values) with
    rank 0's and names the first variable that differs.
    """
    differing = first_difference(variables, comm, values)
    if differing is not None:
        rank, name = differing
        raise ValueError(f"Rank {rank} holds other values of '{name}' than rank 0: "
                         f"the ranks would train from different weights. {advice}".rstrip())
