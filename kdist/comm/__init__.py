"""kdist's communication layer: the only code that touches MPI.

Processes (`init`, `rank`, `size`, local and cross ranks), sub-communicators
and process sets, collectives on numpy arrays and TensorFlow tensors (eager,
in graphs, under XLA) that all follow one wire protocol
(`kdist.comm.protocol`), fused gradient reduction with compression, `join`
for uneven data, failure handling (`kdist.comm.watchdog`), and a timeline of every collective
(`kdist.comm.timeline`).
"""

from kdist.comm.collectives import (
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
    grouped_allgather,
    grouped_allreduce,
    grouped_reducescatter,
    reducescatter,
)
from kdist.comm.communicator import Adasum, Average, Communicator, Max, Min, Product, Sum
from kdist.comm.compression import Compression
from kdist.comm.fusion import plan_buckets
from kdist.comm.joining import join
from kdist.comm.process_ops import (
    local_rank_op,
    local_size_op,
    process_set_included_op,
    rank_op,
    size_op,
)
from kdist.comm.process_sets import (
    ProcessSet,
    add_process_set,
    global_process_set,
    remove_process_set,
)
from kdist.comm.processes import (
    cross,
    cross_rank,
    cross_size,
    init,
    is_initialized,
    launched_by_mpi,
    local,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    rank,
    shutdown,
    size,
    world,
)
from kdist.comm.protocol import CollectiveMismatch
from kdist.comm.tensors import TensorReducer
from kdist.comm.timeline import start_timeline, stop_timeline
from kdist.comm.watchdog import abort

__all__ = [
    "Adasum", "Average", "CollectiveMismatch", "Communicator", "Compression", "Max", "Min",
    "Product", "ProcessSet", "Sum", "abort", "add_process_set", "allgather", "allgather_object",
    "allreduce", "alltoall", "barrier", "broadcast", "broadcast_", "broadcast_global_variables",
    "broadcast_object", "broadcast_object_fn", "broadcast_variables", "cross", "cross_rank",
    "cross_size",
    "global_process_set", "grouped_allgather", "grouped_allreduce", "grouped_reducescatter",
    "init", "is_initialized", "join", "launched_by_mpi", "local", "local_rank", "local_rank_op",
    "local_size", "local_size_op", "mpi_built", "mpi_enabled", "mpi_threads_supported",
    "plan_buckets", "process_set_included_op", "rank", "rank_op", "reducescatter",
    "remove_process_set", "shutdown", "size", "size_op",
    "start_timeline", "stop_timeline", "TensorReducer", "world",
]
