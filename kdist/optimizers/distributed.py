"""An optimizer that averages gradients across ranks before applying them."""

import contextlib
import logging

import keras
import numpy as np
from keras import ops

from kdist.comm import compression as compression_lib
from kdist.comm import fusion
from kdist.comm import processes
from kdist.comm import tensors

logger = logging.getLogger(__name__)


@keras.saving.register_keras_serializable(package="kdist")
class AllreduceOptimizer(keras.optimizers.Optimizer):
    """Wraps a Keras optimizer so that every rank applies the same averaged gradient.

    Gradients are packed into buckets (one collective per bucket, one bucket
    for most models) and averaged over the ranks before the wrapped optimizer
    applies them, so all ranks keep identical weights. Most users reach this
    class through `kdist.DistributedOptimizer`, Horovod's name for it.

    Args:
        optimizer: the `keras.optimizers.Optimizer` to wrap.
        compression: `kdist.Compression.none` (default), `.fp16` or `.topk(ratio)`.
        backward_passes_per_step: accumulate this many local gradients before
            each allreduce and update.
        average_aggregated_gradients: with `backward_passes_per_step > 1`,
            divide the accumulated gradient by that number.
        bucket_bytes: most bytes of gradient per collective.
        num_groups: if positive, split the gradients into about this many
            collectives of equal size instead (overrides `bucket_bytes`).
        name: the optimizer's name.

    Example:

    >>> import keras, kdist
    >>> opt = kdist.optimizers.AllreduceOptimizer(keras.optimizers.Adam(1e-3))
    >>> opt.learning_rate.numpy().item() == keras.ops.convert_to_numpy(
    ...     opt.inner_optimizer.learning_rate).item()
    True
    """

    def __init__(self, optimizer, compression=None, backward_passes_per_step=1,
                 average_aggregated_gradients=False, bucket_bytes=fusion.DEFAULT_BUCKET_BYTES,
                 num_groups=0, name=None, comm=None, **kwargs):
        if isinstance(optimizer, str) or isinstance(optimizer, dict):
            optimizer = keras.optimizers.get(optimizer)
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            raise TypeError(
                "DistributedOptimizer wraps a Keras 3 optimizer (keras.optimizers.Optimizer); "
                f"got {type(optimizer).__name__}. A tf_keras or Keras 2 optimizer cannot be "
                "used with Keras 3 models.")
        if isinstance(optimizer, AllreduceOptimizer):
            raise ValueError("This optimizer already averages gradients across ranks; "
                             "wrap the plain optimizer once.")
        if int(backward_passes_per_step) < 1:
            raise ValueError("backward_passes_per_step must be at least 1; "
                             f"got {backward_passes_per_step}.")
        if kwargs:
            raise TypeError(f"Unexpected arguments: {sorted(kwargs)}.")
        super().__init__(learning_rate=0.0, name=name or f"distributed_{optimizer.name}")
        self.inner_optimizer = optimizer
        self.compression = compression_lib.get(compression)
        self.backward_passes_per_step = int(backward_passes_per_step)
        self.average_aggregated_gradients = bool(average_aggregated_gradients)
        self.bucket_bytes = int(bucket_bytes)
        self.num_groups = int(num_groups or 0)
        if self.num_groups < 0:
            raise ValueError(f"num_groups must be 0 or positive; got {num_groups}.")
        self._comm = comm
        self._reducer = None
        self._upstream = False
        self.loss_scale_agreed = False
        # This wrapper's own variables that exist before `build` (Keras's step
        # count and learning rate, both unused: the inner optimizer's count).
        self._variables_before_build = len(self._variables)
        # State given to `set_weights` before there were variables to hold it.
        self._pending_state = None

    # Read by kdist.precision.LossScaleOptimizer, which averages before it checks.
    reduces_gradients = True

    @contextlib.contextmanager
    def reduced_upstream(self):
        """While tracing inside it, `apply` takes gradients that are already averaged."""
        self._upstream = True
        try:
            yield
        finally:
            self._upstream = False

    @property
    def comm(self):
        return self._comm if self._comm is not None else processes.world()

    def build(self, var_list):
        if not var_list and not self.built:
            # Keras's .h5 loader builds the optimizer with the model's own
            # variables, none for a model made of layers; an inner optimizer
            # built for no variables would refuse the model's. Stay unbuilt
            # until the model's variables come (`fit` builds before the first step).
            return
        policy = keras.config.dtype_policy()
        if policy.name == "mixed_float16" and not self.loss_scale_agreed and self.comm.size > 1:
            raise ValueError(
                "The dtype policy is mixed_float16 but this DistributedOptimizer was created "
                "before it was set, so Keras would check for overflow on each rank alone and "
                "ranks could disagree about skipping a step. Call "
                "kdist.precision.enable('mixed_float16') before kdist.DistributedOptimizer(...).")
        if self.backward_passes_per_step > 1:
            self._accumulators = [
                self.add_variable_from_reference(v, name="gradient_accumulator")
                for v in var_list
            ]
            self._passes = self.add_variable(
                shape=(), dtype="int32", initializer="zeros", aggregation="none",
                name="backward_passes")
        self.inner_optimizer.build(var_list)
        super().build(var_list)
        if self._pending_state is not None:
            state, self._pending_state = self._pending_state, None
            import tensorflow as tf

            # `build` may run while a train step is traced: assign now, once.
            with tf.init_scope():
                _assign(self.variables, state, self.name)

    @property
    def variables(self):
        # The inner optimizer's variables come right after this wrapper's first
        # ones and before what `build` adds, so that the position of every
        # variable that exists before `build` is the same as after it.
        own, first = self._variables, self._variables_before_build
        return own[:first] + self.inner_optimizer.variables + own[first:]

    def set_weights(self, weights):
        """Sets this optimizer's state: values in the order of `variables`.

        Before the optimizer is built (Keras's .h5 loader restores it that way)
        the step count and learning rate are set at once and the rest when
        `build` creates the variables for the model.
        """
        values = [np.asarray(w) for w in weights]
        if self.built:
            _assign(self.variables, values, self.name)
            return
        existing = self.variables
        if len(values) < len(existing):
            raise ValueError(f"Optimizer {self.name!r} has {len(existing)} variables before "
                             f"it is built but got {len(values)} values.")
        _assign(existing, values[:len(existing)], self.name)
        self._pending_state = values

    @property
    def iterations(self):
        return self.inner_optimizer.iterations

    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        self.inner_optimizer.learning_rate = learning_rate

    def scale_loss(self, loss):
        return self.inner_optimizer.scale_loss(loss)

    def finalize_variable_values(self, var_list):
        self.inner_optimizer.finalize_variable_values(var_list)

    def apply(self, grads, trainable_variables=None):
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables or self._trainable_variables)
            self.built = True
        grads = list(grads)
        upstream = self._upstream or _strategy_reduces()
        reduce = (lambda g: g) if upstream else self.allreduce_gradients
        if self.backward_passes_per_step == 1:
            self.inner_optimizer.apply(reduce(grads), trainable_variables)
            return
        for accumulator, g in zip(self._accumulators, grads):
            if g is not None:
                accumulator.assign_add(ops.cast(_dense(g), accumulator.dtype))
        self._passes.assign_add(1)

        def update():
            scale = 1.0 / self.backward_passes_per_step if self.average_aggregated_gradients else 1.0
            summed = [None if g is None else ops.multiply(a, scale)
                      for a, g in zip(self._accumulators, grads)]
            self.inner_optimizer.apply(reduce(summed), trainable_variables)
            for accumulator in self._accumulators:
                accumulator.assign(ops.zeros_like(accumulator))
            self._passes.assign(0)

        ops.cond(ops.equal(self._passes, self.backward_passes_per_step), update, lambda: None)

    def allreduce_gradients(self, grads):
        """Returns the gradients averaged over all ranks (None entries stay None)."""
        if self._reducer is None:
            self._reducer = tensors.TensorReducer(
                self._comm, self.compression, average=True, bucket_bytes=self.bucket_bytes,
                num_groups=self.num_groups, name=self.name)
        return self._reducer(grads)

    def get_config(self):
        return {
            "name": self.name,
            "optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            "compression": self.compression.get_config(),
            "backward_passes_per_step": self.backward_passes_per_step,
            "average_aggregated_gradients": self.average_aggregated_gradients,
            "bucket_bytes": self.bucket_bytes,
            "num_groups": self.num_groups,
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        config["optimizer"] = keras.saving.deserialize_keras_object(
            config["optimizer"], custom_objects=custom_objects)
        return cls(**config)


def _assign(variables, values, owner):
    """Assigns `values` to `variables` in order, after checking count and shapes."""
    if len(values) != len(variables):
        raise ValueError(
            f"The optimizer state given to {owner!r} has {len(values)} values but the "
            f"optimizer has {len(variables)} variables: it was saved from an optimizer "
            "built for other variables. Load it into the model it was saved with.")
    for variable, value in zip(variables, values):
        if tuple(value.shape) != tuple(variable.shape):
            raise ValueError(
                f"The optimizer state given to {owner!r} has shape {tuple(value.shape)} "
                f"for variable '{variable.path}' of shape {tuple(variable.shape)}.")
    for variable, value in zip(variables, values):
        variable.assign(value)


def _strategy_reduces():
    """Whether an MPIStrategy is active: it sums the gradients itself, in the inner optimizer."""
    import tensorflow as tf

    from kdist.distribute.mpi_strategy import MPIStrategy

    return isinstance(tf.distribute.get_strategy(), MPIStrategy)


def _dense(gradient):
    import tensorflow as tf

    if isinstance(gradient, tf.IndexedSlices):
        return tf.convert_to_tensor(gradient)
    return gradient


def DistributedOptimizer(optimizer, name=None, compression=None, backward_passes_per_step=1,
                         average_aggregated_gradients=False, sparse_as_dense=True,
                         device_dense="", device_sparse="", gradient_predivide_factor=1.0,
                         op=None, num_groups=0, groups=None, bucket_bytes=None, comm=None):
    """Horovod's `DistributedOptimizer` for Keras 3: averages gradients over ranks.

    Takes Horovod's arguments. Sparse gradients are always reduced as dense;
    `device_dense`/`device_sparse` are accepted for compatibility (reduction
    happens on the host); `gradient_predivide_factor` changes nothing in an
    average computed in float32 and is accepted for compatibility.
    `num_groups` splits the gradients into that many collectives.

    Under the `mixed_float16` policy (see `kdist.precision.enable`) the result
    also scales the loss, and whether gradients overflowed is decided by all
    ranks together, so every rank skips the same steps.

    Example:

    >>> import keras, kdist
    >>> opt = kdist.DistributedOptimizer(keras.optimizers.Adam(1e-3),
    ...                                  compression=kdist.Compression.fp16)
    """
    from kdist.comm.processes import Average, Sum

    if op not in (None, Average):
        raise ValueError(f"DistributedOptimizer averages gradients; op={op!r} is not supported."
                         + (" Use op=kdist.Average." if op == Sum else ""))
    if groups is not None:
        raise ValueError("Explicit gradient `groups` are not supported; use num_groups=N or "
                         "bucket_bytes=... to control how gradients are fused.")
    if bucket_bytes is None:
        bucket_bytes = fusion.DEFAULT_BUCKET_BYTES
    from kdist import precision

    scaling = {}
    inner_scaled = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
    if inner_scaled:
        # Ours must be the outer wrapper so that overflow is decided collectively;
        # the user's scale settings carry over.
        scaling = {"initial_scale": optimizer.initial_scale,
                   "dynamic_growth_steps": optimizer.dynamic_growth_steps}
        optimizer = optimizer.inner_optimizer
    wrapped = AllreduceOptimizer(
        optimizer, compression=compression, backward_passes_per_step=backward_passes_per_step,
        average_aggregated_gradients=average_aggregated_gradients, bucket_bytes=bucket_bytes,
        num_groups=num_groups, name=name, comm=comm)
    if inner_scaled or precision.loss_scaling_enabled():
        return precision.LossScaleOptimizer(wrapped, **scaling)
    return wrapped
