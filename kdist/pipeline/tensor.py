"""The former home of the tensor-parallel layers, kept so that existing imports work.

They live in `kdist.tensor_parallel`; `from kdist.pipeline.tensor import
ColumnParallelDense` gives the same classes.
"""

from kdist._exports import declare as _declare

_EXPORTS = {
    "TensorParallelMultiHeadAttention": "kdist.tensor_parallel.attention",
    "ColumnParallelDense": "kdist.tensor_parallel.dense",
    "RowParallelDense": "kdist.tensor_parallel.dense",
    "ColumnParallelEinsumDense": "kdist.tensor_parallel.einsum",
    "RowParallelEinsumDense": "kdist.tensor_parallel.einsum",
    "resolve_group": "kdist.tensor_parallel._split",
}

__all__, __getattr__, __dir__ = _declare(__name__, _EXPORTS)
