"""kdist's communication layer: the only code that touches MPI.

Processes (`init`, `rank`, `size`, local and cross ranks), sub-communicators
and process sets, collectives on numpy arrays and TensorFlow tensors (eager,
in graphs, under XLA) that all follow one wire protocol
(`kdist.comm.protocol`), fused gradient reduction with compression, `join`
for uneven data, failure handling (`kdist.comm.watchdog`), and a timeline of every collective
(`kdist.comm.timeline`).
"""

from kdist._exports import declare as _declare

_EXPORTS = {
    "allgather": "kdist.comm.collectives",
    "allgather_object": "kdist.comm.collectives",
    "allreduce": "kdist.comm.collectives",
    "alltoall": "kdist.comm.collectives",
    "barrier": "kdist.comm.collectives",
    "broadcast": "kdist.comm.collectives",
    "broadcast_": "kdist.comm.collectives",
    "broadcast_global_variables": "kdist.comm.collectives",
    "broadcast_object": "kdist.comm.collectives",
    "broadcast_object_fn": "kdist.comm.collectives",
    "broadcast_variables": "kdist.comm.collectives",
    "grouped_allgather": "kdist.comm.collectives",
    "grouped_allreduce": "kdist.comm.collectives",
    "grouped_reducescatter": "kdist.comm.collectives",
    "reducescatter": "kdist.comm.collectives",
    "Adasum": "kdist.comm.communicator",
    "Average": "kdist.comm.communicator",
    "Communicator": "kdist.comm.communicator",
    "Max": "kdist.comm.communicator",
    "Min": "kdist.comm.communicator",
    "Product": "kdist.comm.communicator",
    "Sum": "kdist.comm.communicator",
    "Compression": "kdist.comm.compression",
    "plan_buckets": "kdist.comm.fusion",
    "join": "kdist.comm.joining",
    "local_rank_op": "kdist.comm.process_ops",
    "local_size_op": "kdist.comm.process_ops",
    "process_set_included_op": "kdist.comm.process_ops",
    "rank_op": "kdist.comm.process_ops",
    "size_op": "kdist.comm.process_ops",
    "add_process_set": "kdist.comm.process_sets",
    "global_process_set": "kdist.comm.process_sets",
    "ProcessSet": "kdist.comm.process_sets",
    "remove_process_set": "kdist.comm.process_sets",
    "cross": "kdist.comm.processes",
    "cross_rank": "kdist.comm.processes",
    "cross_size": "kdist.comm.processes",
    "init": "kdist.comm.processes",
    "is_initialized": "kdist.comm.processes",
    "launched_by_mpi": "kdist.comm.processes",
    "local": "kdist.comm.processes",
    "local_rank": "kdist.comm.processes",
    "local_size": "kdist.comm.processes",
    "mpi_built": "kdist.comm.processes",
    "mpi_enabled": "kdist.comm.processes",
    "mpi_threads_supported": "kdist.comm.processes",
    "rank": "kdist.comm.processes",
    "shutdown": "kdist.comm.processes",
    "size": "kdist.comm.processes",
    "world": "kdist.comm.processes",
    "CollectiveMismatch": "kdist.comm.protocol",
    "TensorReducer": "kdist.comm.tensors",
    "start_timeline": "kdist.comm.timeline",
    "stop_timeline": "kdist.comm.timeline",
    "abort": "kdist.comm.watchdog",
}

__all__, __getattr__, __dir__ = _declare(__name__, _EXPORTS)
