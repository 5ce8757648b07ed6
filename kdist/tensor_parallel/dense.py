"""`Dense` split by columns or by rows over a group of ranks."""

import keras
import tensorflow as tf

from kdist.comm.differentiable import (
    copy_to_group,
    gather_from_group,
    reduce_from_group,
    scatter_to_group,
)
from kdist.tensor_parallel._split import (
    _check_divides,
    _check_positive,
    _refuse_softmax_on_a_slice,
    _Split,
)


@keras.saving.register_keras_serializable(package="kdist")
class ColumnParallelDense(_Split):
    """A `keras.layers.Dense` whose output units are split over a group of ranks.

    This rank holds columns `[r * units / n, (r + 1) * units / n)` of the
    kernel (and of the bias), `r` its rank in the group of `n`, and returns
    those output units; with `gather_output=True` every rank gets all `units`
    (one allgather). The input must be the same on every rank; its gradient
    is summed over the group (one allreduce in the backward pass).

    Args:
        units: the unsplit layer's number of units; divisible by the group size.
        group: the ranks to split over: None (the world), a `kdist.ProcessSet`
            or a `kdist.comm.Communicator`. Not saved in the config.
        gather_output: return all units on every rank instead of this rank's slice.

    The other arguments (`activation`, `use_bias`, the initializers,
    regularizers and constraints) are those of `keras.layers.Dense`. A
    regularizer sees this rank's slice only, which gives the slice its true
    gradient.

    Example (in a world of one rank it is a `Dense`):

        >>> import keras, numpy as np
        >>> from kdist.tensor_parallel import ColumnParallelDense
        >>> dense = keras.layers.Dense(4)
        >>> x = np.ones((2, 3), "float32")
        >>> y = dense(x)
        >>> split = ColumnParallelDense(4, gather_output=True)
        >>> split.load_from_full(dense)
        >>> bool(np.allclose(split(x), y))
        True
    """

    def __init__(self, units, group=None, gather_output=False, activation=None, use_bias=True,
                 kernel_initializer="glorot_uniform", bias_initializer="zeros",
                 kernel_regularizer=None, bias_regularizer=None, kernel_constraint=None,
                 bias_constraint=None, **kwargs):
        super().__init__(group, activation, use_bias, kernel_initializer, bias_initializer,
                         kernel_regularizer, bias_regularizer, kernel_constraint,
                         bias_constraint, **kwargs)
        _check_positive("units", units)
        _check_divides("units", units, self.comm)
        self.units = int(units)
        self.local_units = self.units // self.comm.size
        self.gather_output = bool(gather_output)
        if not self.gather_output:
            _refuse_softmax_on_a_slice(self)

    def build(self, input_shape):
        width = input_shape[-1]
        if width is None:
            raise ValueError(f"{self.name} needs the last axis of its input known; got input "
                             f"shape {tuple(input_shape)}.")
        self.kernel = self._add_split_weight("kernel", (width, self.units), 1, "kernel")
        if self.use_bias:
            self.bias = self._add_split_weight("bias", (self.units,), 0, "bias")

    def _input_shape_for(self, arrays):
        return (None, arrays[0].shape[0])

    def call(self, inputs):
        inputs = tf.convert_to_tensor(inputs)
        self._check_width(inputs, -1, self.kernel.shape[0], "inputs")
        x = keras.ops.matmul(copy_to_group(inputs, self.comm, f"input of {self.name}"),
                             self.kernel)
        if self.bias is not None:
            x = keras.ops.add(x, self.bias)
        if self.gather_output:
            x = gather_from_group(x, self.comm, -1, label=f"output of {self.name}")
        return self._finish(x)

    def compute_output_shape(self, input_shape):
        return tuple(input_shape[:-1]) + (
            self.units if self.gather_output else self.local_units,)

    def get_config(self):
        config = super().get_config()
        config.update({"units": self.units, "gather_output": self.gather_output})
        return config


@keras.saving.register_keras_serializable(package="kdist")
class RowParallelDense(_Split):
    """A `keras.layers.Dense` whose input features (kernel rows) are split over a group.

    This rank holds rows `[r * d / n, (r + 1) * d / n)` of the `d x units`
    kernel and multiplies its slice of the input features with them; the
    partial products are summed over the group (one allreduce), then the bias,
    which every rank holds whole, is added once, then the activation. Every
    rank returns all `units`.

    Args:
        units: output units (not split).
        group: the ranks to split over: None (the world), a `kdist.ProcessSet`
            or a `kdist.comm.Communicator`. Not saved in the config.
        input_is_parallel: True (the default) when the input is already this
            rank's slice of the features, as a `ColumnParallelDense` without
            `gather_output` gives it; False to pass all `d` features on every
            rank and let the layer take its slice (`d` divisible by the group size).

    The other arguments are those of `keras.layers.Dense`.

    Example (the Megatron MLP: one allreduce forward, one backward):

        >>> import keras, numpy as np
        >>> from kdist.tensor_parallel import ColumnParallelDense, RowParallelDense
        >>> mlp = keras.Sequential([keras.Input((8,)),
        ...                         ColumnParallelDense(32, activation="gelu"),
        ...                         RowParallelDense(8)])
        >>> mlp(np.ones((2, 8), "float32")).shape
        TensorShape([2, 8])
    """

    def __init__(self, units, group=None, input_is_parallel=True, activation=None,
                 use_bias=True, kernel_initializer="glorot_uniform", bias_initializer="zeros",
                 kernel_regularizer=None, bias_regularizer=None, kernel_constraint=None,
                 bias_constraint=None, **kwargs):
        super().__init__(group, activation, use_bias, kernel_initializer, bias_initializer,
                         kernel_regularizer, bias_regularizer, kernel_constraint,
                         bias_constraint, **kwargs)
        _check_positive("units", units)
        self.units = int(units)
        self.input_is_parallel = bool(input_is_parallel)

    def build(self, input_shape):
        width = input_shape[-1]
        if width is None:
            raise ValueError(f"{self.name} needs the last axis of its input known; got input "
                             f"shape {tuple(input_shape)}.")
        if self.input_is_parallel:
            full = width * self.comm.size
        else:
            _check_divides(f"{self.name}'s input width", width, self.comm)
            full = width
        self.kernel = self._add_split_weight("kernel", (full, self.units), 0, "kernel")
        if self.use_bias:
            self.bias = self._add_split_weight("bias", (self.units,), None, "bias")

    def _input_shape_for(self, arrays):
        full = arrays[0].shape[0]
        _check_divides("The unsplit kernel's rows", full, self.comm)
        return (None, full // self.comm.size if self.input_is_parallel else full)

    def call(self, inputs):
        inputs = tf.convert_to_tensor(inputs)
        local = self.kernel.shape[0]
        if self.input_is_parallel:
            self._check_width(inputs, -1, local, "this rank's slice of the input features")
            x = inputs
        else:
            self._check_width(inputs, -1, local * self.comm.size, "all input features")
            x = scatter_to_group(inputs, self.comm, -1, label=f"input of {self.name}")
        x = reduce_from_group(keras.ops.matmul(x, self.kernel), self.comm,
                              label=f"output of {self.name}")
        if self.bias is not None:
            x = keras.ops.add(x, self.bias)
        return self._finish(x)

    def compute_output_shape(self, input_shape):
        return tuple(input_shape[:-1]) + (self.units,)

    def get_config(self):
        config = super().get_config()
        config.update({"units": self.units, "input_is_parallel": self.input_is_parallel})
        return config
