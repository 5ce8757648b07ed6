"""`MPIStrategy`: kdist's allreduce data parallelism as a `tf.distribute.Strategy`.

Each MPI rank is one replica. The strategy plugs kdist's collectives into the
places where TensorFlow and Keras already call a strategy, so a script
written for `tf.distribute.MirroredStrategy` runs under `mpiexec` unchanged:

- `ReplicaContext.all_reduce`, which Keras optimizers use to sum gradients
  and `BatchNormalization(synchronized=True)` uses for its statistics, runs
  kdist's fused allreduce (the C++ op when available);
- `num_replicas_in_sync` is the number of ranks, so Keras scales each rank's
  loss by 1/size and the summed gradient is the global-batch average;
- variables are broadcast from rank 0 when they are created, and the first
  step checks that every rank built the same model (naming the first
  variable that differs);
- metric variables read outside a training step are summed over the ranks,
  as tf.distribute's sync-on-read variables are, so `fit` and `evaluate`
  report global metrics;
- datasets are batched with the global batch size; each rank keeps its own
  slice of every global batch, so all ranks take the same number of steps;
- `predict` gathers the slices back, in order, on every rank;
- under mixed precision, every rank skips a step when any rank overflowed.
"""

import logging
import weakref

import tensorflow as tf

from kdist import _keras_private, _tf_private
from kdist.comm import collectives
from kdist.comm import processes
from kdist.comm.tensors import TensorReducer
from kdist.coordination import consistency

logger = logging.getLogger(__name__)


class MPIStrategy(tf.distribute.Strategy):
    """Synchronous data parallelism over MPI ranks, one replica per rank.

    Use it where you would use `tf.distribute.MirroredStrategy` and launch
    the script with `kdist run -n N`, `mpiexec -n N` or `srun`:

    ```python
    strategy = kdist.distribute.MPIStrategy()
    with strategy.scope():
        model = build_model()
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    model.fit(dataset.batch(64 * strategy.num_replicas_in_sync), epochs=5)
    ```

    `num_replicas_in_sync` is the number of ranks. What goes through kdist:

    - gradients (`ReplicaContext.all_reduce`), the statistics of
      `BatchNormalization(synchronized=True)` and metric reads go through
      kdist's fused allreduce;
    - variables take rank 0's initial value when they are created;
    - each rank keeps its slice of every global batch (`slice_batches`), and
      `predict` gathers the slices back, in order, on every rank;
    - under mixed precision, all ranks skip a step when any rank's gradients
      overflowed;
    - at the first step, once every variable exists, it checks that every
      rank built the same model with the same values.

    Train steps compiled with `jit_compile=True` work.

    Batch datasets with the global batch size (per-replica batch times
    `num_replicas_in_sync`), as with any tf.distribute strategy. Reading a
    metric outside `fit`/`evaluate` is a collective: do it on every rank.

    Args:
        comm: the `kdist.comm.Communicator` whose ranks are the replicas
            (the world by default); also the strategy's `comm` attribute.
        compression: `kdist.Compression.none` (default), `.fp16` or
            `.topk(ratio)` for the gradient allreduce.
        bucket_bytes: most bytes of gradient per fused collective; None (the default):
            `KDIST_BUCKET_BYTES` where set, else 64 MiB on one host and a quarter of the
            gradient's bytes (between 1 and 64 MiB) when the job spans hosts, so that all
            but the last bucket can travel during the backward pass (`kdist plan --measure`
            recommends a size).
        device: the device each rank computes on; by default `/gpu:0` if the
            rank has a GPU (kdist gives each local rank its own), else `/cpu:0`.

    Raises:
        ValueError: at the first step, when the ranks built different models
            or gave their variables different values (naming the first
            variable that differs); when something asks it for a reduction
            other than SUM or MEAN.

    Example:

        On 2 ranks, each rank is one replica:

        >>> import tensorflow as tf, kdist
        >>> strategy = kdist.distribute.MPIStrategy()
        >>> strategy.num_replicas_in_sync
        2
        >>> float(strategy.reduce("SUM", tf.constant(kdist.rank() + 1.0), axis=None))
        3.0
    """

    # Its replicas are kdist ranks trained in step over `comm` (kdist.coordination.team).
    kdist_replicas_in_step = True

    def __init__(self, comm=None, compression=None, bucket_bytes=None,
                 device=None):
        # Before TensorFlow starts: init gives this rank its cores and GPU.
        processes.init()
        comm = comm if comm is not None else processes.world()
        if device is None:
            device = "/gpu:0" if tf.config.list_logical_devices("GPU") else "/cpu:0"
        super().__init__(_MPIExtended(self, device, comm, compression, bucket_bytes))
        if comm.rank == 0:
            logger.info("MPIStrategy: %d replicas (one per rank) on %s", comm.size, device)

    @property
    def comm(self):
        """The communicator whose ranks are this strategy's replicas."""
        return self.extended.comm

    def __deepcopy__(self, memo):
        # Keras copies configs that may hold the strategy; it is a handle, not data.
        memo[id(self)] = self
        return self


class _MPIExtended(_tf_private.StrategyHooksThrough, _tf_private.one_device_extended()):
    """One local device, with every cross-replica operation taken over MPI."""

    def __init__(self, container_strategy, device, comm, compression, bucket_bytes):
        super().__init__(container_strategy, device)
        self.comm = comm
        self._sum = TensorReducer(comm, compression, average=False, bucket_bytes=bucket_bytes,
                                  name="kdist_strategy")
        self._mean = TensorReducer(comm, compression, average=True, bucket_bytes=bucket_bytes,
                                   name="kdist_strategy")
        self._created = []  # weak references to the mirrored variables, in creation order
        # The world generation the model was checked in (see _check_same_model).
        self._model_checked = None

    # -- replicas -------------------------------------------------------------

    def replica_count(self):
        return self.comm.size

    def local_replica_index(self, replica_id_in_sync_group):
        # Every rank holds exactly one replica: local index 0.
        return 0

    def run_for_each_replica(self, fn, args, kwargs):
        if self._model_checked != processes.world_generation() and self.comm.size > 1:
            self._check_same_model()
        strategy = _tf_private.container_strategy(self)
        device = _tf_private.extended_device(self)
        with tf.device(device), _MPIReplicaContext(strategy, self.comm.rank):
            outputs = fn(*args, **kwargs)
        if _is_overflow_check(fn) and self.comm.size > 1:
            # Keras's LossScaleOptimizer checks each replica's own gradients
            # (before the allreduce) and then either applies them, reducing
            # across ranks, or skips. Ranks must agree, or some would wait in
            # an allreduce the others never join.
            outputs = self._all_ranks_true(outputs)
        if _is_predict_step(fn) and self.comm.size > 1:
            # Each rank predicted its slice of the global batch; give every
            # rank the whole batch back, in the order of the input.
            outputs = tf.nest.map_structure(self._gather_rows, outputs)
        return outputs

    def _check_same_model(self):
        """Once every variable exists: every rank must hold the same ones, with equal values."""
        variables = [ref() for ref in self._created if ref() is not None]
        if not consistency.initialized(variables):
            return
        with tf.init_scope():
            consistency.check_identical(variables, self.comm, advice=(
                "Build and compile the same model on every rank, inside strategy.scope()."))
        # Checked again, on every rank, when an elastic job's world changes.
        self._model_checked = processes.world_generation()

    def _all_ranks_true(self, flag):
        votes = collectives.allreduce(tf.cast(flag, tf.int32), op=processes.Min, comm=self.comm,
                                      name="kdist_agree_finite")
        return tf.cast(votes, tf.bool)

    def _gather_rows(self, tensor):
        if tensor is None or not tf.is_tensor(tensor) or tensor.shape.rank == 0:
            return tensor
        return collectives.allgather(tensor, comm=self.comm, name="kdist_gather_predictions")

    # -- variables ------------------------------------------------------------

    def make_variable(self, next_creator, **kwargs):
        synchronization = kwargs.get("synchronization")
        if synchronization == tf.VariableSynchronization.ON_READ and self.comm.size > 1:
            # Sync-on-read (metric state): local updates, reads outside a
            # step reduce over the ranks through `reduce_values`.
            def create_local(**creator_kwargs):
                with tf.device(_tf_private.extended_device(self)):
                    return [next_creator(**creator_kwargs)]

            return _tf_private.create_sync_on_read_variable(
                _tf_private.container_strategy(self), create_local, **kwargs)
        # Once an elastic job's world changed, ranks create variables at
        # different times (a replacement builds its whole model while the
        # others wait for it); kdist.elastic's state sync then gives every
        # rank rank 0's values instead.
        if self.comm.size > 1 and processes.world_generation() == 0:
            kwargs["initial_value"] = self._broadcast_initial_value(
                kwargs.get("initial_value"), kwargs.get("dtype"), kwargs.get("name"))
        variable = self.default_make_variable(next_creator, **kwargs)
        self._created.append(weakref.ref(variable))
        return variable

    def _broadcast_initial_value(self, initial_value, dtype, name):
        comm = self.comm

        def from_root():
            value = initial_value() if callable(initial_value) else initial_value
            value = tf.convert_to_tensor(value, dtype=dtype)
            return collectives.broadcast(value, root_rank=0, comm=comm,
                                         name=f"initial value of variable '{name}'")

        return from_root

    def read_var(self, replica_local_var):
        value = _tf_private.read_sync_on_read(replica_local_var)
        return tf.identity(replica_local_var) if value is None else value

    def local_results(self, value):
        if isinstance(value, tf.distribute.DistributedValues):
            return _tf_private.local_values(value)
        return (value,)

    def value_container(self, value):
        return value

    # -- reductions -----------------------------------------------------------

    def reduce_values(self, reduce_op, value, destinations, options):
        return self.batch_reduce_values(reduce_op, [(value, destinations)], options)[0]

    def batch_reduce_values(self, reduce_op, value_destination_pairs, options):
        values = [_local_value(v) for v, _ in value_destination_pairs]
        if reduce_op == tf.distribute.ReduceOp.SUM:
            return self._sum(values)
        if reduce_op == tf.distribute.ReduceOp.MEAN:
            return self._mean(values)
        raise ValueError(f"MPIStrategy reduces with SUM or MEAN; got {reduce_op}.")

    def gather_values(self, value, destinations, axis, options):
        value = _local_value(value)
        if axis == 0:
            return collectives.allgather(value, comm=self.comm)
        perm = [axis] + [i for i in range(value.shape.rank) if i != axis]
        gathered = collectives.allgather(tf.transpose(value, perm), comm=self.comm)
        return tf.transpose(gathered, tf.math.invert_permutation(perm))

    def _replica_ctx_all_gather(self, value, axis, options=None):
        return self.gather_values(value, None, axis, options)

    # -- input ----------------------------------------------------------------

    def distribute_dataset(self, dataset, options):
        if self.comm.size > 1:
            dataset = slice_batches(dataset, self.comm.rank, self.comm.size)
        if options is not None:
            return self.default_distribute_dataset(dataset, options)
        # Without TensorFlow's prefetching thread, whose iterator can crash the process
        # when it is destroyed mid-prefetch (see _tf_private); one device needs none.
        return _tf_private.distributed_dataset_without_prefetch_thread(
            dataset, _tf_private.input_workers(self, None), _tf_private.container_strategy(self))

    def distribute_datasets_from_fn(self, dataset_fn, options):
        context = tf.distribute.InputContext(
            num_input_pipelines=self.comm.size, input_pipeline_id=self.comm.rank,
            num_replicas_in_sync=self.comm.size)
        return _tf_private.distributed_datasets_from_function(
            dataset_fn, _tf_private.input_workers(self, options), [context],
            _tf_private.container_strategy(self), options)

    def distribute_values_from_fn(self, value_fn):
        return value_fn(tf.distribute.experimental.ValueContext(
            replica_id_in_sync_group=self.comm.rank, num_replicas_in_sync=self.comm.size))

    # -- roles ----------------------------------------------------------------

    @property
    def should_checkpoint(self):
        return self.comm.rank == 0

    @property
    def should_save_summary(self):
        return self.comm.rank == 0

    batch_size_is_global = True


class _MPIReplicaContext(tf.distribute.ReplicaContext):
    def __init__(self, strategy, rank):
        super().__init__(strategy, replica_id_in_sync_group=rank)

    @property
    def devices(self):
        return self.strategy.extended.worker_devices


def slice_batches(dataset, rank, size):
    """Keeps rank `rank`'s share of every batch: rows `[n*rank//size, n*(rank+1)//size)`.

    The input transformation `MPIStrategy` applies to the datasets it
    distributes. Every rank sees every global batch of `n` rows, so all take
    the same number of steps even when the last batch is short.

    Args:
        dataset: a batched `tf.data.Dataset` (elements may be tuples, dicts
            or other nests; each tensor's first axis is the batch).
        rank: this rank's index, in `[0, size)`.
        size: the number of ranks sharing each batch.

    Returns:
        The dataset of this rank's slices.

    Raises:
        ValueError: the dataset yields unbatched (scalar) elements, or `rank`
            is outside `[0, size)`.

    Example:

        >>> import tensorflow as tf
        >>> ds = tf.data.Dataset.range(8).batch(4)
        >>> [b.numpy().tolist() for b in slice_batches(ds, 1, 2)]
        [[2, 3], [6, 7]]
    """
    if not 0 <= rank < size:
        raise ValueError(f"rank must be in [0, {size}); got {rank}.")
    for spec in tf.nest.flatten(dataset.element_spec):
        if isinstance(spec, tf.TensorSpec) and spec.shape.rank == 0:
            raise ValueError(
                "MPIStrategy splits each batch across the ranks, but this dataset yields "
                f"unbatched elements ({spec}). Batch it with the global batch size first.")

    # tf.data unpacks tuple elements into arguments; pack them back as they were.
    is_tuple = isinstance(dataset.element_spec, tuple)

    def take_share(*args):
        element = args if is_tuple else args[0]
        first = tf.nest.flatten(element)[0]
        rows = tf.shape(first)[0]
        start = rows * rank // size
        stop = rows * (rank + 1) // size
        return tf.nest.map_structure(lambda t: t[start:stop], element)

    # A slice is a view: nothing to gain from tf.data's parallel map threads,
    # and every background thread is one more place for a rank to fail.
    return dataset.map(take_share)


def _local_value(value):
    if isinstance(value, tf.distribute.DistributedValues):
        value = _tf_private.local_values(value)[0]
    return tf.convert_to_tensor(value)


_is_overflow_check = _keras_private.is_loss_scale_finite_check
_is_predict_step = _keras_private.is_predict_step
