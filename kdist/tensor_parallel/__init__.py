"""Tensor parallelism: one layer's weights split over a group of ranks (Megatron-LM style).

Each rank of the group holds a slice of the layer's kernel and computes its
part of the layer; collectives inside the forward and backward passes join
the parts, so every rank sees the same result the unsplit layer gives:

- a column-parallel layer splits the kernel along an output axis: every rank
  takes the whole input and produces its slice of the output (optionally
  gathered back whole, `gather_output=True`);
- a row-parallel layer splits it along a contracted (input) axis: every rank
  takes its slice of the input, and the partial results are summed over the
  group, after which the bias is added once.

A column-parallel layer followed by a row-parallel one (the Megatron MLP, or
attention with heads split) needs one sum forward and one backward, whatever
the width in between. Every rank of the group must feed the same data and
compute the same loss (tensor parallelism splits the model, not the batch),
and call each layer in the same order.

`group` is the group of ranks a layer is split over: None for the world (all
ranks of the job; kdist starts if it has not), a `kdist.ProcessSet` or a
`kdist.comm.Communicator`. It is not part of a layer's config: a layer made
again from its config is split over the world. In a world of one rank each
layer computes exactly what the unsplit Keras layer computes.

A layer initializes the whole kernel with its initializer and keeps its
slice, so that a model seeded alike starts from the same weights whatever the
group's size (the whole kernel exists on each rank while the layer builds).
Weights every rank holds whole (a row-parallel bias) must start equal on every
rank: they do with the default zeros, or when every rank seeds alike
(`keras.utils.set_random_seed`); their gradients are then equal too.
`load_from_full` takes an unsplit layer's weights and keeps this rank's slice;
`full_weights` gathers them back (every rank of the group must call it), for a
checkpoint that does not depend on how the model is split.

Every layer has `group_size` (the ranks it is split over), `group_rank`
(which slice this rank holds), `load_from_full(layer or weights)` and
`full_weights()`. The layers:

- `ColumnParallelDense(units, group=None, gather_output=False, ...)` and
  `RowParallelDense(units, group=None, input_is_parallel=True, ...)`, with
  `keras.layers.Dense`'s other arguments;
- `ColumnParallelEinsumDense(equation, output_shape, split_axis, group=None,
  bias_axes=None, gather_output=False, ...)` and
  `RowParallelEinsumDense(equation, output_shape, split_axis, group=None,
  bias_axes=None, input_is_parallel=True, ...)`, which split a
  `keras.layers.EinsumDense` kernel along the axis named by the letter
  `split_axis`;
- `TensorParallelMultiHeadAttention(num_heads, key_dim, value_dim=None,
  dropout=0.0, use_bias=True, output_shape=None, group=None, ...)`, which
  splits the heads.

They are made of the differentiable collectives of `kdist.comm.differentiable`
(`copy_to_group`, `reduce_from_group`, `gather_from_group` and
`scatter_to_group`), which code building split layers of its own can use, with
`resolve_group`. `kdist.pipeline` and `kdist.pipeline.tensor` give the same
classes, and `kdist.pipeline.PipelineModel(tensor_parallel=T)` builds each
stage with them over T ranks.
"""

from kdist._exports import declare as _declare

_EXPORTS = {
    "TensorParallelMultiHeadAttention": "kdist.tensor_parallel.attention",
    "ColumnParallelDense": "kdist.tensor_parallel.dense",
    "RowParallelDense": "kdist.tensor_parallel.dense",
    "ColumnParallelEinsumDense": "kdist.tensor_parallel.einsum",
    "RowParallelEinsumDense": "kdist.tensor_parallel.einsum",
    # For code that builds split layers of its own.
    "resolve_group": "kdist.tensor_parallel._split",
}

__all__, __getattr__, __dir__ = _declare(__name__, _EXPORTS)
