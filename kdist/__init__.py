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

from kdist._version import __version__  # noqa: E402
from kdist import callbacks, comm, optimizers, precision  # noqa: E402
from kdist.comm import (  # noqa: E402
    Average,
    Compression,
    Max,
    Min,
    Product,
    Sum,
    allgather,
    allgather_object,
    allreduce,
    barrier,
    broadcast,
    broadcast_object,
    broadcast_variables,
    cross_rank,
    cross_size,
    init,
    is_initialized,
    join,
    local_rank,
    local_size,
    mpi_enabled,
    mpi_threads_supported,
    rank,
    shutdown,
    size,
)
from kdist.optimizers import DistributedOptimizer  # noqa: E402

__all__ = [
    "Average", "Compression", "DistributedOptimizer", "Max", "Min", "Product", "Sum",
    "allgather", "allgather_object", "allreduce", "barrier", "broadcast", "broadcast_object",
    "broadcast_variables", "callbacks", "comm", "cross_rank", "cross_size", "init",
    "is_initialized", "join", "local_rank", "local_size", "mpi_enabled",
    "mpi_threads_supported", "optimizers", "precision", "rank", "shutdown", "size",
    "__version__",
]
