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
    broadcast_global_variables,
    broadcast_object,
    broadcast_variables,
    cross_rank,
    cross_size,
    global_process_set,
    grouped_allreduce,
    init,
    is_initialized,
    join,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    rank,
    reducescatter,
    remove_process_set,
    shutdown,
    size,
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
    "DistributedOptimizer": "kdist.optimizers",
    "PartialDistributedOptimizer": "kdist.optimizers",
    "SyncBatchNormalization": "kdist.distribute.sync_batch_norm",
    "load_model": "kdist.optimizers",
}


def __getattr__(name):
    if name in _LAZY_MODULES:
        return _importlib.import_module(f"kdist.{name}")
    if name in _LAZY_NAMES:
        return getattr(_importlib.import_module(_LAZY_NAMES[name]), name)
    raise AttributeError(f"module 'kdist' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_LAZY_MODULES) + list(_LAZY_NAMES))

__all__ = [
    "Adasum", "Average", "Compression", "DistributedOptimizer", "Max", "Min",
    "PartialDistributedOptimizer", "ProcessSet", "Product", "Sum", "SyncBatchNormalization",
    "add_process_set", "allgather", "allgather_object", "allreduce", "alltoall", "barrier",
    "broadcast", "broadcast_global_variables", "broadcast_object", "broadcast_variables",
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
