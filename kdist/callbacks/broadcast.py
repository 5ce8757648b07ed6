"""Callbacks that keep ranks identical: initial broadcast and metric averaging."""

import logging

import keras

from kdist import _args
from kdist.comm import collectives
from kdist.comm import processes
from kdist.coordination import consistency, joins, model_state, team
from kdist.coordination.logs import average_logs

logger = logging.getLogger(__name__)


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Starts every rank from `root_rank`'s weights and optimizer state.

    Runs when training begins, before the first step. It builds the optimizer
    first (Keras 3 builds it only in the first step otherwise), so that the
    optimizer's state is broadcast too. A model that Keras builds only in its
    first step (no `Input`, most subclassed models) has no variables yet then:
    with a kdist optimizer the broadcast runs as soon as they exist, before
    that step first runs; with any other optimizer it runs at the end of the
    first batch, as Horovod's does, with a warning. A model built differently
    on some rank is reported by variable name, on every rank, instead of
    hanging. It also keeps ranks with uneven numbers of batches in step: at
    each epoch's end it joins (see `kdist.join` and this package's
    description).

    Args:
        root_rank: the rank whose values every rank starts from (a whole
            number; numpy integers are accepted).
        device: accepted for compatibility with Horovod; has no effect.
        local_variables: a variable or a list of variables (`keras.Variable` or
            `tf.Variable`) that keep each rank's own value, at the start and
            when the model is copied from one rank to the others after a join.
            `register_local_var(var)` adds one later.
        process_set: a `kdist.ProcessSet`; broadcast among its ranks only.
            `root_rank` is then a rank of the whole job, and one of the set's,
            as in Horovod.
        comm: a kdist communicator to broadcast over instead (a search's
            `kdist.tune.trial_comm()`, say); `root_rank` is then a rank of
            `comm`.

    Raises:
        ValueError: `root_rank` is a fraction, or not a rank of the job (of the
            process set, of `comm`); both `process_set` and `comm` are given.
        TypeError: `root_rank` is not a number, or a local variable is not a
            variable.

    Example:

        On 2 ranks, whose models start from different random weights:

        >>> import keras, numpy as np, kdist
        >>> kdist.init()
        >>> keras.utils.set_random_seed(kdist.rank())
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        >>> model.compile(kdist.DistributedOptimizer(keras.optimizers.SGD(0.1)), "mse")
        >>> _ = model.fit(np.ones((8, 4)), np.ones((8, 1)), verbose=0,
        ...               callbacks=[kdist.callbacks.BroadcastGlobalVariablesCallback(0)])
        >>> kernel = model.layers[0].kernel.numpy()
        >>> bool(np.allclose(kdist.broadcast(kernel, root_rank=1), kernel))  # ranks agree
        True
    """

    def __init__(self, root_rank=0, device="", local_variables=None, process_set=None,
                 comm=None):
        super().__init__()
        self.root_rank = _args.whole_number(root_rank, "root_rank")
        self.comm = None if comm is None and process_set is None else \
            collectives.resolve_comm(comm, process_set)
        # The rank within self.comm (a process set's root_rank is a rank of the job).
        self._root = collectives.root_within(
            self.root_rank, self.comm or processes.world(), process_set)
        self.device = device
        self._pending = False
        self._local_variables = []
        if local_variables is not None:
            if _is_variable(local_variables):
                local_variables = [local_variables]
            for variable in local_variables:
                self.register_local_var(variable)

    def register_local_var(self, var):
        """Keeps `var` out of the broadcast: every rank keeps its own value, at the
        start and when the model is copied between ranks after a join. A `var`
        that is not a `keras.Variable` or `tf.Variable` raises `TypeError`."""
        if not _is_variable(var):
            raise TypeError("local_variables must be variables (keras.Variable or "
                            f"tf.Variable); got {type(var).__name__}.")
        self._local_variables.append(var)

    def on_train_begin(self, logs=None):
        self._last_epoch = None
        joins.forget(self.model)
        model_state.keep_local(self.model, self._local_variables)
        self._pending = False
        core = team.distributed_core(self.model)
        if core is not None:
            consistency.exclude(core, self._local_variables)
        if model_state.built(self.model):
            self._broadcast()
            return
        self._pending = True
        if core is not None:
            consistency.before_first_update(core, self._broadcast)

    def _broadcast(self):
        local = {id(v) for v in self._local_variables}
        shared = [v for v in model_state.model_state(self.model) if id(v) not in local]
        collectives.broadcast_variables(shared, root_rank=self._root, comm=self.comm)
        self._pending = False
        if processes.size() > 1:
            logger.debug("broadcast model and optimizer state from rank %d", self.root_rank)

    def on_train_batch_end(self, batch, logs=None):
        if self._pending:
            # The optimizer is not kdist's, so nothing could run before the first step.
            logger.warning("the model was built in its first step and its optimizer is not "
                           "kdist's, so rank %d's weights reach the other ranks only after "
                           "that step; give the model an Input to broadcast before it.",
                           self.root_rank)
            self._broadcast()

    def on_epoch_end(self, epoch, logs=None):
        joins.join_once(self.model, epoch, comm=self.comm)
        self._last_epoch = epoch

    def on_train_end(self, logs=None):
        if processes.size() > 1:
            # Said in the report should this rank leave while the others wait for it.
            joins.note_ending(self.model, self._last_epoch, (self.params or {}).get("epochs"))


class MetricAverageCallback(keras.callbacks.Callback):
    """Replaces each epoch's metrics by their average over the ranks.

    At each epoch's end, every numeric entry of the epoch's logs (validation
    metrics included) is replaced by its mean over the ranks that train the
    model (its kdist optimizer's or `MPIStrategy`'s ranks, else the whole job),
    after the epoch-end join. Put it before callbacks that read metrics
    (checkpoints, early stopping, loggers) so that they see the job's figures,
    not rank 0's alone. In a `fit` run through `Agreement.around`, whose first
    callback averages the logs already, it does not average them again.

    Args:
        device: accepted for compatibility with Horovod; has no effect.

    Raises:
        ValueError: the ranks report different metric names (they must compile
            the same metrics).

    Example:

        >>> import kdist
        >>> callback = kdist.callbacks.MetricAverageCallback()
    """

    def __init__(self, device=""):
        super().__init__()
        self._names = None

    def on_epoch_end(self, epoch, logs=None):
        joins.join_once(self.model, epoch)
        if logs is None or joins.averaged(self.model, epoch):
            return  # kdist's agreement (kdist.callbacks.Agreement) averaged them already
        self._names = average_logs(logs, team.comm_of(self.model), self._names,
                                   "MetricAverageCallback")


def _is_variable(value):
    import tensorflow as tf

    return isinstance(value, (keras.Variable, tf.Variable))
