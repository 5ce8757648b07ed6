"""Drop-in `tf.distribute` strategies: `with strategy.scope()` then plain `model.fit`.

- `auto()`: the strategy that fits how the process was started.
- `MPIStrategy`: kdist's MPI allreduce as a strategy (`kdist run`, `mpiexec`, `srun`).
- `MultiWorkerMirroredStrategy`: TensorFlow's multi-worker strategy, working
  with Keras 3 (`kdist launch`, TF_CONFIG, SLURM).
- `SyncBatchNormalization`: batch normalization over the global batch of all ranks.
- `plan(Workload(...), Cluster(...))`: each layout's predicted step time on a cluster
  (`kdist plan` on the command line); `Link`, `fit_link` and `measure_link` describe
  the network.

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
    "plan": "kdist.distribute.planner",
    "Workload": "kdist.distribute.planner",
    "Cluster": "kdist.distribute.planner",
    "Link": "kdist.distribute.cost_model",
    "fit_link": "kdist.distribute.cost_model",
    "measure_link": "kdist.distribute.planner",
}


def __getattr__(name):
    if name in _LAZY:
        return getattr(_importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kdist.distribute' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_LAZY))


__all__ = sorted(_LAZY)
