"""kdist: distributed training and tuning for Keras 3.

The top level is Horovod's Keras API, so that a Horovod script runs with
`import kdist as hvd`:

>>> import kdist as hvd
>>> hvd.init()
>>> hvd.size() >= 1
True

Besides Horovod's names, `kdist` holds its subpackages: `kdist.callbacks`,
`kdist.optimizers`, `kdist.precision`, `kdist.elastic`, `kdist.distribute`,
`kdist.ps`, `kdist.gossip`, `kdist.pipeline`, `kdist.tensor_parallel`, `kdist.gan`,
`kdist.sparsity` (with tfmot's import paths in `kdist.tfmot`), `kdist.tune` and
`kdist.comm`, the communication layer that every process function and collective
of the top level comes from. `kdist.__version__` is the installed version. A
Horovod name that kdist does not provide (`hvd.BroadcastGlobalVariablesHook`,
`hvd.mpi_ops`, ...) raises `AttributeError` saying what to use instead.

Importing kdist does not import TensorFlow, so `kdist run` and `kdist --help` start at
once. Every name loads on first use. Loading the process functions, collectives and
reduction ops (they come from `kdist.comm`) imports no TensorFlow; loading the other
subpackages, `kdist.DistributedOptimizer`, `kdist.PartialDistributedOptimizer`,
`kdist.SyncBatchNormalization` or `kdist.load_model` does. `kdist.init()` imports
TensorFlow too, to give each rank its share of the node's cores and its own GPU.

Saved models name kdist's classes (`AllreduceOptimizer`, `LossScaleOptimizer`, the
pruning and quantization wrappers and schedules, the tensor-parallel layers,
`SyncBatchNormalization`, `GAN`). `import kdist` registers them with Keras as soon as
Keras is imported, before or after kdist, so `keras.models.load_model(path)` loads
such a model in any process that has run `import kdist`, with nothing else
imported from kdist.

Every function that needs the process world starts kdist on first use, so calling
`kdist.init()` yourself is optional. Call it at the top of the script anyway, before
building models: TensorFlow's thread counts and visible GPUs can be set only before
TensorFlow starts using them (see "Threads and devices" in the data-parallel guide).
"""

import os as _os

_os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from kdist._exports import declare as _declare  # noqa: E402

# Horovod's names and kdist's packages, each from the package that declares it (or
# the module, for names no package exports). Everything loads on first use, so that
# `kdist run` and `kdist --help` start without importing TensorFlow.
_EXPORTS = {
    "__version__": "kdist._version",
    "callbacks": "kdist.callbacks",
    "Adasum": "kdist.comm",
    "add_process_set": "kdist.comm",
    "allgather": "kdist.comm",
    "allgather_object": "kdist.comm",
    "allreduce": "kdist.comm",
    "alltoall": "kdist.comm",
    "Average": "kdist.comm",
    "barrier": "kdist.comm",
    "broadcast": "kdist.comm",
    "broadcast_": "kdist.comm",
    "broadcast_global_variables": "kdist.comm",
    "broadcast_object": "kdist.comm",
    "broadcast_object_fn": "kdist.comm",
    "broadcast_variables": "kdist.comm",
    "comm": "kdist.comm",
    "Compression": "kdist.comm",
    "cross_rank": "kdist.comm",
    "cross_size": "kdist.comm",
    "global_process_set": "kdist.comm",
    "grouped_allgather": "kdist.comm",
    "grouped_allreduce": "kdist.comm",
    "grouped_reducescatter": "kdist.comm",
    "init": "kdist.comm",
    "is_initialized": "kdist.comm",
    "join": "kdist.comm",
    "local_rank": "kdist.comm",
    "local_rank_op": "kdist.comm",
    "local_size": "kdist.comm",
    "local_size_op": "kdist.comm",
    "Max": "kdist.comm",
    "Min": "kdist.comm",
    "mpi_built": "kdist.comm",
    "mpi_enabled": "kdist.comm",
    "mpi_threads_supported": "kdist.comm",
    "process_set_included_op": "kdist.comm",
    "ProcessSet": "kdist.comm",
    "Product": "kdist.comm",
    "rank": "kdist.comm",
    "rank_op": "kdist.comm",
    "reducescatter": "kdist.comm",
    "remove_process_set": "kdist.comm",
    "shutdown": "kdist.comm",
    "size": "kdist.comm",
    "size_op": "kdist.comm",
    "start_timeline": "kdist.comm",
    "stop_timeline": "kdist.comm",
    "Sum": "kdist.comm",
    "ccl_built": "kdist.comm.capabilities",
    "cuda_built": "kdist.comm.capabilities",
    "ddl_built": "kdist.comm.capabilities",
    "gloo_built": "kdist.comm.capabilities",
    "gloo_enabled": "kdist.comm.capabilities",
    "is_homogeneous": "kdist.comm.capabilities",
    "nccl_built": "kdist.comm.capabilities",
    "rocm_built": "kdist.comm.capabilities",
    "distribute": "kdist.distribute",
    "SyncBatchNormalization": "kdist.distribute",
    "elastic": "kdist.elastic",
    "gan": "kdist.gan",
    "gossip": "kdist.gossip",
    "DistributedGradientTape": "kdist.optimizers",
    "DistributedOptimizer": "kdist.optimizers",
    "load_model": "kdist.optimizers",
    "optimizers": "kdist.optimizers",
    "PartialDistributedGradientTape": "kdist.optimizers",
    "PartialDistributedOptimizer": "kdist.optimizers",
    "pipeline": "kdist.pipeline",
    "precision": "kdist.precision",
    "ps": "kdist.ps",
    "sparsity": "kdist.sparsity",
    "tensor_parallel": "kdist.tensor_parallel",
    "tfmot": "kdist.tfmot",
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
