"""Optimizers for distributed training: gradient averaging across ranks, LARS.

- `DistributedOptimizer` (also `kdist.DistributedOptimizer`): for `model.fit`, or any
  loop that calls `apply_gradients`; wraps a Keras optimizer so that every rank applies
  the gradient reduced over all ranks.
- `PartialDistributedOptimizer`: the same, with some layers trained on each rank alone.
- `AllreduceOptimizer`: the class those two return (inside a
  `kdist.precision.LossScaleOptimizer` under `mixed_float16`); its attributes, Horovod's
  `compute_gradients` protocol, gradient accumulation and saving are described there.
- `DistributedGradientTape`: for custom training loops, a `tf.GradientTape` whose
  `gradient` returns reduced gradients.
- `PartialDistributedGradientTape`: the same, with some layers' gradients kept on each
  rank.
- `LocalGradientAggregator`: the sums behind `backward_passes_per_step > 1`
  (`optimizer._agg_helper`).
- `LARS`: layer-wise adaptive rate scaling around any Keras optimizer.
- `load_model`: Horovod's `hvd.load_model`; a saved model comes back with a distributed
  optimizer.

The optimizers and the tapes take Horovod's arguments, in Horovod's order, and reduce
gradients the same way, eagerly, inside `tf.function` and under XLA:

- dense gradients are packed into buckets, one collective per bucket (one bucket for
  most models); `bucket_bytes`, `num_groups` or explicit `groups` change the packing;
- sparse gradients (`tf.IndexedSlices`, from embeddings) travel by allgathering their
  indices and values, unless `sparse_as_dense=True` makes them dense;
- `op` is `kdist.Average` (the default) or `kdist.Sum`; `gradient_predivide_factor`
  splits an average's division into a part before the sum and a part after it;
  `compression` (`kdist.Compression`) shrinks what travels;
- the gradients of local variables (`local_layers`, `register_local_var`,
  `register_local_source`) stay on each rank, divided by the number of ranks with
  `scale_local_gradients`;
- `process_set` or `comm` reduce over fewer ranks than the world;
- in a world of one rank the gradients are returned as they are.

Where kdist differs from Horovod:

- `op=kdist.Adasum` raises `ValueError`; `device_dense` and `device_sparse` are accepted
  and have no effect (kdist reduces on the host).
- Only Keras 3 optimizers are wrapped: a TF-Keras 2 one (`tf_keras`,
  `keras.optimizers.legacy`) raises `TypeError` naming the Keras 3 class to use.
- Ranks that would start training from different weights (nothing broadcast them)
  start from rank 0's, with a warning, instead of training apart.
- Under the `mixed_float16` policy the distributed optimizer comes wrapped in
  `kdist.precision.LossScaleOptimizer`, so that all ranks agree on skipping a step.
- The wrapper is not an instance of the optimizer class it wraps, though it reads that
  optimizer's attributes: test `isinstance(opt.inner_optimizer, keras.optimizers.SGD)`.
"""

from kdist._exports import declare as _declare

_EXPORTS = {
    "LocalGradientAggregator": "kdist.optimizers.aggregation",
    "AllreduceOptimizer": "kdist.optimizers.distributed",
    "DistributedOptimizer": "kdist.optimizers.distributed",
    "PartialDistributedOptimizer": "kdist.optimizers.distributed",
    "LARS": "kdist.optimizers.lars",
    "load_model": "kdist.optimizers.loading",
    "DistributedGradientTape": "kdist.optimizers.tape",
    "PartialDistributedGradientTape": "kdist.optimizers.tape",
}

__all__, __getattr__, __dir__ = _declare(__name__, _EXPORTS)
