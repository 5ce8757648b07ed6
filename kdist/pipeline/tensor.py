"""The former home of the tensor-parallel layers, kept so that existing imports work.

They live in `kdist.tensor_parallel`; `from kdist.pipeline.tensor import
ColumnParallelDense` gives the same classes.
"""

from kdist import tensor_parallel as _tensor_parallel
from kdist._exports import declare as _declare

_EXPORTS = dict.fromkeys(_tensor_parallel.__all__, "kdist.tensor_parallel")

__all__, __getattr__, __dir__ = _declare(__name__, _EXPORTS)
