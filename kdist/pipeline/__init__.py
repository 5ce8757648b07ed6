"""Model parallelism: a model's stages on several processes, and layers split across them.

- `PipelineModel`: stages on consecutive ranks, micro-batches through them
  in a GPipe or 1F1B schedule, optional recomputation, data parallelism
  across pipeline replicas.
- `split`: cuts a Sequential model into stages.
- Tensor-parallel layers (`kdist.pipeline.tensor`): a layer's kernel split
  across a group of ranks.
"""

from typing import TYPE_CHECKING as _TYPE_CHECKING

from kdist._lazy import lazy_attributes as _lazy_attributes

# Names load on first use: registering kdist's classes with Keras (the tensor-parallel
# layers) then does not import the pipeline's machinery.
_LAZY = {
    "PipelineModel": "kdist.pipeline.model",
    "load_whole_model_weights": "kdist.pipeline.model",
    "split": "kdist.pipeline.stages",
    "ColumnParallelDense": "kdist.pipeline.tensor",
    "ColumnParallelEinsumDense": "kdist.pipeline.tensor",
    "RowParallelDense": "kdist.pipeline.tensor",
    "RowParallelEinsumDense": "kdist.pipeline.tensor",
    "TensorParallelMultiHeadAttention": "kdist.pipeline.tensor",
}

if _TYPE_CHECKING:  # what documentation tools and type checkers read; never run
    from kdist.pipeline.model import PipelineModel, load_whole_model_weights  # noqa: F401
    from kdist.pipeline.stages import split  # noqa: F401
    from kdist.pipeline.tensor import (  # noqa: F401
        ColumnParallelDense,
        ColumnParallelEinsumDense,
        RowParallelDense,
        RowParallelEinsumDense,
        TensorParallelMultiHeadAttention)

__all__ = ["ColumnParallelDense", "ColumnParallelEinsumDense", "PipelineModel",
           "RowParallelDense", "RowParallelEinsumDense", "TensorParallelMultiHeadAttention",
           "load_whole_model_weights", "split"]

__getattr__, __dir__ = _lazy_attributes(__name__, _LAZY)
