"""What every split layer shares: the group, weight slices, loading and gathering."""

import keras
import numpy as np
import tensorflow as tf

from kdist.comm import job
from kdist.comm.communicator import Communicator
from kdist.comm.differentiable import (
    gather_from_group,
)
from kdist.comm.process_sets import ProcessSet, communicator_of


def resolve_group(group):
    """The `Communicator` a layer's group names: None (the world), a `kdist.ProcessSet`
    or a `Communicator`."""
    if group is None:
        return job.world()
    if isinstance(group, Communicator):
        return group
    if isinstance(group, ProcessSet):
        return communicator_of(group)
    raise TypeError("group must be None (the world), a kdist.ProcessSet or a "
                    f"kdist.comm.Communicator; got {type(group).__name__}.")


class _Slice:
    """An initializer that draws the unsplit weight and keeps this rank's slice of it."""

    def __init__(self, initializer, full_shape, axis, comm):
        self.initializer, self.full_shape = initializer, tuple(full_shape)
        self.axis, self.comm = axis, comm

    def __call__(self, shape, dtype=None):
        full = self.initializer(self.full_shape, dtype=dtype)
        return tf.split(full, self.comm.size, axis=self.axis)[self.comm.rank]


def _fresh(initializer):
    # A seeded initializer gives the same values at each call: weights of
    # sublayers get their own copy, as in keras.layers.MultiHeadAttention.
    return initializer.__class__.from_config(initializer.get_config())


def _arrays_of(full, what):
    if isinstance(full, keras.layers.Layer):
        if not full.built:
            raise ValueError(f"load_from_full needs a built {type(full).__name__}; call it on "
                             "data or build it first.")
        return [np.asarray(w) for w in full.get_weights()]
    if isinstance(full, (list, tuple)):
        return [np.asarray(w) for w in full]
    raise TypeError(f"load_from_full takes {what} or a list of its weights (numpy arrays); got "
                    f"{type(full).__name__}.")


def _check_positive(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"{name} must be a positive integer; got {value!r}.")


def _check_divides(what, value, comm):
    if value % comm.size:
        raise ValueError(f"{what} ({value}) must be divisible by the group's size "
                         f"({comm.size}), to give every rank an equal slice.")


class _Split(keras.layers.Layer):
    """What every split layer shares: the group, kernel and bias, and their layout."""

    def __init__(self, group=None, activation=None, use_bias=True,
                 kernel_initializer="glorot_uniform", bias_initializer="zeros",
                 kernel_regularizer=None, bias_regularizer=None, kernel_constraint=None,
                 bias_constraint=None, **kwargs):
        super().__init__(**kwargs)
        self.comm = resolve_group(group)
        self.activation = keras.activations.get(activation)
        self.use_bias = bool(use_bias)
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)
        self.kernel_regularizer = keras.regularizers.get(kernel_regularizer)
        self.bias_regularizer = keras.regularizers.get(bias_regularizer)
        self.kernel_constraint = keras.constraints.get(kernel_constraint)
        self.bias_constraint = keras.constraints.get(bias_constraint)
        self.bias = None
        # Weight name -> the axis it is split along (None: replicated), in the
        # order the unsplit Keras layer lists its weights.
        self._split_axes = {}

    @property
    def group_size(self):
        """How many ranks the layer is split over."""
        return self.comm.size

    @property
    def group_rank(self):
        """This rank's place in the group: which slice it holds."""
        return self.comm.rank

    def _add_split_weight(self, name, full_shape, axis, kind, initializer=None):
        shape = list(full_shape)
        if axis is not None:
            shape[axis] //= self.comm.size
        initializer = initializer or getattr(self, f"{kind}_initializer")
        if axis is not None and self.comm.size > 1:
            initializer = _Slice(initializer, full_shape, axis, self.comm)
        variable = self.add_weight(name=name, shape=tuple(shape), initializer=initializer,
                                   regularizer=getattr(self, f"{kind}_regularizer"),
                                   constraint=getattr(self, f"{kind}_constraint"))
        self._split_axes[name] = axis
        return variable

    def _full_shapes(self):
        shapes = []
        for name, axis in self._split_axes.items():
            shape = list(getattr(self, name).shape)
            if axis is not None:
                shape[axis] *= self.comm.size
            shapes.append(tuple(shape))
        return shapes

    def _input_shape_for(self, arrays):
        raise NotImplementedError

    def full_weights(self):
        """The unsplit layer's weights (numpy arrays, in its order), gathered from the group.

        A collective, run eagerly: every rank of the group must call it. The
        result fits the unsplit Keras layer's `set_weights` and this layer's
        `load_from_full`.
        """
        if not self.built:
            raise ValueError(f"{self.name} is not built yet: it has no weights to gather.")
        weights = []
        for name, axis in self._split_axes.items():
            value = tf.convert_to_tensor(getattr(self, name).value)
            if axis is not None:
                value = gather_from_group(value, self.comm, axis,
                                          label=f"full weights of {self.name}/{name}")
            weights.append(value.numpy())
        return weights

    def load_from_full(self, full):
        """Sets this rank's slices from the unsplit layer's weights.

        Args:
            full: the unsplit Keras layer (built), or the list of its weights
                as its `get_weights()` gives them (kernel, then bias).

        An unbuilt layer is built from the shapes of those weights.
        """
        arrays = _arrays_of(full, f"the unsplit layer of a {type(self).__name__}")
        if not arrays:
            raise ValueError(f"load_from_full got no weights for {self.name}.")
        if not self.built:
            self.build(self._input_shape_for(arrays))
        names = list(self._split_axes)
        if len(arrays) != len(names):
            raise ValueError(f"{self.name} holds {len(names)} weights ({', '.join(names)}); "
                             f"load_from_full got {len(arrays)}.")
        for name, array, shape in zip(names, arrays, self._full_shapes()):
            if tuple(array.shape) != shape:
                raise ValueError(f"{self.name}: the unsplit {name} should have shape {shape}; "
                                 f"got {tuple(array.shape)}.")
        for name, array in zip(names, arrays):
            axis = self._split_axes[name]
            if axis is not None:
                array = np.split(array, self.comm.size, axis=axis)[self.comm.rank]
            getattr(self, name).assign(array)

    def _check_width(self, inputs, axis, expected, what):
        width = inputs.shape[axis] if inputs.shape.rank is not None else None
        if width is not None and width != expected:
            raise ValueError(f"{self.name} expects {what} of width {expected} on axis {axis}; "
                             f"got an input of shape {tuple(inputs.shape)}.")

    def _finish(self, outputs):
        return outputs if self.activation is None else self.activation(outputs)

    def get_config(self):
        config = super().get_config()
        config.update({
            "activation": keras.activations.serialize(self.activation),
            "use_bias": self.use_bias,
            "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
            "bias_initializer": keras.initializers.serialize(self.bias_initializer),
            "kernel_regularizer": keras.regularizers.serialize(self.kernel_regularizer),
            "bias_regularizer": keras.regularizers.serialize(self.bias_regularizer),
            "kernel_constraint": keras.constraints.serialize(self.kernel_constraint),
            "bias_constraint": keras.constraints.serialize(self.bias_constraint),
        })
        return config


def _refuse_softmax_on_a_slice(layer):
    # Elementwise activations may act on each slice; a softmax needs the whole output.
    if layer.activation in (keras.activations.softmax, keras.activations.log_softmax):
        raise ValueError(f"{type(layer).__name__} with a softmax activation needs "
                         "gather_output=True: a softmax over this rank's slice of the outputs "
                         "is not the slice of the softmax.")
