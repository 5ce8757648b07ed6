"""What an elastic job keeps in memory between commits, and brings back after a failure."""

import logging

import numpy as np

from kdist._variables import assign_all

logger = logging.getLogger(__name__)


class HostsUpdatedInterrupt(RuntimeError):
    """Raised by `State.commit` when the job's membership is about to change.

    `kdist.elastic.run` catches it, resets and goes on without restoring
    (nothing was lost). kdist itself never raises it (it learns of lost ranks
    from MPI); a `State` subclass may, from `commit`, to make every rank reset.
    """


class State:
    """Base class of the state an elastic job commits, restores and syncs.

    A subclass implements `save` (copy the state aside), `restore` (go back to
    the last copy) and `sync` (make every rank hold rank 0's state, then copy
    it aside). `commit()` calls `save()`; `kdist.elastic.run` calls `sync()`
    before each attempt and `restore()` after ranks were lost, then the
    functions given to `register_reset_callbacks`. `check_host_updates()` is
    kept for Horovod scripts and does nothing: kdist learns of lost ranks
    from MPI.
    """

    def __init__(self):
        self._reset_callbacks = []

    def register_reset_callbacks(self, callbacks):
        """Adds functions to call (without arguments) after the world changed size,
        before training goes on: rescale the learning rate, re-shard data.

        `callbacks` is a list of callables; anything in it that is not callable
        raises `TypeError` (and none of the list is added). At a reset they
        run on the ranks that survived it, not on the processes started then
        to replace lost ranks, which begin afresh."""
        for callback in callbacks:
            if not callable(callback):
                raise TypeError(f"reset callbacks must be callable; got {callback!r}.")
        self._reset_callbacks.extend(callbacks)

    def on_reset(self):
        for callback in self._reset_callbacks:
            callback()

    def commit(self):
        """Saves the state; after a failure the job goes back to the last commit."""
        self.save()

    def check_host_updates(self):
        """Kept for Horovod scripts: kdist learns of lost ranks from MPI itself."""

    def save(self):
        """Copies the state aside (what `commit` does)."""
        raise NotImplementedError

    def restore(self):
        """Goes back to the last copy."""
        raise NotImplementedError

    def sync(self):
        """Makes every rank hold rank 0's state (a collective), then copies it aside."""
        raise NotImplementedError


class ObjectState(State):
    """Plain Python values, given as keyword arguments and kept as attributes.

    `commit()` (or `save()`) copies the attributes' current values aside;
    `restore()` sets them back to the last commit; `sync()` gives every rank
    rank 0's last committed values (a value changed since the last commit goes
    back to it, on rank 0 too) and commits them. Values travel by pickling, so
    they must be picklable. Only the names given at construction are kept;
    attributes added later are not.

    Raises:
        ValueError: a value's name starts with `_` or names one of the state's
            own attributes or methods (`commit`, `restore`, `sync`, ...).

    Example:

        >>> from kdist.elastic import ObjectState
        >>> state = ObjectState(epoch=0, best=None)
        >>> state.epoch = 3
        >>> state.restore()
        >>> state.epoch
        0
        >>> state.epoch = 3
        >>> state.commit()
        >>> state.restore()
        >>> state.epoch
        3
    """

    def __init__(self, **values):
        super().__init__()
        reserved = sorted(k for k in values if k.startswith("_") or hasattr(State, k))
        if reserved:
            raise ValueError(f"State values may not be named {reserved}: those names are "
                             "the state's own.")
        self._saved_values = dict(values)
        self._set_values()

    def save(self):
        self._saved_values = {name: getattr(self, name) for name in self._saved_values}

    def restore(self):
        self._set_values()

    def sync(self):
        from kdist.comm import collectives

        if self._saved_values:
            self._saved_values = collectives.broadcast_object(self._saved_values, root_rank=0)
            self._set_values()

    def _set_values(self):
        for name, value in self._saved_values.items():
            setattr(self, name, value)


class KerasState(ObjectState):
    """A Keras model, its optimizer and plain values, committed and restored together.

    The model's variables, its optimizer's, and `values` kept as attributes
    (as in `ObjectState`):

    - `commit()` (or `save()`) copies the variables and values to host memory;
      the state is committed once when it is made.
    - `restore()` goes back to the last commit. Optimizer variables built after
      it (in the first step) keep their values. A model or optimizer whose
      structure changed since the commit (other variables, other shapes)
      raises `ValueError`, and nothing is restored.
    - `sync()` broadcasts rank 0's current model and optimizer variables and
      its last committed values (see `ObjectState`), then commits. A rank
      whose optimizers are not built yet while rank 0's are (a process that
      replaces a lost rank) builds them first.
    - `register_reset_callbacks(callbacks)` adds functions called without
      arguments after a reset.

    After a reset the model's compiled train, test and predict steps are
    traced again: those traced before hold the old world's communicator.

    Args:
        model: a `keras.Model`, or a `kdist.gan.GAN` (both its models and
            both optimizers are kept).
        optimizer: defaults to the model's optimizer(s).
        **values: plain values to keep alongside (`epoch=0`, `batch=0`, ...).

    Raises:
        ValueError: a value's name is reserved (see `ObjectState`); from
            `restore`, a structure that changed since the commit.
        RuntimeError: from `sync`, when rank 0 keeps another number of
            optimizers than this rank.

    Example:

        >>> import keras, kdist
        >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        >>> model.compile(optimizer="sgd", loss="mse")
        >>> state = kdist.elastic.KerasState(model, epoch=0)
        >>> _ = model.layers[0].kernel.assign(model.layers[0].kernel * 0.0)
        >>> state.restore()
        >>> bool(abs(model.layers[0].kernel.numpy()).sum() > 0)
        True
    """

    def __init__(self, model, optimizer=None, **values):
        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer",
                                                                         None)
        self._saved_model = None
        self._saved_optimizer = None
        super().__init__(**values)
        self._save_variables()

    def _optimizers(self):
        """The explicit optimizer, else the model's: both of a `kdist.gan.GAN`."""
        if self.optimizer is not None:
            return [self.optimizer]
        several = getattr(self.model, "optimizers", None)
        return list(several) if isinstance(several, (list, tuple)) else []

    def _optimizer_variables(self):
        return [v for optimizer in self._optimizers() for v in optimizer.variables]

    def _save_variables(self):
        self._saved_model = [np.array(v.numpy(), copy=True) for v in self.model.variables]
        self._saved_optimizer = [np.array(v.numpy(), copy=True)
                                 for v in self._optimizer_variables()]

    def save(self):
        self._save_variables()
        super().save()

    def restore(self):
        optimizer_variables = self._optimizer_variables()
        restores_optimizer = len(optimizer_variables) == len(self._saved_optimizer)
        # One call: a refused commit changes neither.
        groups = [(self.model.variables, self._saved_model, "The model", _CHANGED)]
        if restores_optimizer:
            groups.append((optimizer_variables, self._saved_optimizer, "The optimizer",
                           _CHANGED))
        assign_all(*groups)
        if not restores_optimizer:
            # Built after the last commit (its first step): its fresh values stand,
            # and sync() makes them rank 0's.
            logger.debug("optimizer variables appeared since the last commit; not restored")
        super().restore()

    def sync(self):
        from kdist.comm import collectives

        self._build_optimizers_like_rank_0()
        collectives.broadcast_variables(self.model.variables, root_rank=0)
        optimizer_variables = self._optimizer_variables()
        if optimizer_variables:
            collectives.broadcast_variables(optimizer_variables, root_rank=0)
        super().sync()
        self._save_variables()

    def _build_optimizers_like_rank_0(self):
        """A rank that joined late has not stepped yet, so its optimizers hold
        no slots; it creates them before rank 0's values are broadcast into them."""
        from kdist.comm import collectives

        optimizers = self._optimizers()
        built = collectives.broadcast_object([o.built for o in optimizers], root_rank=0)
        if len(built) != len(optimizers):
            raise RuntimeError(f"Rank 0 keeps {len(built)} optimizer(s) in its elastic state "
                               f"but this rank keeps {len(optimizers)}.")
        for optimizer, built_on_rank_0 in zip(optimizers, built):
            if built_on_rank_0 and not optimizer.built:
                with _strategy_scope(self.model):
                    optimizer.build(self._trained_by(optimizer))

    def _trained_by(self, optimizer):
        """The variables `optimizer` updates: a GAN's half, else the model's."""
        for half, name in (("discriminator", "d_optimizer"), ("generator", "g_optimizer")):
            if getattr(self.model, name, None) is optimizer:
                return getattr(self.model, half).trainable_variables
        return self.model.trainable_variables

    def on_reset(self):
        _forget_compiled_functions(self.model, self._optimizers())
        super().on_reset()


def _strategy_scope(model):
    """The scope of the strategy `model` was made under; nothing to enter when it was
    made under none, or under the current one."""
    import contextlib

    strategy = getattr(model, "distribute_strategy", None)
    if strategy is None:
        return contextlib.nullcontext()
    import tensorflow as tf

    # A model made outside every strategy scope answers with the current strategy
    # (TensorFlow's default one outside every scope), and entering the scope that
    # is open already changes nothing: only another strategy's scope is entered.
    if strategy is tf.distribute.get_strategy():
        return contextlib.nullcontext()
    return strategy.scope()


class TensorFlowState(ObjectState):
    """Horovod's state for a custom TensorFlow loop: a list of variables and plain values.

    The variables and the values are committed (copied to host memory),
    restored and synced (rank 0's variables and last committed values
    broadcast to every rank, then committed) together, as in `KerasState`.
    Restoring variables whose number or shapes changed since the commit
    raises `ValueError`, and nothing is restored.

    Args:
        variables: the variables to commit, restore and sync (`tf.Variable` or
            Keras variables; a model's `variables` plus its optimizer's, say).
        session: accepted for compatibility with Horovod (TensorFlow 1); must be None.
        **values: plain values kept alongside (`epoch=0`, `batch=0`, ...).

    Raises:
        ValueError: a `session` is given; a value's name is reserved (see
            `ObjectState`).

    Example:

        >>> import tensorflow as tf, kdist
        >>> v = tf.Variable([1.0, 2.0])
        >>> state = kdist.elastic.TensorFlowState([v], epoch=0)
        >>> _ = v.assign([0.0, 0.0])
        >>> state.restore()
        >>> v.numpy().tolist()
        [1.0, 2.0]
    """

    def __init__(self, variables=None, session=None, **values):
        if session is not None:
            raise ValueError("TensorFlowState keeps variables of TensorFlow 2; a TensorFlow 1 "
                             "session is not supported: pass session=None.")
        self.variables = list(variables or [])
        self._saved_variables = None
        super().__init__(**values)
        self._save_variables()

    def _save_variables(self):
        self._saved_variables = [np.array(v.numpy(), copy=True) for v in self.variables]

    def save(self):
        self._save_variables()
        super().save()

    def restore(self):
        _assign(self.variables, self._saved_variables, "state")
        super().restore()

    def sync(self):
        from kdist.comm import collectives

        if self.variables:
            collectives.broadcast_variables(self.variables, root_rank=0)
        super().sync()
        self._save_variables()


class TensorFlowKerasState(KerasState):
    """Horovod's name for `KerasState` in its TensorFlow API (`hvd.elastic.TensorFlowKerasState`).

    Takes `KerasState`'s arguments and behaves as it does. `backend`
    (TensorFlow 1's Keras session) is accepted only as None: anything else
    raises `ValueError`.
    """

    def __init__(self, model, optimizer=None, backend=None, **values):
        if backend is not None:
            raise ValueError("TensorFlowKerasState keeps a Keras 3 model; a TensorFlow 1 Keras "
                             "backend is not supported: pass backend=None.")
        super().__init__(model, optimizer, **values)


_CHANGED = ": it changed its structure since the last commit"


def _assign(variables, values, what):
    assign_all((variables, values, f"The {what}", _CHANGED))


def _forget_compiled_functions(model, optimizers):
    """Drops the model's traced steps, which hold the old world's MPI handle."""
    for name in ("train_function", "test_function", "predict_function"):
        if hasattr(model, name):
            setattr(model, name, None)
    for optimizer in optimizers:
        # A loss-scale wrapper holds the distributed optimizer inside.
        for each in (optimizer, getattr(optimizer, "inner_optimizer", None)):
            reducers = getattr(each, "_reducers", None)
            if isinstance(reducers, dict):
                reducers.clear()
