"""Drop-in `tf.distribute` strategies: `with strategy.scope()` then plain `model.fit`.

- `auto()`: the strategy that fits how the process was started (`choose()`
  says which, without building it).
- `MPIStrategy`: kdist's MPI allreduce as a strategy (`kdist run`, `mpiexec`, `srun`),
  one replica per rank; `slice_batches` is how it splits each global batch.
- `MultiWorkerMirroredStrategy`: TensorFlow's multi-worker strategy, working
  with Keras 3 (`kdist launch`, TF_CONFIG, SLURM, MPI launchers);
  `resolve_cluster` and `cluster_spec_from_environ` find its workers.
- `SyncBatchNormalization` (also `kdist.SyncBatchNormalization`): batch
  normalization over the global batch of all ranks.
- `plan(Workload(...), Cluster(...))`: each layout's predicted step time on a cluster
  (`kdist plan` on the command line); `Link`, `fit_link` and `measure_link` describe
  the network.

The Strategies guide shows them at work. Names load on first use, so that
`kdist launch` starts its workers without importing TensorFlow itself.
"""

from kdist._exports import declare as _declare

_EXPORTS = {
    "cluster_spec_from_environ": "kdist.distribute.cluster",
    "resolve_cluster": "kdist.distribute.cluster",
    "fit_link": "kdist.distribute.cost_model",
    "Link": "kdist.distribute.cost_model",
    "MPIStrategy": "kdist.distribute.mpi_strategy",
    "slice_batches": "kdist.distribute.mpi_strategy",
    "MultiWorkerMirroredStrategy": "kdist.distribute.multi_worker",
    "Cluster": "kdist.distribute.planner",
    "measure_link": "kdist.distribute.planner",
    "plan": "kdist.distribute.planner",
    "Workload": "kdist.distribute.planner",
    "auto": "kdist.distribute.selection",
    "choose": "kdist.distribute.selection",
    "SyncBatchNormalization": "kdist.distribute.sync_batch_norm",
}

__all__, __getattr__, __dir__ = _declare(__name__, _EXPORTS)
