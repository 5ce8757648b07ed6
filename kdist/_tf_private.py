"""Every use kdist makes of TensorFlow's private API, in one place.

kdist builds on TensorFlow's public API where one exists. What has none is reached
here and nowhere else, each through one small function whose docstring names the
internal it relies on: a TensorFlow release that moves one of them breaks one function
here, with a clear error, instead of kdist in many places. `tests/test_layers.py` fails
if another kdist module imports `tensorflow.python` or touches the private names below.

The supported TensorFlow versions are declared once, in pyproject.toml (`kdist info`
prints them); `benchmarks/versions.py` tests the ends of the range.
"""

import tensorflow as tf


def leave_unconverted(prefix):
    """Keeps AutoGraph from rewriting the modules under `prefix` when a user's
    `tf.function` calls them: their Python control flow is meant to run at trace time.

    Relies on `tensorflow.python.autograph.core.config.CONVERSION_RULES` (a tuple of
    rules, first match wins) and its `DoNotConvert` rule. A process-wide change, made
    once; a TensorFlow without the module converts nothing of kdist's anyway.
    """
    try:
        from tensorflow.python.autograph.core import config
    except ImportError:
        return
    if not any(getattr(rule, "_prefix", None) == prefix for rule in config.CONVERSION_RULES):
        config.CONVERSION_RULES = (config.DoNotConvert(prefix),) + config.CONVERSION_RULES


def run_out_of_program_order(op_type):
    """Lets TensorFlow run stateful ops of type `op_type` out of a function's program
    order, as it runs its own collectives; returns False where it cannot.

    Relies on `tensorflow.python.framework.auto_control_deps.ASYNC_STATEFUL_OPS`, the
    frozenset of op types exempt from automatic control dependencies. Process-wide.
    """
    try:
        from tensorflow.python.framework import auto_control_deps
    except ImportError:
        return False
    exempt = getattr(auto_control_deps, "ASYNC_STATEFUL_OPS", None)
    if not isinstance(exempt, frozenset):
        return False
    if op_type not in exempt:
        auto_control_deps.ASYNC_STATEFUL_OPS = exempt | {op_type}
    return True


def gradient_tape_state(tape):
    """What a `tf.GradientTape` has recorded, for a tape that takes it over:
    (recording, persistent, watch_accessed_variables, watched_variables).

    Relies on `GradientTape._tape`, `_persistent`, `_watch_accessed_variables` and
    `_watched_variables`; raises `AttributeError` where TensorFlow keeps them elsewhere.
    """
    return (tape._tape, tape._persistent, tape._watch_accessed_variables,
            tape._watched_variables)


def continue_recording(tape, recording, watched_variables):
    """Makes the new `tf.GradientTape` `tape` go on with what another tape recorded
    (`recording` and `watched_variables` from `gradient_tape_state`), so that its
    `gradient` sees the other's forward pass.

    `tf.GradientTape` takes over no recording publicly. Relies on `GradientTape._tape`
    and `_watched_variables`, as `gradient_tape_state`.
    """
    tape._tape = recording
    tape._watched_variables = watched_variables


def is_function_graph(graph):
    """Whether `graph` is a `tf.function`'s graph (TensorFlow's `FuncGraph`).

    Relies on `tensorflow.python.framework.func_graph.FuncGraph`.
    """
    from tensorflow.python.framework import func_graph

    return isinstance(graph, func_graph.FuncGraph)


def graph_in_xla_context(graph):
    """Whether `graph`, or a graph it is nested in, is being compiled by XLA.

    Relies on `tensorflow.python.ops.control_flow_util.GraphOrParentsInXlaContext`.
    """
    from tensorflow.python.ops import control_flow_util

    return control_flow_util.GraphOrParentsInXlaContext(graph)


def onednn_enabled():
    """Whether this TensorFlow runs oneDNN's CPU kernels (None where it cannot tell).

    Relies on `tensorflow.python.util._pywrap_util_port.IsMklEnabled`, which reads
    `TF_ENABLE_ONEDNN_OPTS` and the CPU's features once, as TensorFlow itself does.
    """
    try:
        from tensorflow.python.util import _pywrap_util_port
    except ImportError:
        return None
    return bool(_pywrap_util_port.IsMklEnabled())


def eager_context_started():
    """Whether TensorFlow's eager context has created its devices already (settings read
    at device creation, such as the CPU allocator's, then come too late).

    Relies on `tensorflow.python.eager.context.context()._context_handle`.
    """
    from tensorflow.python.eager import context

    return context.context()._context_handle is not None


def in_multi_worker_mode(strategy):
    """Whether a `tf.distribute` multi-worker strategy has more than one worker.

    Relies on `StrategyExtendedV2._in_multi_worker_mode()`.
    """
    return strategy.extended._in_multi_worker_mode()


def one_device_extended():
    """The class TensorFlow's `OneDeviceStrategy` extends itself with, for a strategy that
    runs one replica per process (`MPIStrategy`), which subclasses it after
    `StrategyHooksThrough`.

    Relies on `tensorflow.python.distribute.one_device_strategy.OneDeviceExtended` and
    the `StrategyExtendedV2` hooks it implements (`_create_variable`, `_reduce_to`,
    `_experimental_distribute_dataset`, ...).
    """
    from tensorflow.python.distribute import one_device_strategy

    return one_device_strategy.OneDeviceExtended


class StrategyHooksThrough:
    """`tf.distribute.StrategyExtended` mixin, listed before `one_device_extended()`: the
    hooks TensorFlow's `Strategy` calls go to public-named methods of the class using it,
    which defines

    - `replica_count()`, the number of replicas in sync;
    - `local_replica_index(replica_id_in_sync_group)`, a replica's index among this
      process's devices;
    - `run_for_each_replica(fn, args, kwargs)`, what `Strategy.run` runs;
    - `make_variable(next_creator, **kwargs)`, each variable made in the strategy's scope
      (`default_make_variable` makes it as the base class would);
    - `local_results(value)`, the components of `value` on this process;
    - `reduce_values(reduce_op, value, destinations, options)` and
      `batch_reduce_values(reduce_op, value_destination_pairs, options)`;
    - `gather_values(value, destinations, axis, options)`;
    - `distribute_dataset(dataset, options)` (`default_distribute_dataset` distributes it
      as the base class would), `distribute_datasets_from_fn(dataset_fn, options)` and
      `distribute_values_from_fn(value_fn)`;
    - `batch_size_is_global`, whether datasets come batched with the global batch size.

    TensorFlow has no public way to define a strategy. Relies on the `StrategyExtendedV2`
    hooks `_num_replicas_in_sync`, `_get_local_replica_id`, `_call_for_each_replica`,
    `_create_variable`, `_local_results`, `_reduce_to`, `_batch_reduce_to`,
    `_gather_to_implementation`, `_experimental_distribute_dataset`,
    `_distribute_datasets_from_function`, `_experimental_distribute_values_from_function`
    and `_global_batch_size`.
    """

    @property
    def _num_replicas_in_sync(self):
        return self.replica_count()

    def _get_local_replica_id(self, replica_id_in_sync_group):
        return self.local_replica_index(replica_id_in_sync_group)

    def _call_for_each_replica(self, fn, args, kwargs):
        return self.run_for_each_replica(fn, args, kwargs)

    def _create_variable(self, next_creator, **kwargs):
        return self.make_variable(next_creator, **kwargs)

    def default_make_variable(self, next_creator, **kwargs):
        return super()._create_variable(next_creator, **kwargs)

    def _local_results(self, value):
        return self.local_results(value)

    def _reduce_to(self, reduce_op, value, destinations, options):
        return self.reduce_values(reduce_op, value, destinations, options)

    def _batch_reduce_to(self, reduce_op, value_destination_pairs, options):
        return self.batch_reduce_values(reduce_op, value_destination_pairs, options)

    def _gather_to_implementation(self, value, destinations, axis, options):
        return self.gather_values(value, destinations, axis, options)

    def _experimental_distribute_dataset(self, dataset, options):
        return self.distribute_dataset(dataset, options)

    def default_distribute_dataset(self, dataset, options):
        return super()._experimental_distribute_dataset(dataset, options)

    def _distribute_datasets_from_function(self, dataset_fn, options):
        return self.distribute_datasets_from_fn(dataset_fn, options)

    def _experimental_distribute_values_from_function(self, value_fn):
        return self.distribute_values_from_fn(value_fn)

    @property
    def _global_batch_size(self):
        return self.batch_size_is_global


def container_strategy(extended):
    """The `tf.distribute.Strategy` whose `extended` is `extended`.

    Relies on `StrategyExtendedV2._container_strategy()`.
    """
    return extended._container_strategy()


def extended_device(extended):
    """The device a `one_device_extended()` (or a subclass) computes on, as TensorFlow
    resolved it.

    Relies on `OneDeviceExtended._device`.
    """
    return extended._device


def input_workers(extended, options):
    """The input workers a `one_device_extended()` (or a subclass) distributes datasets to
    under the `tf.distribute.InputOptions` `options` (None for the defaults).

    Relies on `OneDeviceExtended._input_workers_with_options`.
    """
    return extended._input_workers_with_options(options)


def create_sync_on_read_variable(strategy, create_local, **kwargs):
    """A sync-on-read variable (metric state) of `strategy` whose one local component
    `create_local(**kwargs)` makes.

    Relies on `tensorflow.python.distribute.distribute_utils.create_mirrored_variable`
    and `tensorflow.python.distribute.values.SyncOnReadVariable`.
    """
    from tensorflow.python.distribute import distribute_utils
    from tensorflow.python.distribute import values

    return distribute_utils.create_mirrored_variable(
        strategy, create_local, {tf.VariableSynchronization.ON_READ: values.SyncOnReadVariable},
        {}, **kwargs)


def read_sync_on_read(variable):
    """The cross-replica value of a sync-on-read variable; None for any other variable.

    Relies on `tensorflow.python.distribute.values.SyncOnReadVariable._get_cross_replica`.
    """
    from tensorflow.python.distribute import values

    if isinstance(variable, values.SyncOnReadVariable):
        return variable._get_cross_replica()
    return None


def local_values(value):
    """The per-replica components of a `tf.distribute.DistributedValues`, as a tuple.

    Relies on `DistributedValues._values`.
    """
    return tuple(value._values)


def distributed_datasets_from_function(dataset_fn, input_workers, input_contexts, strategy,
                                       options):
    """TensorFlow's distributed dataset made by calling `dataset_fn` per input pipeline.

    Relies on `tensorflow.python.distribute.input_util.get_distributed_datasets_from_function`.
    """
    from tensorflow.python.distribute import input_util

    return input_util.get_distributed_datasets_from_function(
        dataset_fn, input_workers, input_contexts, strategy, options=options)


def distributed_dataset_without_prefetch_thread(dataset, input_workers, strategy):
    """TensorFlow's distributed dataset over `dataset` for one device per process, whose
    iterators read `dataset` directly instead of through a multi-device iterator.

    TensorFlow's default input options give even a single device a `MultiDeviceIterator`,
    whose background thread prefetches batches; destroying such an iterator (Python's
    garbage collector does it at any moment, say between `fit` and `evaluate`) while that
    thread is inside `GetNext` crashes the process with SIGSEGV in TensorFlow's own code.
    `InputReplicationMode.PER_REPLICA` without fetching to the device is TensorFlow's
    own path without that thread; the elements and their structure are the same.

    Relies on `tensorflow.python.distribute.input_util.get_distributed_dataset`, whose
    public entry (`Strategy.experimental_distribute_dataset`) refuses this mode for one
    device.
    """
    from tensorflow.python.distribute import input_util

    options = tf.distribute.InputOptions(
        experimental_replication_mode=tf.distribute.InputReplicationMode.PER_REPLICA,
        experimental_fetch_to_device=False)
    return input_util.get_distributed_dataset(dataset, input_workers, strategy,
                                              options=options)
