"""Drop-in `tf.distribute` strategies: `with strategy.scope()` then plain `model.fit`.

- `auto()`: the strategy that fits how the process was started.
- `MPIStrategy`: kdist's MPI allreduce as a strategy (`kdist run`, `mpiexec`, `srun`).
- `MultiWorkerMirroredStrategy`: TensorFlow's multi-worker strategy, working
  with Keras 3 (`kdist launch`, TF_CONFIG, SLURM).
"""

import importlib as _importlib

from kdist.distribute.mpi_strategy import MPIStrategy, slice_batches
from kdist.distribute.selection import auto, choose

# The TF-native multi-worker path loads on first use.
_LAZY = {"MultiWorkerMirroredStrategy": "kdist.distribute.multi_worker",
         "resolve_cluster": "kdist.distribute.cluster",
         "cluster_spec_from_environ": "kdist.distribute.cluster"}


def __getattr__(name):
    if name in _LAZY:
        return getattr(_importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kdist.distribute' has no attribute {name!r}")


__all__ = ["MPIStrategy", "MultiWorkerMirroredStrategy", "auto", "choose",
           "cluster_spec_from_environ", "resolve_cluster", "slice_batches"]
