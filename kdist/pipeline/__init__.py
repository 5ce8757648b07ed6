"""Model parallelism: a model's stages on several processes, and layers split across them.

- `PipelineModel`: stages on consecutive ranks, micro-batches through them
  in a GPipe or 1F1B schedule, optional recomputation, data parallelism
  across pipeline replicas.
- `split`: cuts a Sequential model into stages.
- `load_whole_model_weights`: loads a pipeline's weights file into the
  whole model in one process.
- `kdist.pipeline.schedule`: the GPipe and 1F1B orders of each stage's
  forward and backward passes, and their bubble on an ideal clock.
- Tensor-parallel layers (`kdist.tensor_parallel`, also reachable here and as
  `kdist.pipeline.tensor`, their former home; the same classes): a layer's
  kernel split across a group of ranks. `PipelineModel(tensor_parallel=T)`
  splits each stage over T ranks with them.

The model-parallelism guide covers schedules, replicas, checkpoints and when
to choose a pipeline, split layers or data parallelism.
"""

from kdist._exports import declare as _declare

_EXPORTS = {
    "load_whole_model_weights": "kdist.pipeline.model",
    "PipelineModel": "kdist.pipeline.model",
    "split": "kdist.pipeline.stages",
    "TensorParallelMultiHeadAttention": "kdist.tensor_parallel",
    "ColumnParallelDense": "kdist.tensor_parallel",
    "RowParallelDense": "kdist.tensor_parallel",
    "ColumnParallelEinsumDense": "kdist.tensor_parallel",
    "RowParallelEinsumDense": "kdist.tensor_parallel",
}

__all__, __getattr__, __dir__ = _declare(__name__, _EXPORTS)
