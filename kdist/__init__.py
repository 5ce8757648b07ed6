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

from kdist._exports import declare as _declare  # noqa: E402

# Horovod's names and kdist's packages. Everything loads on first use, so that
# `kdist run` and `kdist --help` start without importing TensorFlow.
_EXPORTS = {
    "__version__": "kdist._version",
    "callbacks": "kdist.callbacks",
    "comm": "kdist.comm",
    "ccl_built": "kdist.comm.capabilities",
    "cuda_built": "kdist.comm.capabilities",
    "ddl_built": "kdist.comm.capabilities",
    "gloo_built": "kdist.comm.capabilities",
    "gloo_enabled": "kdist.comm.capabilities",
    "is_homogeneous": "kdist.comm.capabilities",
    "nccl_built": "kdist.comm.capabilities",
    "rocm_built": "kdist.comm.capabilities",
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
    "Max": "kdist.comm.communicator",
    "Min": "kdist.comm.communicator",
    "Product": "kdist.comm.communicator",
    "Sum": "kdist.comm.communicator",
    "Compression": "kdist.comm.compression",
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
    "cross_rank": "kdist.comm.processes",
    "cross_size": "kdist.comm.processes",
    "init": "kdist.comm.processes",
    "is_initialized": "kdist.comm.processes",
    "local_rank": "kdist.comm.processes",
    "local_size": "kdist.comm.processes",
    "mpi_built": "kdist.comm.processes",
    "mpi_enabled": "kdist.comm.processes",
    "mpi_threads_supported": "kdist.comm.processes",
    "rank": "kdist.comm.processes",
    "shutdown": "kdist.comm.processes",
    "size": "kdist.comm.processes",
    "start_timeline": "kdist.comm.timeline",
    "stop_timeline": "kdist.comm.timeline",
    "distribute": "kdist.distribute",
    "SyncBatchNormalization": "kdist.distribute.sync_batch_norm",
    "elastic": "kdist.elastic",
    "gan": "kdist.gan",
    "gossip": "kdist.gossip",
    "optimizers": "kdist.optimizers",
    "DistributedOptimizer": "kdist.optimizers.distributed",
    "PartialDistributedOptimizer": "kdist.optimizers.distributed",
    "load_model": "kdist.optimizers.loading",
    "DistributedGradientTape": "kdist.optimizers.tape",
    "PartialDistributedGradientTape": "kdist.optimizers.tape",
    "pipeline": "kdist.pipeline",
    "precision": "kdist.precision",
    "ps": "kdist.ps",
    "sparsity": "kdist.sparsity",
    "tfmot": "kdist.tfmot",
    "tensor_parallel": "kdist.tensor_parallel",
    "tune": "kdist.tune",
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

__all__, __getattr__, __dir__ = _declare(__name__, _EXPORTS, missing=_NOT_PROVIDED)

from kdist import _registration  # noqa: E402

# Saved models name kdist's classes: register them with Keras when it is imported
# (now, if it already is). Last, so that the package is complete by then.
_registration.install()
