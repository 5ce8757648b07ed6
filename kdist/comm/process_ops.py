"""Horovod's `*_op` accessors: the rank and sizes as tensors read when a graph runs.

`kdist.rank()` inside a `tf.function` is a Python number frozen into the
graph when it is traced. These return int32 tensors read from small
variables when the function runs (so they work under XLA too); the variables
follow the world when an elastic job loses or gains ranks, as Horovod's ops do.
"""

import threading

from kdist.comm import job, process_sets

# Horovod's answer when the process set id is not registered.
UNKNOWN_PROCESS_SET = -2

_lock = threading.Lock()
_variables = {}  # name -> tf.Variable
_generation = [None]


def _values():
    return {"rank": job.rank(), "size": job.size(), "local_rank": job.local_rank(),
            "local_size": job.local_size()}


def _read(name):
    import tensorflow as tf

    with tf.init_scope():
        eager = tf.executing_eagerly()
    if not eager:
        # A TensorFlow 1 graph: its session holds no variables of kdist's; the value
        # at graph construction is what such a graph can have.
        return tf.constant(_values()[name], tf.int32)
    with _lock, tf.init_scope():
        generation = job.world_generation()
        if not _variables:
            for key, value in _values().items():
                _variables[key] = tf.Variable(value, dtype=tf.int32, trainable=False,
                                              name=f"kdist_{key}")
        elif _generation[0] != generation:
            for key, value in _values().items():
                _variables[key].assign(value)
        _generation[0] = generation
        variable = _variables[name]
    return tf.identity(variable)


def forget_world():
    """The next read takes the values of the world `kdist.init()` starts next
    (`kdist.shutdown` calls this)."""
    with _lock:
        _generation[0] = None


def refresh():
    """Updates the values after the world changed (an elastic reset calls this)."""
    if _variables:
        _generation[0] = None
        _read("rank")


def rank_op(name=None):
    """This process's rank, as an int32 tensor: Horovod's accessor.

    Unlike `kdist.rank()`, which inside a `tf.function` is a Python number frozen into
    the graph when it is traced, this and the other `*_op` accessors are read when the
    function runs (also in a function compiled with XLA): they read small variables
    that follow the world when an elastic job loses or gains ranks. In a TensorFlow 1
    graph (`tf.compat.v1`, a `Session`) they are constants, taken when the graph is
    built. `name` is accepted for compatibility and has no effect.

    Example:

        >>> import kdist
        >>> int(kdist.rank_op()) == kdist.rank()
        True
    """
    return _read("rank")


def size_op(process_set_id=0, name=None):
    """The number of ranks of the job, as an int32 tensor read when the graph runs (see
    `kdist.rank_op`).

    Args:
        process_set_id: 0 for the whole job, or the id of a registered process set
            (`ProcessSet.process_set_id`) for that set's size. An id that no registered
            set has raises `ValueError`.
        name: accepted for compatibility; no effect.
    """
    if process_set_id:
        import tensorflow as tf

        return tf.constant(_process_set(process_set_id).size(), tf.int32)
    return _read("size")


def local_rank_op(name=None):
    """This process's rank among the ranks on its node, as an int32 tensor read when the
    graph runs (see `kdist.rank_op`). `name` has no effect."""
    return _read("local_rank")


def local_size_op(name=None):
    """The number of ranks on this process's node, as an int32 tensor read when the graph
    runs (see `kdist.rank_op`). `name` has no effect."""
    return _read("local_size")


def process_set_included_op(process_set_id=0, name=None):
    """Whether this process is in a process set, as an int32 tensor.

    1 if it is in the registered set with id `process_set_id` (always, for 0, the global
    set), 0 if it is not, and -2, Horovod's code for an unknown set, if no registered
    set has that id. `name` has no effect.

    Example:

        >>> import kdist
        >>> int(kdist.process_set_included_op(0)), int(kdist.process_set_included_op(99))
        (1, -2)
    """
    import tensorflow as tf

    if process_set_id == 0:
        return tf.constant(1, tf.int32)
    registered = process_sets.registered(process_set_id)
    if registered is None:
        return tf.constant(UNKNOWN_PROCESS_SET, tf.int32)
    return tf.constant(int(bool(registered.included())), tf.int32)


def _process_set(process_set_id):
    registered = process_sets.registered(process_set_id)
    if registered is None:
        raise ValueError(f"No process set has id {process_set_id}; register it with "
                         "kdist.add_process_set(...) on every rank first.")
    return registered
