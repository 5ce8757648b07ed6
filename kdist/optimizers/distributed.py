"""An optimizer that averages gradients across ranks before applying them.

Two gradient protocols meet here. Keras 3 hands the optimizer this rank's own
gradients (`apply`, `apply_gradients`, which `fit` and custom loops call);
they are reduced across ranks once, inside the wrapper. Horovod's TF-Keras-2
protocol reduces them earlier, in `_compute_gradients`, and passes the result
to `apply_gradients`; those must not be reduced again. The wrapper tells the
two apart by a hand-off: `_compute_gradients` leaves a note naming the
variables and the context it ran in (eager, or the function being traced),
and the next `apply_gradients` for the same variables in that context takes
it. Gradients transformed in between (clipped, say) still count as reduced.
"""

import contextlib
import logging
import types
import weakref

import keras
import numpy as np
from keras import ops

from kdist import _args, _keras_private
from kdist._variables import assign_all, path_of as _path
from kdist.comm import collectives
from kdist.comm.processes import Average, Communicator, Sum
from kdist.coordination import consistency, team
from kdist.optimizers import reduction as reduction_lib
from kdist.optimizers.aggregation import LocalGradientAggregator
from kdist.optimizers.reduction import is_variable as _is_variable

logger = logging.getLogger(__name__)


@keras.saving.register_keras_serializable(package="kdist")
class AllreduceOptimizer(keras.optimizers.Optimizer):
    """Wraps a Keras optimizer so that every rank applies the same reduced gradient.

    The class behind `kdist.DistributedOptimizer` (Horovod's name for it, which most
    users call), a `keras.optimizers.Optimizer`. Gradients are packed into buckets (one
    collective per bucket, one bucket for most models) and averaged (or summed) over the
    ranks before the wrapped optimizer applies them, so all ranks keep identical weights.
    Before the first update it checks that the ranks start from the same weights, as
    `kdist.DistributedOptimizer` describes.

    The wrapper reads like the optimizer it wraps: an attribute it does not have itself
    comes from the wrapped optimizer (`opt.momentum`, `opt.nesterov`, `opt.beta_1`), and
    `learning_rate` and `iterations` are the wrapped optimizer's. It is not an instance of
    the wrapped class: `isinstance(opt, keras.optimizers.SGD)` is False; test
    `isinstance(opt.inner_optimizer, keras.optimizers.SGD)` instead. A name neither has
    raises `AttributeError` naming both.

    Two ways to hand it gradients, both reducing them exactly once:

    - Keras 3's: `apply(grads, trainable_variables)` (what `model.fit` calls) and
      `apply_gradients(grads_and_vars)` take this rank's own gradients and reduce them.
    - Horovod's: `compute_gradients(loss, var_list, tape=None)` and
      `_compute_gradients(loss, var_list, grad_loss=None, tape=None)` return
      `[(gradient, variable)]` with the gradients already reduced; `loss` is a function
      of no arguments, or a tensor computed under `tape` (a tensor loss without a tape
      raises `ValueError`). Passing the result to `apply_gradients` in the same context
      (eagerly, or in the same traced function) applies it without reducing it again,
      also after a transformation such as clipping. `minimize(loss, var_list,
      grad_loss=None, name=None, tape=None)` does both. `apply_gradients` accepts and
      ignores TF-Keras 2 keywords (`experimental_aggregate_gradients=...`) and returns
      `iterations`.

    With `backward_passes_per_step=N > 1` each backward pass adds this rank's gradients
    to accumulators (sparse gradients too: the accumulators are dense); every N-th pass
    reduces the sums (divided by N with `average_aggregated_gradients`), applies them and
    resets the accumulators by assigning zeros. Through Horovod's protocol,
    `_compute_gradients` returns the reduced sums on that pass and the local sums so far
    on the others, and `apply_gradients` applies only after a reduction.

    It is registered with Keras serialization, so a model compiled with it saves to
    `.keras` or `.h5` and loads with `keras.models.load_model` once kdist is imported,
    with its state (step count and slots). Keras's `.h5` loader builds an optimizer for
    no variables (it asks the model for its own, and a model made of layers has none);
    this optimizer then stays unbuilt, restores its step count at once and the rest when
    `fit` (or a kdist callback) builds it for the model's variables. `get_config()` holds
    every argument (the wrapped optimizer serialised, groups and local variables as
    variable paths) and `from_config(config)` rebuilds the optimizer.

    On more than one rank, building it under the `mixed_float16` policy without kdist's
    loss scaling raises `ValueError`: the policy was set after the optimizer was created,
    so ranks could disagree about skipping a step. Call `kdist.precision.enable` first,
    or wrap it in `kdist.precision.LossScaleOptimizer`.

    Args:
        optimizer: the Keras 3 optimizer to wrap, or its name or config (`"adam"`).
        compression: `kdist.Compression.none` (default), `.fp16` or `.topk(ratio)`.
        backward_passes_per_step: sum this many local gradients before each
            allreduce and update (a whole number, at least 1).
        average_aggregated_gradients: with `backward_passes_per_step > 1`,
            divide the summed gradient by that number.
        bucket_bytes: most bytes of gradient per collective; None (the default):
            `KDIST_BUCKET_BYTES` where set, else 64 MiB on one host and a quarter of the
            gradient (1-64 MiB) when the job spans hosts, so that buckets overlap the
            backward pass (`kdist plan --measure` recommends a size).
        num_groups: if positive, split the gradients into about this many
            collectives of equal size instead (overrides `bucket_bytes`).
        name: the optimizer's name; default `"distributed_" + optimizer.name`.
        comm: the `kdist.comm.Communicator` to reduce over (the world by default). There
            is no `process_set` here: `kdist.DistributedOptimizer` takes one.
        op: `kdist.Average` (None, the default) or `kdist.Sum`.
        gradient_predivide_factor: with `op=kdist.Average`, scale gradients by
            `1 / f` before the sum and by `f / size` after it.
        sparse_as_dense: reduce `tf.IndexedSlices` gradients (embeddings) as
            dense tensors; when False they are exchanged with two allgathers
            (indices and values), which costs less for sparse updates.
        groups: a number of groups (same as `num_groups`), or a list of lists
            of variables (or variable paths): each list travels in one
            collective, variables in no list travel alone.
        local_variables: variables, layers or variable paths whose gradients
            stay on this rank (see `register_local_var`).
        scale_local_gradients: divide local variables' gradients by the
            number of ranks, as Horovod does.

    Attributes:
        inner_optimizer: the wrapped optimizer.
        learning_rate: the wrapped optimizer's learning rate; assigning to it sets the
            wrapped optimizer's.
        iterations: the wrapped optimizer's step counter. It counts every backward pass,
            also the passes that only accumulate.
        variables: the wrapper's own step count and learning rate (both unused) and, with
            `backward_passes_per_step > 1`, its pass counter; then the wrapped optimizer's
            variables; then the gradient accumulators. `set_weights` takes values in this
            order.
        comm: the `kdist.comm.Communicator` it reduces over.
        op: `kdist.Average` or `kdist.Sum`. Like it, `compression`,
            `backward_passes_per_step`, `average_aggregated_gradients`,
            `gradient_predivide_factor`, `sparse_as_dense`, `bucket_bytes`, `num_groups`
            and `scale_local_gradients` hold the arguments as given.
        groups: the explicit groups (lists of variables or paths), or None; a number of
            groups is in `num_groups`.
        _agg_helper: with `backward_passes_per_step > 1`, the
            `kdist.optimizers.LocalGradientAggregator` (Horovod's name for it): its
            `counter` variable holds the passes since the last reduction, `accumulators`
            the sums. None otherwise.
        reduces_gradients: True. `kdist.precision.LossScaleOptimizer` reads it to reduce
            the gradients itself, before checking them (see `reduced_upstream`).

    Raises:
        TypeError: `optimizer` is not a Keras 3 optimizer (a TF-Keras 2 one gets the name
            of the Keras 3 class to use); an unknown keyword argument; anything
            `register_local_var` refuses in `local_variables`.
        ValueError: `optimizer` is already an `AllreduceOptimizer`; `num_groups < 0`; the
            argument errors listed under `kdist.DistributedOptimizer`.

    Example:

        >>> import keras, kdist
        >>> opt = kdist.optimizers.AllreduceOptimizer(keras.optimizers.Adam(1e-3))
        >>> opt.learning_rate.numpy().item() == keras.ops.convert_to_numpy(
        ...     opt.inner_optimizer.learning_rate).item()
        True
    """

    def __init__(self, optimizer, compression=None, backward_passes_per_step=1,
                 average_aggregated_gradients=False, bucket_bytes=None,
                 num_groups=0, name=None, comm=None, op=None, gradient_predivide_factor=1.0,
                 sparse_as_dense=False, groups=None, local_variables=None,
                 scale_local_gradients=True, **kwargs):
        if isinstance(optimizer, (str, dict)):
            optimizer = keras.optimizers.get(optimizer)
        _check_keras3_optimizer(optimizer)
        if isinstance(optimizer, AllreduceOptimizer):
            raise ValueError("This optimizer already averages gradients across ranks; "
                             "wrap the plain optimizer once.")
        if kwargs:
            raise TypeError(f"Unexpected arguments: {sorted(kwargs)}.")
        backward_passes_per_step = _args.whole_number(
            backward_passes_per_step, "backward_passes_per_step", minimum=1)
        name = name or f"distributed_{optimizer.name}"
        # Plain Python state outside Keras's tracking: Keras scans an optimizer's
        # list and tuple attributes for variables and would adopt the model's as its own.
        reduction = reduction_lib.GradientReduction(
            comm, compression, op, bucket_bytes=bucket_bytes, num_groups=num_groups,
            groups=groups, gradient_predivide_factor=gradient_predivide_factor,
            sparse_as_dense=sparse_as_dense, scale_local_gradients=scale_local_gradients,
            name=name)
        super().__init__(learning_rate=0.0, name=name)
        self._gradient_reduction = reduction
        self.backward_passes_per_step = backward_passes_per_step
        self._state = types.SimpleNamespace(handoff=None, norms=None)
        self.inner_optimizer = optimizer
        self.average_aggregated_gradients = bool(average_aggregated_gradients)
        for source in _as_list(local_variables):
            self.register_local_var(source)
        self._upstream = False
        self.loss_scale_agreed = False
        self._agg_helper = None
        if self.backward_passes_per_step > 1:
            self._agg_helper = LocalGradientAggregator(
                self, self.backward_passes_per_step, self.average_aggregated_gradients)
        # This wrapper's own variables that exist before `build` (Keras's step
        # count and learning rate, both unused, and the pass counter): their
        # positions do not change when `build` adds the inner optimizer's.
        self._variables_before_build = len(super().variables)
        # State given to `set_weights` before there were variables to hold it.
        self._pending_state = None

    # Read by kdist.precision.LossScaleOptimizer, which averages before it checks.
    reduces_gradients = True

    @contextlib.contextmanager
    def reduced_upstream(self):
        """While tracing inside it, `apply` takes gradients that are already averaged.

        `kdist.precision.LossScaleOptimizer` reduces the gradients itself (with
        `allreduce_gradients`) before it checks them for overflow, then applies them
        inside this context so that they are not reduced a second time.
        """
        self._upstream = True
        try:
            yield
        finally:
            self._upstream = False

    def __getattr__(self, name):
        # Reached only when the wrapper has no such attribute: the wrapped
        # optimizer's hyper-parameters (`momentum`, `beta_1`, `nesterov`) read
        # as they would on the optimizer itself. Private names stay private.
        inner = self.__dict__.get("inner_optimizer")
        if name.startswith("_") or inner is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        try:
            return getattr(inner, name)
        except AttributeError:
            raise AttributeError(
                f"{type(self).__name__!r} object has no attribute {name!r}, nor has the "
                f"{type(inner).__name__} it wraps") from None

    @property
    def comm(self):
        return self._gradient_reduction.comm

    # The reduction's settings, read-only: they are fixed when the optimizer is made.
    op = property(lambda self: self._gradient_reduction.op)
    compression = property(lambda self: self._gradient_reduction.compression)
    bucket_bytes = property(lambda self: self._gradient_reduction.bucket_bytes)
    num_groups = property(lambda self: self._gradient_reduction.num_groups)
    gradient_predivide_factor = property(
        lambda self: self._gradient_reduction.gradient_predivide_factor)
    sparse_as_dense = property(lambda self: self._gradient_reduction.sparse_as_dense)
    scale_local_gradients = property(lambda self: self._gradient_reduction.scale_local_gradients)
    # The bucket plans made so far, per fusion grouping.
    _reducers = property(lambda self: self._gradient_reduction.reducers)

    @property
    def groups(self):
        """The explicit fusion groups (lists of variables or paths), or None."""
        return self._gradient_reduction.groups

    # -- variables ---------------------------------------------------------------------------

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
        super().build(var_list)
        if self._agg_helper is not None:
            self._agg_helper.build(var_list)
        if not self.inner_optimizer.built:
            self.inner_optimizer.build(var_list)
        if self._pending_state is not None:
            state, self._pending_state = self._pending_state, None
            import tensorflow as tf

            # `build` may run while a train step is traced: assign now, once.
            with tf.init_scope():
                _assign(self.variables, state, self.name)

    def _ensure_built(self, variables):
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(list(variables))

    @property
    def variables(self):
        # The inner optimizer's variables come right after this wrapper's first
        # ones and before what `build` adds, so that the position of every
        # variable that exists before `build` is the same as after it.
        own, first = super().variables, self._variables_before_build
        return own[:first] + self.inner_optimizer.variables + own[first:]

    def set_weights(self, weights):
        """Sets this optimizer's state: values in the order of `variables`.

        Before the optimizer is built (Keras's .h5 loader restores it that way)
        the variables that exist (the step count among them) are set at once and
        the rest when `build` creates the variables for the model.

        Raises:
            ValueError: values that do not fit the variables (a state saved for other
                variables): another count (before `build`: fewer than exist) or shape.
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

    def save_own_variables(self, store):
        # Keras calls this whenever the model is saved: the one place kdist sees a
        # save by a rank other than rank 0, which may be writing the same file.
        super().save_own_variables(store)
        team.advise_on_saving(self)

    def register_local_var(self, var):
        """Keeps `var`'s gradient on this rank: it is never reduced across ranks.

        `var` may be a variable, a layer (its trainable weights, looked up
        when gradients are reduced, so an unbuilt layer works) or a variable
        path. With `scale_local_gradients` the local gradient is divided by
        the number of ranks, as Horovod does.

        Raises:
            TypeError: `var` is none of those.
        """
        if not (isinstance(var, (str, keras.layers.Layer)) or _is_variable(var)):
            raise TypeError("register_local_var takes a variable, a layer or a variable path; "
                            f"got {type(var).__name__}.")
        self._gradient_reduction.register_local(var)

    def local_variable_keys(self):
        """`(ids, paths)` of the variables registered with `register_local_var`."""
        return self._gradient_reduction.local_keys()

    # -- Horovod's protocol -------------------------------------------------------------------

    def compute_gradients(self, loss, var_list, tape=None):
        """Horovod's `compute_gradients`: `_compute_gradients` without `grad_loss`."""
        return self._compute_gradients(loss, var_list, None, tape)

    def _compute_gradients(self, loss, var_list, grad_loss=None, tape=None):
        """Returns `[(gradient, variable)]` with gradients reduced over the ranks.

        `loss` is a zero-argument callable, or a tensor computed under
        `tape`. With `backward_passes_per_step > 1` the gradients are added
        to this rank's sums; the pass that completes a cycle returns the
        reduced sums, the others return the local sums so far. Pass the
        result to `apply_gradients`, which does not reduce it again.
        """
        import tensorflow as tf

        if not callable(loss) and tape is None:
            raise ValueError("A tensor loss needs the tape it was computed under: pass "
                             "tape=..., or pass the loss as a function of no arguments.")
        tape = tape if tape is not None else tf.GradientTape()
        if callable(loss):
            with tape:
                if not callable(var_list):
                    # A Keras variable is watched through the TensorFlow variable it holds.
                    tape.watch([v.value if isinstance(v, keras.Variable) else v
                                for v in var_list])
                loss = loss()
        if callable(var_list):
            var_list = var_list()
        var_list = list(var_list)
        grads = tape.gradient(loss, var_list, grad_loss)
        self._ensure_built(var_list)
        reduce = self._reduction()
        helper = self._agg_helper
        if helper is None:
            reduced = reduce(grads, var_list)
        else:
            helper.add(grads, var_list)
            present = [i for i, g in enumerate(grads) if g is not None]
            sums = helper.sums(grads, var_list)

            def reduce_and_reset():
                reduced = helper.finish(reduce(sums, var_list))
                results = [tf.identity(reduced[i]) for i in present]
                with tf.control_dependencies(results):
                    helper.reset()
                return results

            results = ops.cond(helper.is_last_pass(), reduce_and_reset,
                               lambda: [sums[i] for i in present])
            reduced = [None] * len(grads)
            for i, result in zip(present, results):
                reduced[i] = result
        self._state.handoff = (_context_ref(), frozenset(id(v) for v in var_list))
        return list(zip(reduced, var_list))

    def minimize(self, loss, var_list, grad_loss=None, name=None, tape=None):
        """Computes, reduces and applies gradients; returns `iterations`.

        `loss` is a function of no arguments, or a tensor computed under `tape`.
        """
        return self.apply_gradients(self._compute_gradients(loss, var_list, grad_loss, tape))

    def apply_gradients(self, grads_and_vars, name=None, **kwargs):
        """Applies `(gradient, variable)` pairs, reducing them unless they are already.

        Gradients that `compute_gradients` returned in the same context (eagerly, or
        in the same traced function) are applied as they are, also after a
        transformation such as clipping; any others are this rank's own and are
        reduced first. TF-Keras-2 keywords (`experimental_aggregate_gradients`,
        `skip_gradients_aggregation`) are accepted and ignored. Returns `iterations`.
        """
        grads_and_vars = list(grads_and_vars)
        grads = [g for g, _ in grads_and_vars]
        variables = [v for _, v in grads_and_vars]
        self._step(grads, variables)
        return self.iterations

    def apply(self, grads, trainable_variables=None):
        self._step(list(grads), trainable_variables)

    # -- one training pass --------------------------------------------------------------------

    def _take_handoff(self, variables):
        """True when these gradients came from `_compute_gradients` in this context."""
        handoff, self._state.handoff = self._state.handoff, None
        if handoff is None:
            return False
        context, ids = handoff
        return _same_context(context) and ids == frozenset(id(v) for v in variables)

    def _step(self, grads, variables):
        if not grads:
            return
        if variables is None:
            if not self.built:
                raise ValueError("Pass the variables with the first gradients, or build the "
                                 "optimizer first: optimizer.build(trainable_variables).")
            variables = _keras_private.optimizer_built_variables(self)
        variables = list(variables)
        self._ensure_built(variables)
        # Before the first update: deferred broadcasts of models built in this
        # step, then a check that every rank starts from the same weights.
        ids, paths = self.local_variable_keys()
        consistency.first_update(
            self, [v for v in variables if id(v) not in ids and _path(v) not in paths],
            self.comm)
        inner = self.inner_optimizer
        helper = self._agg_helper
        if self._take_handoff(variables):
            if helper is None:
                inner.apply(grads, variables)
            else:
                ops.cond(helper.is_update_pass(), lambda: inner.apply(grads, variables),
                         self._count_pass)
            return
        reduce = self._reduction()
        if helper is None:
            reduced = reduce(grads, variables)
            if self._state.norms is not None:
                self._record_norms(grads, reduced)
            inner.apply(reduced, variables)
            return
        helper.add(grads, variables)

        def update():
            reduced = helper.finish(reduce(helper.sums(grads, variables), variables))
            inner.apply(reduced, variables)
            helper.reset()

        ops.cond(helper.is_last_pass(), update, self._count_pass)

    def _reduction(self):
        """How this pass reduces gradients: not at all when someone upstream does it."""
        if self._upstream or _strategy_reduces():
            return lambda grads, variables: grads
        return self._reduce

    def _count_pass(self):
        # A pass without an update still counts in `iterations`, as in Horovod.
        counter = self.inner_optimizer.iterations
        if not isinstance(counter, keras.Variable):
            counter = _keras_private.optimizer_iterations(self.inner_optimizer)
        counter.assign_add(1)

    # -- gradient norms, for the noise scale ---------------------------------------------------

    def track_gradient_norms(self):
        """Keeps running sums of this rank's and the averaged gradient's squared norms.

        Read by `kdist.callbacks.GradientNoiseScale`. Returns True when
        tracking starts now (a train function traced before must be traced
        again to record them), False when it was already on.
        """
        if self._agg_helper is not None:
            raise ValueError("Gradient norms are tracked per update; with "
                             "backward_passes_per_step > 1 the local gradient is a sum of "
                             "passes and the noise scale would mix batch sizes.")
        if self._state.norms is not None:
            return False
        import tensorflow as tf

        with tf.init_scope():
            self._state.norms = [keras.Variable(0.0, dtype="float32", trainable=False,
                                                name=name)
                                 for name in ("local_norm_sq", "reduced_norm_sq", "norm_steps")]
        return True

    def gradient_norms(self, reset=True):
        """`(local, reduced, steps)`: sums over the steps since the last reset of
        this rank's squared gradient norm and of the averaged gradient's."""
        if self._state.norms is None:
            raise ValueError("Call track_gradient_norms() before training.")
        values = tuple(float(keras.ops.convert_to_numpy(v)) for v in self._state.norms)
        if reset:
            for variable in self._state.norms:
                variable.assign(0.0)
        return values

    def _record_norms(self, grads, reduced):
        reduced_sq = _squared_norm(reduced)
        if self.op == Sum:
            reduced_sq = reduced_sq / float(self.comm.size) ** 2
        local, total, steps = self._state.norms
        local.assign_add(_squared_norm(grads))
        total.assign_add(reduced_sq)
        steps.assign_add(1.0)

    # -- reduction ----------------------------------------------------------------------------

    def allreduce_gradients(self, grads, variables=None):
        """Returns the gradients reduced over all ranks (None entries stay None).

        `variables`, in the same order, lets local variables and explicit
        groups be honoured; by default the variables the optimizer was built
        with are assumed when the counts match. Usable in a custom `train_step`
        that applies the result with `inner_optimizer`.
        """
        grads = list(grads)
        if variables is None and self.built:
            built_for = _keras_private.optimizer_built_variables(self)
            if len(grads) == len(built_for):
                variables = built_for
        return self._reduce(grads, variables)

    def _reduce(self, grads, variables):
        return self._gradient_reduction(grads, variables)

    # -- serialisation ------------------------------------------------------------------------

    def get_config(self):
        return {
            "name": self.name,
            "optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            "compression": self.compression.get_config(),
            "backward_passes_per_step": self.backward_passes_per_step,
            "average_aggregated_gradients": self.average_aggregated_gradients,
            "bucket_bytes": self.bucket_bytes,
            "num_groups": self.num_groups,
            "op": self.op,
            "gradient_predivide_factor": self.gradient_predivide_factor,
            "sparse_as_dense": self.sparse_as_dense,
            "groups": None if self.groups is None else [
                [m if isinstance(m, str) else _path(m) for m in group] for group in self.groups],
            "local_variables": sorted(
                reduction_lib.local_paths(self._gradient_reduction.local_sources)),
            "scale_local_gradients": self.scale_local_gradients,
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        config["optimizer"] = keras.saving.deserialize_keras_object(
            config["optimizer"], custom_objects=custom_objects)
        return cls(**config)


def _check_keras3_optimizer(optimizer):
    if isinstance(optimizer, keras.optimizers.Optimizer):
        return
    kind = type(optimizer)
    module = kind.__module__ or ""
    if module.startswith(("tf_keras", "tensorflow.python.keras")) or ".legacy" in module:
        if hasattr(keras.optimizers, kind.__name__):
            instead = f"keras.optimizers.{kind.__name__}(...)"
        else:
            instead = "an optimizer from keras.optimizers"
        raise TypeError(
            f"{module}.{kind.__name__} is a TF-Keras 2 (legacy) optimizer, which cannot "
            f"train Keras 3 models. Use {instead} from Keras 3 instead (with "
            "learning_rate= rather than lr=).")
    raise TypeError(
        "DistributedOptimizer wraps a Keras 3 optimizer (keras.optimizers.Optimizer); "
        f"got {kind.__name__}. Use one of keras.optimizers, e.g. keras.optimizers.Adam(...).")


def _as_list(value):
    if value is None:
        return []
    if isinstance(value, (str, keras.layers.Layer)) or _is_variable(value):
        return [value]
    return list(value)


def _squared_norm(grads):
    """The squared norm of a list of gradients taken as one vector (None entries skipped)."""
    import tensorflow as tf

    total = tf.zeros((), tf.float32)
    for grad in grads:
        if grad is None:
            continue
        if isinstance(grad, tf.IndexedSlices):
            grad = tf.convert_to_tensor(grad)
        total += tf.reduce_sum(tf.square(tf.cast(grad, tf.float32)))
    return total


def _context_ref():
    """A reference to where this code runs: None when eager, else the graph being built."""
    import tensorflow as tf

    if tf.executing_eagerly():
        return None
    return weakref.ref(tf.compat.v1.get_default_graph())


def _same_context(context):
    """Whether code running now is in `context`, or in a function nested inside it."""
    import tensorflow as tf

    if context is None:
        return tf.executing_eagerly()
    if tf.executing_eagerly():
        return False
    wanted = context()
    graph = tf.compat.v1.get_default_graph()
    while graph is not None:
        if graph is wanted:
            return True
        graph = getattr(graph, "outer_graph", None)
    return False


def _assign(variables, values, owner):
    """Assigns a saved optimizer state to `owner`'s variables, in order."""
    assign_all((variables, values, f"The optimizer {owner!r}",
                ": the state was saved from an optimizer built for other variables; load it "
                "into the model it was saved with"))


def _strategy_reduces():
    """Whether an MPIStrategy is active: it sums the gradients itself, in the inner optimizer."""
    import tensorflow as tf

    from kdist.distribute.mpi_strategy import MPIStrategy

    return isinstance(tf.distribute.get_strategy(), MPIStrategy)


def DistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="",
                         compression=None, sparse_as_dense=False, gradient_predivide_factor=1.0,
                         op=Average, backward_passes_per_step=1,
                         average_aggregated_gradients=False, num_groups=0, groups=None,
                         process_set=None, scale_local_gradients=True, bucket_bytes=None,
                         comm=None):
    """Horovod's `DistributedOptimizer` for Keras 3: reduces gradients over ranks.

    Wraps `optimizer` so that every rank applies the gradient reduced over all ranks. Takes
    Horovod's arguments, in Horovod's order. Also available as
    `kdist.optimizers.DistributedOptimizer`. The optimizer it returns is a
    `kdist.optimizers.AllreduceOptimizer`, described there: its attributes, Horovod's
    `compute_gradients` protocol, gradient accumulation and saving.

    Before its first update the optimizer runs what kdist's callbacks deferred for a model
    that Keras builds in its first step (the broadcast, the restore of a checkpoint), then
    compares every rank's weights with rank 0's. If some rank holds other values (nothing
    broadcast them), rank 0 logs a warning naming the first such variable and every rank
    starts from rank 0's weights (Horovod would let the ranks train apart); if the ranks
    hold different variables (names, shapes or dtypes), it raises `ValueError`. It works
    eagerly, in graphs and under XLA.

    Args:
        optimizer: a Keras 3 optimizer, or its name or config (`"adam"`).
        name: the wrapper's name; default `"distributed_" + optimizer.name`.
        device_dense: accepted for compatibility with Horovod; no effect (kdist reduces
            on the host).
        device_sparse: as `device_dense`.
        compression: `kdist.Compression.none` (default), `.fp16` or `.topk(ratio)`.
        sparse_as_dense: False (the default): `tf.IndexedSlices` gradients (embeddings)
            are reduced by allgathering their indices and values (the values averaged with
            `op=kdist.Average`), and a rank that has joined (`kdist.join`) takes part with
            no rows; under XLA every rank must then have batches of the same size. True:
            they are made dense and fused with the other gradients.
        gradient_predivide_factor: a positive number `f`: gradients are multiplied by
            `1 / f` before the sum and by `f / size()` after it. Other than 1 only with
            `op=kdist.Average`.
        op: `kdist.Average` (default) or `kdist.Sum`.
        backward_passes_per_step: sum this many local gradients before each reduction and
            update; a whole number (numpy integers and whole floats are accepted), at
            least 1.
        average_aggregated_gradients: with `backward_passes_per_step > 1`, divide the
            summed gradient by that number.
        num_groups: if positive, split the gradients into about this many collectives of
            equal size (overrides `bucket_bytes`).
        groups: a number (same as `num_groups`), or a list of lists of variables (or
            variable paths): each list travels in one collective, variables in no list
            travel alone.
        process_set: a registered `kdist.ProcessSet` to reduce over instead of the world;
            a rank outside it keeps its own gradients, as in Horovod.
        scale_local_gradients: divide the gradients of local variables (see
            `AllreduceOptimizer.register_local_var`) by the number of ranks, as Horovod
            does.
        bucket_bytes: most bytes of gradient per collective; None (the default):
            `KDIST_BUCKET_BYTES` where set, else 64 MiB on one host and, when the job spans
            hosts, a quarter of the gradient's bytes (between 1 and 64 MiB), so that all but
            the last bucket can travel during the backward pass
            (`kdist.comm.fusion.auto_bucket_bytes`; `kdist plan --measure` recommends a
            size).
        comm: a `kdist.comm.Communicator` to reduce over instead of the world (not with
            `process_set`).

    Returns:
        A `kdist.optimizers.AllreduceOptimizer`. When the global dtype policy is
        `mixed_float16` (see `kdist.precision.enable`) or `optimizer` is a
        `keras.optimizers.LossScaleOptimizer`: a `kdist.precision.LossScaleOptimizer`
        wrapping one, which also scales the loss and decides overflow with all ranks
        together, so that every rank skips the same steps. A given Keras
        `LossScaleOptimizer` is unwrapped and replaced with kdist's, keeping its
        `initial_scale` and `dynamic_growth_steps`.

    Raises:
        ValueError: `op=kdist.Adasum` (not available in kdist: use `kdist.Average` or
            `kdist.Sum`) or any other op; a `backward_passes_per_step` that is a fraction
            or below 1; a `gradient_predivide_factor` that is not positive, or not 1 with
            `op=kdist.Sum`; `groups=0`, a negative `num_groups` or a variable in two
            groups; both `comm` and `process_set`; a `process_set` not registered
            (`kdist.add_process_set`).
        TypeError: a TF-Keras 2 optimizer (`tf_keras`, `keras.optimizers.legacy`), with
            the name of the Keras 3 class to use instead, or anything else that is not a
            Keras 3 optimizer; a number argument given something that is not a number; a
            group that is not a list of variables or variable paths; a `process_set` that
            is not a `kdist.ProcessSet`.

    Example:

        >>> import keras, kdist
        >>> opt = kdist.DistributedOptimizer(keras.optimizers.Adam(1e-3),
        ...                                  compression=kdist.Compression.fp16)
        >>> opt.op
        'average'
    """
    return _distributed(optimizer, name=name, compression=compression,
                        sparse_as_dense=sparse_as_dense,
                        gradient_predivide_factor=gradient_predivide_factor, op=op,
                        backward_passes_per_step=backward_passes_per_step,
                        average_aggregated_gradients=average_aggregated_gradients,
                        num_groups=num_groups, groups=groups,
                        scale_local_gradients=scale_local_gradients,
                        bucket_bytes=bucket_bytes,
                        comm=_communicator(comm, process_set))


def _communicator(comm, process_set):
    if process_set is None:
        return comm
    # A rank outside the process set keeps its own gradients, as in Horovod.
    return collectives.resolve_comm(comm, process_set, outside=Communicator(None))


def PartialDistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="",
                                compression=None, sparse_as_dense=False,
                                gradient_predivide_factor=1.0, op=Average,
                                backward_passes_per_step=1, average_aggregated_gradients=False,
                                groups=None, process_set=None, local_layers=None,
                                scale_local_gradients=True, bucket_bytes=None, comm=None):
    """Horovod's `PartialDistributedOptimizer`: `local_layers` train on each rank alone.

    The gradients of the layers' trainable weights are not reduced across
    ranks (with `scale_local_gradients` they are divided by the number of
    ranks, as Horovod does); everything else is as in `DistributedOptimizer`,
    including what it returns and raises. Also available as
    `kdist.optimizers.PartialDistributedOptimizer`. The arguments not listed below are
    those of `DistributedOptimizer`; there is no `num_groups` (pass a number as `groups`).

    Args:
        local_layers: a Keras layer or a list of them. The layers may be unbuilt: their
            weights are looked up when gradients are reduced.
        scale_local_gradients: divide the local layers' gradients by the number of ranks.

    Raises:
        TypeError: something in `local_layers` is not a Keras layer.

    Example:

        >>> import keras, kdist
        >>> head = keras.layers.Dense(2)
        >>> opt = kdist.PartialDistributedOptimizer(keras.optimizers.SGD(0.1), local_layers=[head])
    """
    local_layers = reduction_lib.local_layer_list(local_layers, error=TypeError)
    return _distributed(optimizer, name=name, compression=compression,
                        sparse_as_dense=sparse_as_dense,
                        gradient_predivide_factor=gradient_predivide_factor, op=op,
                        backward_passes_per_step=backward_passes_per_step,
                        average_aggregated_gradients=average_aggregated_gradients,
                        groups=groups, local_variables=local_layers,
                        scale_local_gradients=scale_local_gradients,
                        bucket_bytes=bucket_bytes, comm=_communicator(comm, process_set))


def _distributed(optimizer, bucket_bytes=None, **kwargs):
    from kdist import precision

    scaling = {}
    inner_scaled = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
    if inner_scaled:
        # Ours must be the outer wrapper so that overflow is decided collectively;
        # the user's scale settings carry over.
        scaling = {"initial_scale": optimizer.initial_scale,
                   "dynamic_growth_steps": optimizer.dynamic_growth_steps}
        optimizer = optimizer.inner_optimizer
    wrapped = AllreduceOptimizer(optimizer, bucket_bytes=bucket_bytes, **kwargs)
    if inner_scaled or precision.loss_scaling_enabled():
        return precision.LossScaleOptimizer(wrapped, **scaling)
    return wrapped
