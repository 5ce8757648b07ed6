"""Model parallelism: a model's stages on several processes, and layers split across them.

- `PipelineModel`: stages on consecutive ranks, micro-batches through them
  in a GPipe or 1F1B schedule, optional recomputation, data parallelism
  across pipeline replicas.
- `split`: cuts a Sequential model into stages.
- Tensor-parallel layers (`kdist.pipeline.tensor`): a layer's kernel split
  across a group of ranks.
"""

from kdist.pipeline.model import PipelineModel, load_whole_model_weights
from kdist.pipeline.stages import split
from kdist.pipeline.tensor import (
    ColumnParallelDense,
    ColumnParallelEinsumDense,
    RowParallelDense,
    RowParallelEinsumDense,
    TensorParallelMultiHeadAttention,
)

__all__ = ["ColumnParallelDense", "ColumnParallelEinsumDense", "PipelineModel",
           "RowParallelDense", "RowParallelEinsumDense", "TensorParallelMultiHeadAttention",
           "load_whole_model_weights", "split"]
