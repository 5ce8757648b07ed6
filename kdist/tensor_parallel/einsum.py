"""`EinsumDense` split along one kernel axis over a group of ranks."""

import re

import keras
import numpy as np
import tensorflow as tf

from kdist.comm.differentiable import (
    copy_to_group,
    gather_from_group,
    reduce_from_group,
    scatter_to_group,
)
from kdist.tensor_parallel._split import (
    _check_divides,
    _refuse_softmax_on_a_slice,
    _Split,
)


_EQUATION = re.compile(r"([a-zA-Z]+),([a-zA-Z]+)->([a-zA-Z]+)")


class _SplitEinsum(_Split):
    """An `EinsumDense` with one kernel axis, named by its letter, split over the group."""

    def __init__(self, equation, output_shape, split_axis, group=None, bias_axes=None,
                 activation=None, kernel_initializer="glorot_uniform",
                 bias_initializer="zeros", kernel_regularizer=None, bias_regularizer=None,
                 kernel_constraint=None, bias_constraint=None, **kwargs):
        super().__init__(group, activation, bias_axes is not None, kernel_initializer,
                         bias_initializer, kernel_regularizer, bias_regularizer,
                         kernel_constraint, bias_constraint, **kwargs)
        match = None
        if isinstance(equation, str):
            match = _EQUATION.fullmatch(equation.replace(" ", ""))
        if match is None:
            raise ValueError(f"{type(self).__name__} takes an equation 'input,kernel->output' "
                             f"of letters (no '...'), as keras.layers.EinsumDense; got "
                             f"{equation!r}.")
        self.equation = match.group(0)
        self.input_spec_, self.kernel_spec, self.output_spec_ = match.groups()
        shape = [output_shape] if isinstance(output_shape, (int, np.integer)) else output_shape
        self.partial_output_shape = tuple(None if d is None else int(d) for d in shape)
        if len(self.partial_output_shape) != len(self.output_spec_) - 1:
            raise ValueError(f"output_shape {tuple(shape)} should give the sizes of the output "
                             f"axes after the first of '{self.output_spec_}' (one each).")
        if not isinstance(split_axis, str) or len(split_axis) != 1 or \
                split_axis not in self.kernel_spec:
            raise ValueError(f"split_axis must be one letter of the kernel's axes "
                             f"'{self.kernel_spec}' in {self.equation!r}; got {split_axis!r}.")
        self.split_axis = split_axis
        self.bias_axes = bias_axes
        for letter in bias_axes or "":
            if letter not in self.output_spec_:
                raise ValueError(f"bias_axes {bias_axes!r}: '{letter}' is not an output axis "
                                 f"of {self.equation!r}.")
        for letter in self.kernel_spec:
            if letter not in self.input_spec_ and letter not in self.output_spec_:
                raise ValueError(f"Kernel axis '{letter}' of {self.equation!r} is neither an "
                                 "input nor an output axis.")

    def _shapes(self, input_shape, split_width):
        """The unsplit kernel's shape, bias shape and output shape (the batch axis None)."""
        if len(input_shape) != len(self.input_spec_):
            raise ValueError(f"{self.name} ({self.equation!r}) takes inputs of rank "
                             f"{len(self.input_spec_)}; got shape {tuple(input_shape)}.")
        sizes = {}
        for letter, size in zip(self.input_spec_, input_shape):
            sizes[letter] = size
        sizes[self.split_axis] = split_width
        output = (None,) + self.partial_output_shape
        for letter, size in zip(self.output_spec_, output):
            known = sizes.get(letter)
            if size is not None and known is not None and size != known and \
                    letter != self.split_axis:
                raise ValueError(f"{self.name}: output axis '{letter}' is {size} in "
                                 f"output_shape but {known} in the input.")
            if known is None:
                sizes[letter] = size
        kernel = tuple(sizes[letter] for letter in self.kernel_spec)
        if any(size is None for size in kernel):
            raise ValueError(f"{self.name}: the kernel's shape {kernel} ('{self.kernel_spec}') "
                             f"is not fully known from input shape {tuple(input_shape)} and "
                             f"output_shape {self.partial_output_shape}.")
        bias = None
        if self.bias_axes:
            first = min(self.output_spec_.index(letter) for letter in self.bias_axes)
            bias = tuple(sizes[letter] if letter in self.bias_axes else 1
                         for letter in self.output_spec_[first:])
        return kernel, bias, tuple(sizes[letter] for letter in self.output_spec_)

    def _bias_split_axis(self):
        if not self.bias_axes or self.split_axis not in self.bias_axes:
            return None
        first = min(self.output_spec_.index(letter) for letter in self.bias_axes)
        return self.output_spec_.index(self.split_axis) - first

    def _kernel_initializer_with_fans(self):
        # As EinsumDense does: fans of a variance-scaling initializer come from
        # which kernel axes meet the input and which make the output.
        initializer = self.kernel_initializer
        if not isinstance(initializer, keras.initializers.VarianceScaling) or \
                not hasattr(initializer, "input_axes") or \
                (initializer.input_axes is not None and initializer.output_axes is not None):
            return initializer
        config = initializer.get_config()
        config["seed"] = initializer.seed
        config["output_axes"] = [i for i, letter in enumerate(self.kernel_spec)
                                 if letter in self.output_spec_]
        config["input_axes"] = [i for i, letter in enumerate(self.kernel_spec)
                                if letter not in self.output_spec_]
        return initializer.__class__.from_config(config)

    def _add_weights(self, kernel_shape, bias_shape):
        self.kernel = self._add_split_weight("kernel", kernel_shape,
                                             self.kernel_spec.index(self.split_axis), "kernel",
                                             self._kernel_initializer_with_fans())
        if bias_shape is not None:
            self.bias = self._add_split_weight("bias", bias_shape, self._bias_split_axis(),
                                               "bias")

    def _check_input(self, inputs, split_width):
        if inputs.shape.rank is not None and inputs.shape.rank != len(self.input_spec_):
            raise ValueError(f"{self.name} ({self.equation!r}) takes inputs of rank "
                             f"{len(self.input_spec_)}; got shape {tuple(inputs.shape)}.")
        for position, letter in enumerate(self.input_spec_):
            if letter in self.kernel_spec:
                expected = self.kernel.shape[self.kernel_spec.index(letter)]
                if letter == self.split_axis:
                    expected = split_width
                self._check_width(inputs, position, expected, f"axis '{letter}'")

    def _input_shape_for(self, arrays):
        kernel = arrays[0]
        if kernel.ndim != len(self.kernel_spec):
            raise ValueError(f"{self.name}: the unsplit kernel should have one axis per "
                             f"letter of '{self.kernel_spec}'; got shape {kernel.shape}.")
        shape = []
        for letter in self.input_spec_:
            size = None
            if letter in self.kernel_spec:
                size = kernel.shape[self.kernel_spec.index(letter)]
                if letter == self.split_axis and getattr(self, "input_is_parallel", False):
                    _check_divides(f"The unsplit kernel's axis '{letter}'", size, self.comm)
                    size //= self.comm.size
            shape.append(size)
        return tuple(shape)

    def get_config(self):
        config = super().get_config()
        config.pop("use_bias")
        config.update({"equation": self.equation, "output_shape": self.partial_output_shape,
                       "split_axis": self.split_axis, "bias_axes": self.bias_axes})
        return config


@keras.saving.register_keras_serializable(package="kdist")
class ColumnParallelEinsumDense(_SplitEinsum):
    """A `keras.layers.EinsumDense` split over a group along a kernel axis of the output.

    `split_axis` is the letter of a kernel axis that is also an output axis
    (not an input one), for instance the heads `d` of an attention projection
    `"abc,cde->abde"`. This rank holds its slice of the kernel along that axis
    (and of the bias, if `bias_axes` names it; a bias without it is held whole
    and its gradient summed over the group) and returns its slice of the
    output along it, or all of it with `gather_output=True`. The input must be
    the same on every rank.

    Args:
        equation: as for `keras.layers.EinsumDense` (no `...`).
        output_shape: the unsplit output shape, without the batch axis.
        split_axis: the letter of the kernel axis to split; its size must be
            divisible by the group size.
        group: None (the world), a `kdist.ProcessSet` or a
            `kdist.comm.Communicator`. Not saved in the config.
        bias_axes: as for `keras.layers.EinsumDense`.
        gather_output: return the whole output on every rank.

    The other arguments (`activation`, the initializers, regularizers and
    constraints) are those of `keras.layers.EinsumDense`.

    Example (query projection of 4 heads of 8, each rank computing its heads):

        >>> import numpy as np
        >>> from kdist.tensor_parallel import ColumnParallelEinsumDense
        >>> query = ColumnParallelEinsumDense("abc,cde->abde", (None, 4, 8), split_axis="d",
        ...                                   bias_axes="de")
        >>> query(np.ones((2, 5, 16), "float32")).shape[-2:]  # heads per rank, size of each
        TensorShape([4, 8])
    """

    def __init__(self, equation, output_shape, split_axis, group=None, bias_axes=None,
                 gather_output=False, activation=None, kernel_initializer="glorot_uniform",
                 bias_initializer="zeros", kernel_regularizer=None, bias_regularizer=None,
                 kernel_constraint=None, bias_constraint=None, **kwargs):
        super().__init__(equation, output_shape, split_axis, group, bias_axes, activation,
                         kernel_initializer, bias_initializer, kernel_regularizer,
                         bias_regularizer, kernel_constraint, bias_constraint, **kwargs)
        if split_axis not in self.output_spec_ or split_axis in self.input_spec_:
            raise ValueError(f"A column-parallel split needs a kernel axis that is an output "
                             f"axis and not an input one; '{split_axis}' in "
                             f"{self.equation!r} is not (a contracted axis splits with "
                             "RowParallelEinsumDense).")
        position = self.output_spec_.index(split_axis)
        width = self.partial_output_shape[position - 1] if position else None
        if width is None:
            raise ValueError(f"output_shape must give the size of the split axis "
                             f"'{split_axis}'; got {self.partial_output_shape}.")
        _check_divides(f"Axis '{split_axis}' of the output", width, self.comm)
        self.gather_output = bool(gather_output)
        if not self.gather_output:
            _refuse_softmax_on_a_slice(self)
        # TensorParallelMultiHeadAttention copies each input to the group once
        # for its three projections, and turns this off.
        self._copy_input = True

    def _split_width(self):
        return self.partial_output_shape[self.output_spec_.index(self.split_axis) - 1]

    def build(self, input_shape):
        kernel, bias, _ = self._shapes(tuple(input_shape), self._split_width())
        self._add_weights(kernel, bias)

    def call(self, inputs):
        inputs = tf.convert_to_tensor(inputs)
        self._check_input(inputs, None)
        if self._copy_input:
            inputs = copy_to_group(inputs, self.comm, label=f"input of {self.name}")
        x = keras.ops.einsum(self.equation, inputs, self.kernel)
        if self.bias is not None:
            bias = tf.convert_to_tensor(self.bias.value)
            if self._split_axes["bias"] is None:
                bias = copy_to_group(bias, self.comm, label=f"bias of {self.name}")
            x = keras.ops.add(x, bias)
        if self.gather_output:
            x = gather_from_group(x, self.comm, self.output_spec_.index(self.split_axis),
                                  label=f"output of {self.name}")
        return self._finish(x)

    def compute_output_shape(self, input_shape):
        shape = list(self._shapes(tuple(input_shape), self._split_width())[2])
        shape[0] = input_shape[0]
        if not self.gather_output:
            shape[self.output_spec_.index(self.split_axis)] //= self.comm.size
        return tuple(shape)

    def get_config(self):
        config = super().get_config()
        config["gather_output"] = self.gather_output
        return config


@keras.saving.register_keras_serializable(package="kdist")
class RowParallelEinsumDense(_SplitEinsum):
    """A `keras.layers.EinsumDense` split over a group along a contracted kernel axis.

    `split_axis` is the letter of a kernel axis that is an input axis and not
    an output one, for instance the heads `c` of an attention output
    projection `"abcd,cde->abe"`. This rank holds its slice of the kernel
    along it and takes its slice of the input along it (or the whole input,
    with `input_is_parallel=False`); the partial results are summed over the
    group, then the bias (held whole on every rank) is added once.

    Args:
        equation: as for `keras.layers.EinsumDense` (no `...`).
        output_shape: the output shape, without the batch axis.
        split_axis: the letter of the contracted kernel axis to split.
        group: None (the world), a `kdist.ProcessSet` or a
            `kdist.comm.Communicator`. Not saved in the config.
        bias_axes: as for `keras.layers.EinsumDense`.
        input_is_parallel: True when the input is already this rank's slice
            along `split_axis` (what a `ColumnParallelEinsumDense` returns).

    The other arguments are those of `keras.layers.EinsumDense`.

    Example (the output projection of 4 heads of 8 back to 16 features):

        >>> import numpy as np
        >>> from kdist.tensor_parallel import RowParallelEinsumDense
        >>> output = RowParallelEinsumDense("abcd,cde->abe", (None, 16), split_axis="c",
        ...                                 bias_axes="e", input_is_parallel=False)
        >>> output(np.ones((2, 5, 4, 8), "float32")).shape
        TensorShape([2, 5, 16])
    """

    def __init__(self, equation, output_shape, split_axis, group=None, bias_axes=None,
                 input_is_parallel=True, activation=None, kernel_initializer="glorot_uniform",
                 bias_initializer="zeros", kernel_regularizer=None, bias_regularizer=None,
                 kernel_constraint=None, bias_constraint=None, **kwargs):
        super().__init__(equation, output_shape, split_axis, group, bias_axes, activation,
                         kernel_initializer, bias_initializer, kernel_regularizer,
                         bias_regularizer, kernel_constraint, bias_constraint, **kwargs)
        if split_axis not in self.input_spec_ or split_axis in self.output_spec_:
            raise ValueError(f"A row-parallel split needs a kernel axis that is contracted "
                             f"(an input axis, not an output one); '{split_axis}' in "
                             f"{self.equation!r} is not (an output axis splits with "
                             "ColumnParallelEinsumDense).")
        self.input_is_parallel = bool(input_is_parallel)
        self._position = self.input_spec_.index(split_axis)

    def build(self, input_shape):
        input_shape = tuple(input_shape)
        if len(input_shape) != len(self.input_spec_):
            raise ValueError(f"{self.name} ({self.equation!r}) takes inputs of rank "
                             f"{len(self.input_spec_)}; got shape {input_shape}.")
        width = input_shape[self._position]
        if width is None:
            raise ValueError(f"{self.name} needs the size of input axis '{self.split_axis}'; "
                             f"got input shape {input_shape}.")
        if self.input_is_parallel:
            width *= self.comm.size
        else:
            _check_divides(f"{self.name}'s input axis '{self.split_axis}'", width, self.comm)
        kernel, bias, _ = self._shapes(input_shape, width)
        self._add_weights(kernel, bias)

    def call(self, inputs):
        inputs = tf.convert_to_tensor(inputs)
        local = self.kernel.shape[self.kernel_spec.index(self.split_axis)]
        if self.input_is_parallel:
            self._check_input(inputs, local)
        else:
            self._check_input(inputs, local * self.comm.size)
            inputs = scatter_to_group(inputs, self.comm, self._position,
                                      label=f"input of {self.name}")
        x = reduce_from_group(keras.ops.einsum(self.equation, inputs, self.kernel), self.comm,
                              label=f"output of {self.name}")
        if self.bias is not None:
            x = keras.ops.add(x, self.bias)
        return self._finish(x)

    def compute_output_shape(self, input_shape):
        input_shape = tuple(input_shape)
        width = input_shape[self._position]
        if width is not None and self.input_is_parallel:
            width *= self.comm.size
        shape = list(self._shapes(input_shape, width)[2])
        shape[0] = input_shape[0]
        return tuple(shape)

    def get_config(self):
        config = super().get_config()
        config["input_is_parallel"] = self.input_is_parallel
        return config
