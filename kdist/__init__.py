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

# Modules that need Keras load on first use, so that `kdist run` and `kdist
# --help` start without importing TensorFlow.
_LAZY_MODULES = ("callbacks", "distribute", "gan", "optimizers", "precision", "ps", "sparsity",
                 "tune")

# Horovod's top-level names that live in kdist.optimizers.
_LAZY_NAMES = ("DistributedOptimizer", "load_model")


def __getattr__(name):
    if name in _LAZY_MODULES:
        return _importlib.import_module(f"kdist.{name}")
    if name in _LAZY_NAMES:
        return getattr(_importlib.import_module("kdist.optimizers"), name)
    raise AttributeError(f"module 'kdist' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_LAZY_MODULES) + list(_LAZY_NAMES))

__all__ = [
    "Average", "Compression", "DistributedOptimizer", "Max", "Min", "Product", "Sum",
    "allgather", "allgather_object", "allreduce", "barrier", "broadcast", "broadcast_object",
    "broadcast_variables", "callbacks", "comm", "cross_rank", "distribute", "cross_size", "gan",
    "init",
    "is_initialized", "join", "load_model", "local_rank", "local_size", "mpi_enabled",
    "mpi_threads_supported", "optimizers", "precision", "ps", "rank", "shutdown", "size",
    "__version__",
]

from kdist import _registration  # noqa: E402

# Saved models name kdist's classes: register them with Keras when it is imported
# (now, if it already is). Last, so that the package is complete by then.
_registration.install()
