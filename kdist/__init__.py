"""kdist: distributed training and tuning for Keras 3.

The top level is Horovod's Keras API, so that a Horovod script runs with
`import kdist as hvd`:

>>> import kdist as hvd
>>> hvd.init()
>>> hvd.size() >= 1
True
"""

import os as _os

_os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import importlib as _importlib  # noqa: E402

from kdist._version import __version__  # noqa: E402
from kdist import comm  # noqa: E402
from kdist.comm import (  # noqa: E402
    Adasum,
    Average,
    Compression,
    Max,
    Min,
    Product,
    ProcessSet,
    Sum,
    add_process_set,
    allgather,
    allgather_object,
    allreduce,
    alltoall,
    barrier,
    broadcast,
    broadcast_,
    broadcast_global_variables,
    broadcast_object,
    broadcast_object_fn,
    broadcast_variables,
    cross_rank,
    cross_size,
    global_process_set,
    grouped_allgather,
    grouped_allreduce,
    grouped_reducescatter,
    init,
    is_initialized,
    join,
    local_rank,
    local_rank_op,
    local_size,
    local_size_op,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    process_set_included_op,
    rank,
    rank_op,
    reducescatter,
    remove_process_set,
    shutdown,
    size,
    size_op,
    start_timeline,
    stop_timeline,
)
from kdist.comm.capabilities import (  # noqa: E402
    ccl_built,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    is_homogeneous,
    nccl_built,
    rocm_built,
)

# Modules that need Keras load on first use, so that `kdist run` and `kdist
# --help` start without importing TensorFlow.
_LAZY_MODULES = ("callbacks", "distribute", "elastic", "gan", "gossip", "optimizers",
                 "pipeline", "precision", "ps", "sparsity", "tfmot", "tune")
# Horovod's top-level names that need Keras, and where they live.
_LAZY_NAMES = {
    "DistributedGradientTape": "kdist.optimizers",
    "DistributedOptimizer": "kdist.optimizers",
    "PartialDistributedGradientTape": "kdist.optimizers",
    "PartialDistributedOptimizer": "kdist.optimizers",
    "SyncBatchNormalization": "kdist.distribute.sync_batch_norm",
    "load_model": "kdist.optimizers",
}


# Horovod names that kdist does not provide, and what to use instead.
_NOT_PROVIDED = {
    "BroadcastGlobalVariablesHook": (
        "a TensorFlow 1 session hook; broadcast with kdist.broadcast_variables("
        "model.variables, root_rank=0) in a custom loop, or add "
        "kdist.callbacks.BroadcastGlobalVariablesCallback(0) to fit's callbacks"),
    "LocalGradientAggregationHelper": (
        "Horovod's internal helper; pass backward_passes_per_step=N to "
        "kdist.DistributedOptimizer (kdist.optimizers.LocalGradientAggregator does the sums)"),
    "LocalGradientAggregationHelperEager": (
        "Horovod's internal helper; pass backward_passes_per_step=N to "
        "kdist.DistributedOptimizer"),
    "handle_average_backwards_compatibility": (
        "Horovod's internal helper; pass op=kdist.Average or op=kdist.Sum"),
    "check_num_rank_power_of_2": (
        "an Adasum helper; kdist has no Adasum: use op=kdist.Average or op=kdist.Sum"),
    "gpu_available": "use tf.config.list_physical_devices('GPU')",
    "broadcast_global_variables_hook": "use kdist.broadcast_variables(model.variables, 0)",
    "mpi_ops": "kdist's collectives are at the top level (kdist.allreduce, kdist.rank_op, ...)",
}


def __getattr__(name):
    if name in _LAZY_MODULES:
        return _importlib.import_module(f"kdist.{name}")
    if name in _LAZY_NAMES:
        return getattr(_importlib.import_module(_LAZY_NAMES[name]), name)
    if name in _NOT_PROVIDED:
        raise AttributeError(f"kdist does not provide Horovod's {name!r}: "
                             f"{_NOT_PROVIDED[name]}.")
    raise AttributeError(f"module 'kdist' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_LAZY_MODULES) + list(_LAZY_NAMES))

__all__ = [
    "Adasum", "Average", "Compression", "DistributedOptimizer", "Max", "Min",
    "PartialDistributedOptimizer", "ProcessSet", "Product", "Sum", "SyncBatchNormalization",
    "add_process_set", "allgather", "allgather_object", "allreduce", "alltoall", "barrier",
    "broadcast", "broadcast_", "broadcast_global_variables", "broadcast_object",
    "broadcast_object_fn", "broadcast_variables", "DistributedGradientTape",
    "PartialDistributedGradientTape", "grouped_allgather", "grouped_reducescatter",
    "local_rank_op", "local_size_op", "process_set_included_op", "rank_op", "size_op",
    "callbacks", "ccl_built", "comm", "cross_rank", "cross_size", "cuda_built", "ddl_built",
    "distribute", "gan", "global_process_set", "gloo_built", "gloo_enabled", "grouped_allreduce",
    "init", "is_homogeneous", "is_initialized", "join", "load_model", "local_rank", "local_size",
    "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built", "optimizers", "precision",
    "ps", "rank", "reducescatter", "remove_process_set", "rocm_built", "shutdown", "size",
    "sparsity", "start_timeline", "stop_timeline", "tfmot", "tune", "__version__",
]

from kdist import _registration  # noqa: E402

# Saved models name kdist's classes: register them with Keras when it is imported
# (now, if it already is). Last, so that the package is complete by then.
_registration.install()
