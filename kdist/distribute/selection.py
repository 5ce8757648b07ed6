"""`kdist.distribute.auto()`: the strategy that fits how this process was started."""

import json
import logging
import os

from kdist.comm import processes

logger = logging.getLogger(__name__)

MPI = "mpi"
MULTI_WORKER = "multi_worker"
MIRRORED = "mirrored"
DEFAULT = "default"
CHOICES = (MPI, MULTI_WORKER, MIRRORED, DEFAULT)
_ALIASES = {"tf": MULTI_WORKER, "multiworker": MULTI_WORKER, "multi-worker": MULTI_WORKER,
            "mwms": MULTI_WORKER, "one": DEFAULT, "none": DEFAULT, "allreduce": MPI,
            "horovod": MPI}


def _launcher_tasks(environ):
    """How many tasks the MPI launcher or `srun` started, as far as the environment says."""
    for name in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE",
                 "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"):
        value = environ.get(name, "")
        if value.isdigit():
            return int(value)
    return None


def _tf_config_workers(environ):
    text = environ.get("TF_CONFIG", "").strip()
    if not text:
        return 0
    try:
        cluster = json.loads(text).get("cluster", {})
    except (json.JSONDecodeError, AttributeError):
        raise ValueError(f"TF_CONFIG is set but is not a JSON object: {text!r}.") from None
    return sum(len(cluster.get(kind, [])) for kind in ("chief", "worker"))


def choose(environ=None, gpus=0):
    """The decision `auto()` makes, without building anything: `(choice, reason)`.

    In order: `KDIST_STRATEGY` if set; the multi-worker strategy when
    TF_CONFIG lists more than one worker (chief and workers counted); the MPI
    strategy when an MPI launcher (`kdist run`, `mpiexec`) or `srun` started
    more than one task; `MirroredStrategy` when this process sees several
    GPUs; otherwise TensorFlow's default strategy.

    `KDIST_STRATEGY` takes the four choices' names and a few aliases: `tf`,
    `multiworker`, `multi-worker` and `mwms` for `multi_worker`; `allreduce`
    and `horovod` for `mpi`; `one` and `none` for `default`.

    Args:
        environ: the environment to decide from (default: `os.environ`).
        gpus: how many GPUs this process sees (`auto()` counts them when
            the decision depends on it).

    Returns:
        `(choice, reason)`: `choice` is one of `"mpi"`, `"multi_worker"`,
            `"mirrored"` and `"default"`; `reason` says why, in words, for the log.

    Raises:
        ValueError: `KDIST_STRATEGY` names no strategy kdist knows, or
            TF_CONFIG is set but is not a JSON object.

    Example:

        >>> choose({"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "0"})
        ('mpi', 'started by an MPI launcher with 4 tasks')
        >>> choose({}, gpus=2)
        ('mirrored', 'one process sees 2 GPUs')
        >>> choose({"KDIST_STRATEGY": "default", "PMI_SIZE": "2"})[0]
        'default'
    """
    environ = os.environ if environ is None else environ
    forced = environ.get("KDIST_STRATEGY", "").strip().lower()
    if forced:
        choice = _ALIASES.get(forced, forced)
        if choice not in CHOICES:
            raise ValueError(f"KDIST_STRATEGY={forced!r} is not a strategy kdist knows; "
                             f"use one of {', '.join(CHOICES)}.")
        return choice, f"KDIST_STRATEGY={forced}"
    workers = _tf_config_workers(environ)
    if workers > 1:
        return MULTI_WORKER, f"TF_CONFIG lists {workers} workers"
    if processes.launched_by_mpi(environ):
        tasks = _launcher_tasks(environ)
        if tasks is None or tasks > 1:
            what = "an MPI launcher" if tasks is None else f"an MPI launcher with {tasks} tasks"
            if "SLURM_STEP_ID" in environ and not any(
                    name in environ for name in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK")):
                what = f"srun with {tasks} tasks"
            return MPI, f"started by {what}"
    if gpus > 1:
        return MIRRORED, f"one process sees {gpus} GPUs"
    return DEFAULT, "one process" + (" with one GPU" if gpus == 1 else " on the CPU")


def build(choice):
    """Creates the strategy named by `choice` (one of `CHOICES`)."""
    import tensorflow as tf

    if choice == MPI:
        from kdist.distribute.mpi_strategy import MPIStrategy

        return MPIStrategy()
    if choice == MULTI_WORKER:
        from kdist.distribute.multi_worker import MultiWorkerMirroredStrategy

        return MultiWorkerMirroredStrategy()
    if choice == MIRRORED:
        return tf.distribute.MirroredStrategy()
    if choice == DEFAULT:
        return tf.distribute.get_strategy()
    raise ValueError(f"Unknown strategy {choice!r}; use one of {', '.join(CHOICES)}.")


def auto(environ=None):
    """The strategy for how this process was started, logged with the reason.

    The choice is `choose()`'s, in this order:

    | how the process was started | strategy |
    |---|---|
    | `KDIST_STRATEGY` set | the one it names |
    | TF_CONFIG lists several workers (`kdist launch`) | kdist's `MultiWorkerMirroredStrategy` |
    | `kdist run`, `mpiexec` or `srun`, several tasks | `MPIStrategy` |
    | one process that sees several GPUs | `tf.distribute.MirroredStrategy()` |
    | anything else | TensorFlow's default strategy (a laptop) |

    Calls `kdist.init()` first (before TensorFlow starts, so that each rank
    gets its share of the cores and its GPU). The choice and its reason are
    logged at INFO level, by rank 0 only under `MPIStrategy`.

    Args:
        environ: the environment to decide from, in place of `os.environ`.

    Returns:
        A `tf.distribute.Strategy`: use it as `with strategy.scope():`,
            then plain `model.fit`.

    Raises:
        ValueError: `KDIST_STRATEGY` names no strategy kdist knows, or
            TF_CONFIG is set but is not a JSON object.

    Example:

        >>> import kdist
        >>> strategy = kdist.distribute.auto()
        >>> strategy.num_replicas_in_sync >= 1
        True
    """
    environ = os.environ if environ is None else environ
    # Before TensorFlow starts, so that each rank gets its share of the cores.
    processes.init()
    choice, reason = choose(environ, gpus=_visible_gpus(environ))
    strategy = build(choice)
    if choice != MPI or processes.rank() == 0:
        logger.info("kdist.distribute.auto(): %s (%s)", type(strategy).__name__, reason)
    return strategy


def _visible_gpus(environ):
    if environ.get("KDIST_STRATEGY") or _tf_config_workers(environ) > 1:
        return 0  # not needed, and listing GPUs would start TensorFlow too early
    if processes.launched_by_mpi(environ):
        return 0
    import tensorflow as tf

    return len(tf.config.list_physical_devices("GPU"))
