"""Per-rank compute resources: CPU threads and one accelerator per local rank."""

import logging
import os

logger = logging.getLogger(__name__)

# Variables through which a user already chose TensorFlow's thread counts.
_THREAD_VARIABLES = ("TF_NUM_INTRAOP_THREADS", "OMP_NUM_THREADS")


def cores_on_node():
    """CPU cores this node offers the job (all of them, not this rank's binding)."""
    return os.cpu_count() or 1


def allowed_cores():
    """The cores this process may run on (its binding, or the job's cpuset)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(cores_on_node()))


def user_threads(environ=None):
    """The thread count the user chose through the environment, or None."""
    environ = os.environ if environ is None else environ
    for name in _THREAD_VARIABLES:
        value = environ.get(name, "").strip()
        if value.isdigit() and int(value) > 0:
            return int(value)
    return None


def intra_op_threads(local_core_sets, environ=None, local_rank=0):
    """The intra-op thread count `kdist.init()` gives a rank.

    A positive integer in `TF_NUM_INTRAOP_THREADS`, or else in `OMP_NUM_THREADS`, wins.
    Otherwise ranks bound to disjoint cores use all of theirs, and ranks whose cores
    overlap (no binding, or a job's cpuset) split the cores they can use evenly, at
    least 1 each.

    Args:
        local_core_sets: the cores each rank on this node may run on, one list of core
            numbers per local rank; `init` gathers each rank's `allowed_cores()`, its
            CPU affinity.
        environ: the environment to read; `os.environ` by default.
        local_rank: this rank's index in `local_core_sets`.

    >>> intra_op_threads([[0, 1], [2, 3, 4]], environ={}, local_rank=1)
    3
    >>> intra_op_threads([[0, 1, 2, 3], [0, 1, 2, 3]], environ={})
    2
    """
    chosen = user_threads(environ)
    if chosen is not None:
        return chosen
    sets = [set(cores) for cores in local_core_sets]
    union = set().union(*sets)
    if sum(len(cores) for cores in sets) == len(union):
        return max(1, len(sets[local_rank]))
    return max(1, len(union) // len(sets))


def configure(local, ask_others=True):
    """Gives this rank its share of the node's cores and its own GPU, if any.

    Collective over `local` unless `ask_others` is False: then this rank takes
    the others on its node to be allowed the cores it is allowed.
    """
    import tensorflow as tf

    local_rank, local_size = local.rank, local.size
    if local_size > 1 or user_threads() is not None:
        mine = allowed_cores()
        core_sets = (local.allgather_object(mine) if ask_others
                     else [mine] * local_size)
        threads = intra_op_threads(core_sets, local_rank=local_rank)
        try:
            if tf.config.threading.get_intra_op_parallelism_threads() == 0:
                tf.config.threading.set_intra_op_parallelism_threads(threads)
            if tf.config.threading.get_inter_op_parallelism_threads() == 0:
                tf.config.threading.set_inter_op_parallelism_threads(min(2, threads))
            logger.debug("using %d intra-op threads per rank", threads)
        except RuntimeError:
            logger.warning(
                "TensorFlow was already running when kdist.init() was called, so kdist "
                "could not give each of the %d ranks on this node its share of the cores. "
                "Call kdist.init() before building models.", local_size)
    try:
        gpus = tf.config.list_physical_devices("GPU")
    except RuntimeError:
        return
    if not gpus:
        return
    try:
        if local_size > 1:
            mine = gpus[local_rank % len(gpus)]
            tf.config.set_visible_devices(mine, "GPU")
            gpus = [mine]
        for gpu in gpus:
            tf.config.experimental.set_memory_growth(gpu, True)
    except RuntimeError:
        logger.warning("TensorFlow already started on its devices; kdist could not pin "
                       "local rank %d to one GPU. Call kdist.init() first.", local_rank)
