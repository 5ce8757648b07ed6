"""kdist's communication layer: the only code that touches MPI.

Processes (`init`, `rank`, `size`, local and cross ranks), sub-communicators
(`Communicator.split`), collectives on numpy arrays and TensorFlow tensors,
fused gradient reduction with compression, and failure handling.
"""

from kdist.comm.collectives import (
    allgather,
    allgather_object,
    allreduce,
    barrier,
    broadcast,
    broadcast_object,
    broadcast_variables,
)
from kdist.comm import native
from kdist.comm.compression import Compression
from kdist.comm.fusion import FusedReducer, join, plan_buckets
from kdist.comm.tensors import TensorReducer
from kdist.comm.watchdog import abort
from kdist.comm.processes import (
    Average,
    Communicator,
    Max,
    Min,
    Product,
    Sum,
    cross,
    cross_rank,
    cross_size,
    init,
    is_initialized,
    launched_by_mpi,
    local,
    local_rank,
    local_size,
    mpi_enabled,
    mpi_threads_supported,
    rank,
    shutdown,
    size,
    world,
)
