"""Drop-in `tf.distribute` strategies: `with strategy.scope()` then plain `model.fit`.

- `auto()`: the strategy that fits how the process was started.
- `MPIStrategy`: kdist's MPI allreduce as a strategy (`kdist run`, `mpiexec`, `srun`).
- `MultiWorkerMirroredStrategy`: TensorFlow's multi-worker strategy, working
  with Keras 3 (`kdist launch`, TF_CONFIG, SLURM).
- `SyncBatchNormalization`: batch normalization over the global batch of all ranks.

Names load on first use, so that `kdist launch` starts its workers without
importing TensorFlow itself.
"""

import importlib as _importlib

_LAZY = {
    "MPIStrategy": "kdist.distribute.mpi_strategy",
    "slice_batches": "kdist.distribute.mpi_strategy",
    "SyncBatchNormalization": "kdist.distribute.sync_batch_norm",
    "MultiWorkerMirroredStrategy": "kdist.distribute.multi_worker",
    "auto": "kdist.distribute.selection",
    "choose": "kdist.distribute.selection",
    "resolve_cluster": "kdist.distribute.cluster",
    "cluster_spec_from_environ": "kdist.distribute.cluster",
}


def __getattr__(name):
    if name in _LAZY:
        return getattr(_importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kdist.distribute' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_LAZY))


__all__ = sorted(_LAZY)
