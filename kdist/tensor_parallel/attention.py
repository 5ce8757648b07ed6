"""Multi-head attention with its heads split over a group of ranks."""

import math

import keras
import numpy as np

from kdist import _keras_private
from kdist.comm.differentiable import (
    copy_to_group,
)
from kdist.tensor_parallel._split import (
    _arrays_of,
    _check_divides,
    _check_positive,
    _fresh,
    resolve_group,
)
from kdist.tensor_parallel.einsum import ColumnParallelEinsumDense, RowParallelEinsumDense


@keras.saving.register_keras_serializable(package="kdist")
class TensorParallelMultiHeadAttention(keras.layers.Layer):
    """`keras.layers.MultiHeadAttention` with its heads split over a group of ranks.

    Each rank holds `num_heads / n` heads: the query, key and value
    projections are `ColumnParallelEinsumDense` over heads, each rank attends
    with its own heads (softmax(q k^T / sqrt(key_dim)) v), and the output
    projection is a `RowParallelEinsumDense` over heads whose partial outputs
    are summed over the group (one allreduce), its bias added once. Every rank
    must pass the same query, value and key, and gets the whole output. The
    backward pass sums the input gradients over the group once per distinct
    input (once for self-attention).

    Inputs have shape `(batch, length, features)`. Weights follow
    `MultiHeadAttention` (same shapes unsplit and same order), so
    `load_from_full(mha)` takes a built `keras.layers.MultiHeadAttention` and
    `full_weights()` returns what its `set_weights` takes.

    Args:
        num_heads: the unsplit number of heads; divisible by the group size.
        key_dim: as for `keras.layers.MultiHeadAttention`.
        group: None (the world), a `kdist.ProcessSet` or a
            `kdist.comm.Communicator`. Not saved in the config.

    The other arguments (`value_dim`, `dropout`, `use_bias`, `output_shape`
    as an int, the initializers, regularizers and constraints, `seed`) are
    those of `keras.layers.MultiHeadAttention`.

    Call arguments: `query`, `value`, `key=None` (`value`), `attention_mask`
    (boolean, `(batch, query length, key length)`: True where a query may
    attend), `use_causal_mask`, `training`. Keras masks carried by the inputs
    are not read; pass them in `attention_mask`.

    Example:

        >>> import numpy as np
        >>> from kdist.tensor_parallel import TensorParallelMultiHeadAttention
        >>> attention = TensorParallelMultiHeadAttention(num_heads=4, key_dim=8)
        >>> x = np.ones((2, 5, 16), "float32")
        >>> attention(x, x, use_causal_mask=True).shape
        TensorShape([2, 5, 16])
    """

    def __init__(self, num_heads, key_dim, value_dim=None, dropout=0.0, use_bias=True,
                 output_shape=None, group=None, kernel_initializer="glorot_uniform",
                 bias_initializer="zeros", kernel_regularizer=None, bias_regularizer=None,
                 kernel_constraint=None, bias_constraint=None, seed=None, **kwargs):
        super().__init__(**kwargs)
        _check_positive("num_heads", num_heads)
        _check_positive("key_dim", key_dim)
        if value_dim is not None:
            _check_positive("value_dim", value_dim)
        if isinstance(output_shape, (tuple, list)) and len(output_shape) == 1:
            output_shape = output_shape[0]
        if output_shape is not None:
            _check_positive("output_shape (an int here)", output_shape)
        self.comm = resolve_group(group)
        _check_divides("num_heads", num_heads, self.comm)
        self.num_heads, self.key_dim = int(num_heads), int(key_dim)
        self.value_dim = int(value_dim) if value_dim else self.key_dim
        self.local_heads = self.num_heads // self.comm.size
        self.dropout = float(dropout)
        self.use_bias = bool(use_bias)
        self.output_shape_ = None if output_shape is None else int(output_shape)
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)
        self.kernel_regularizer = keras.regularizers.get(kernel_regularizer)
        self.bias_regularizer = keras.regularizers.get(bias_regularizer)
        self.kernel_constraint = keras.constraints.get(kernel_constraint)
        self.bias_constraint = keras.constraints.get(bias_constraint)
        self.seed = seed
        self._dropout_layer = keras.layers.Dropout(self.dropout, seed=seed,
                                                   dtype=self.dtype_policy)

    def _common(self):
        return dict(group=self.comm, kernel_initializer=_fresh(self.kernel_initializer),
                    bias_initializer=_fresh(self.bias_initializer),
                    kernel_regularizer=self.kernel_regularizer,
                    bias_regularizer=self.bias_regularizer,
                    kernel_constraint=self.kernel_constraint,
                    bias_constraint=self.bias_constraint, dtype=self.dtype_policy)

    def _projection(self, name, size, shape):
        layer = ColumnParallelEinsumDense("abc,cde->abde", (None, self.num_heads, size), "d",
                                          bias_axes="de" if self.use_bias else None,
                                          name=name, **self._common())
        layer._copy_input = False
        layer.build(shape)
        return layer

    def build(self, query_shape, value_shape, key_shape=None):
        key_shape = value_shape if key_shape is None else key_shape
        for what, shape in (("query", query_shape), ("value", value_shape), ("key", key_shape)):
            if len(shape) != 3 or shape[-1] is None:
                raise ValueError(f"{self.name} takes {what} of shape (batch, length, features) "
                                 f"with known features; got {tuple(shape)}.")
        self._query_dense = self._projection("query", self.key_dim, query_shape)
        self._key_dense = self._projection("key", self.key_dim, key_shape)
        self._value_dense = self._projection("value", self.value_dim, value_shape)
        out = self.output_shape_ or query_shape[-1]
        self._output_dense = RowParallelEinsumDense(
            "abcd,cde->abe", (None, out), "c", bias_axes="e" if self.use_bias else None,
            name="attention_output", **self._common())
        self._output_dense.build((None, None, self.local_heads, self.value_dim))

    @property
    def group_size(self):
        """How many ranks the heads are split over."""
        return self.comm.size

    @property
    def group_rank(self):
        """This rank's place in the group: it holds heads `[r * h, (r + 1) * h)`,
        `h = num_heads / group_size`."""
        return self.comm.rank

    @property
    def query_dense(self):
        return self._query_dense

    @property
    def key_dense(self):
        return self._key_dense

    @property
    def value_dense(self):
        return self._value_dense

    @property
    def output_dense(self):
        return self._output_dense

    def _parts(self):
        return [self._query_dense, self._key_dense, self._value_dense, self._output_dense]

    def _attend(self, query, key, value, mask, causal, training):
        scale = 1.0 / math.sqrt(float(self.key_dim))
        if self.dropout == 0.0 or not training:
            # keras.layers.MultiHeadAttention's own path, so that one rank gives its numbers.
            return keras.ops.dot_product_attention(query, key, value, mask=mask, scale=scale,
                                                   is_causal=causal)
        scores = keras.ops.einsum("btnh,bsnh->bnts",
                                  keras.ops.multiply(query, keras.ops.cast(scale, query.dtype)),
                                  key)
        if mask is not None or causal:
            if causal:
                length_q, length_k = keras.ops.shape(query)[1], keras.ops.shape(key)[1]
                lower = keras.ops.tril(keras.ops.ones((length_q, length_k), "bool"))
                lower = keras.ops.expand_dims(keras.ops.expand_dims(lower, 0), 0)
                mask = lower if mask is None else keras.ops.logical_and(mask, lower)
            scores = keras.ops.where(mask, scores, keras.ops.cast(-0.7 * np.finfo(
                keras.backend.standardize_dtype(scores.dtype)).max, scores.dtype))
        weights = self._dropout_layer(keras.ops.softmax(scores, axis=-1), training=training)
        return keras.ops.einsum("bnts,bsnh->btnh", weights, value)

    def call(self, query, value, key=None, attention_mask=None, use_causal_mask=False,
             training=None):
        if key is None:
            key = value
        copies = []

        def copied(x, what):
            # One gradient allreduce per distinct input: self-attention needs one.
            for original, copy in copies:
                if original is x:
                    return copy
            copies.append((x, copy_to_group(x, self.comm, label=f"{what} of {self.name}")))
            return copies[-1][1]

        q = self._query_dense(copied(query, "query"))
        v = self._value_dense(copied(value, "value"))
        k = self._key_dense(copied(key, "key"))
        mask = None
        if attention_mask is not None:
            mask = keras.ops.cast(attention_mask, "bool")
            if len(mask.shape) != 3:
                raise ValueError(f"attention_mask should have shape (batch, query length, key "
                                 f"length); got {tuple(mask.shape)}.")
            mask = keras.ops.expand_dims(mask, 1)
        attended = self._attend(q, k, v, mask, bool(use_causal_mask), training)
        return self._output_dense(attended)

    def compute_output_shape(self, query_shape, value_shape, key_shape=None):
        return tuple(query_shape[:-1]) + (self.output_shape_ or query_shape[-1],)

    def full_weights(self):
        """The unsplit `MultiHeadAttention`'s weights, in its order, gathered from the group.

        A collective, run eagerly: every rank of the group must call it.
        """
        if not self.built:
            raise ValueError(f"{self.name} is not built yet: it has no weights to gather.")
        return [w for part in self._parts() for w in part.full_weights()]

    def load_from_full(self, full):
        """Keeps this rank's heads of an unsplit `keras.layers.MultiHeadAttention`.

        Args:
            full: a built `keras.layers.MultiHeadAttention` (without `use_gate`,
                on inputs of rank 3), or the list of its weights in its order:
                query, key, value and output kernels, each followed by its
                bias when `use_bias`.
        """
        if (isinstance(full, keras.layers.MultiHeadAttention)
                and _keras_private.attention_uses_gate(full)):
            raise ValueError("load_from_full does not take a MultiHeadAttention with "
                             "use_gate=True.")
        arrays = _arrays_of(full, "a keras.layers.MultiHeadAttention")
        each = 2 if self.use_bias else 1
        if len(arrays) != 4 * each:
            raise ValueError(f"{self.name} (use_bias={self.use_bias}) takes {4 * each} "
                             f"weights from the unsplit attention; got {len(arrays)}.")
        kernels = arrays[::each]
        if not self.built:
            query, key, value, output = (k.shape for k in kernels)
            if len(query) != 3 or len(output) != 3:
                raise ValueError("load_from_full takes a MultiHeadAttention built on inputs of "
                                 "shape (batch, length, features).")
            self.build((None, None, query[0]), (None, None, value[0]), (None, None, key[0]))
        for index, part in enumerate(self._parts()):
            part.load_from_full(arrays[index * each:(index + 1) * each])

    def get_config(self):
        config = super().get_config()
        config.update({
            "num_heads": self.num_heads, "key_dim": self.key_dim, "value_dim": self.value_dim,
            "dropout": self.dropout, "use_bias": self.use_bias,
            "output_shape": self.output_shape_, "seed": self.seed,
            "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
            "bias_initializer": keras.initializers.serialize(self.bias_initializer),
            "kernel_regularizer": keras.regularizers.serialize(self.kernel_regularizer),
            "bias_regularizer": keras.regularizers.serialize(self.bias_regularizer),
            "kernel_constraint": keras.constraints.serialize(self.kernel_constraint),
            "bias_constraint": keras.constraints.serialize(self.bias_constraint),
        })
        return config
