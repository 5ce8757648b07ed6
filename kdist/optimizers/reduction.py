"""How a list of gradients is reduced over the ranks, shared by the optimizer and the tape.

`DistributedOptimizer` (Keras's `fit`, `apply_gradients`) and
`DistributedGradientTape` (custom loops) reduce gradients the same way:
dense gradients travel in fused buckets (`kdist.comm.tensors.TensorReducer`),
sparse ones (`tf.IndexedSlices`, from embeddings) by allgathering their rows
unless `sparse_as_dense`, and the gradients of variables registered as local
stay on this rank (divided by the number of ranks with
`scale_local_gradients`, as Horovod does). `GradientReduction` holds those
settings and the bucket plans; the optimizer and the tape each own one.
"""

import keras

from kdist import Adasum, _args
from kdist._variables import path_of
from kdist.comm import collectives
from kdist.comm import compression as compression_lib
from kdist.comm import processes
from kdist.comm import tensors
from kdist.comm.processes import Average, Sum


class GradientReduction:
    """Reduces lists of gradients over a communicator, as Horovod's optimizer and tape do.

    Args:
        comm: the `kdist.comm.Communicator` (the world by default, looked up
            at each call so that an elastic job's new world is used).
        compression: `kdist.Compression.none`, `.fp16` or `.topk(ratio)`.
        op: `kdist.Average` (default) or `kdist.Sum`.
        bucket_bytes: most bytes of gradient per collective; None (the default):
            `KDIST_BUCKET_BYTES` where set, else 64 MiB on one host and a quarter of the
            gradient (1-64 MiB) when the job spans hosts, so that buckets overlap the
            backward pass (`kdist plan --measure` recommends a size).
        num_groups: if positive, about this many collectives of equal size.
        groups: None, or a list of lists of variables (or variable paths),
            each fused into one collective.
        gradient_predivide_factor: with `op=kdist.Average`, scale by `1 / f`
            before the sum and by `f / size` after it.
        sparse_as_dense: reduce `tf.IndexedSlices` as dense tensors.
        scale_local_gradients: divide local variables' gradients by the
            number of ranks.
        name: names the collectives in errors and in the timeline.

    Example:

        >>> import tensorflow as tf
        >>> from kdist.optimizers.reduction import GradientReduction
        >>> [g.shape for g in GradientReduction()([tf.ones(3), None])[:1]]
        [TensorShape([3])]
    """

    def __init__(self, comm=None, compression=None, op=None,
                 bucket_bytes=None, num_groups=0, groups=None,
                 gradient_predivide_factor=1.0, sparse_as_dense=False,
                 scale_local_gradients=True, name="kdist"):
        self.op = check_op(op)
        self.gradient_predivide_factor = _args.positive_number(
            gradient_predivide_factor, "gradient_predivide_factor")
        if self.gradient_predivide_factor != 1.0 and self.op != Average:
            raise ValueError("gradient_predivide_factor splits an average before and after the "
                             f"sum; it needs op=kdist.Average, not op={op!r}.")
        self.num_groups, self.groups = check_groups(groups, num_groups)
        self.bucket_bytes = (None if bucket_bytes is None
                             else _args.whole_number(bucket_bytes, "bucket_bytes", minimum=1))
        self.compression = compression_lib.get(compression)
        self.sparse_as_dense = bool(sparse_as_dense)
        self.scale_local_gradients = bool(scale_local_gradients)
        self.name = name
        self.local_sources = []
        self.reducers = {}  # fusion groups (positions) -> TensorReducer
        self._comm = comm

    @property
    def comm(self):
        return self._comm if self._comm is not None else processes.world()

    def register_local(self, source):
        """Keeps `source`'s gradient on this rank: a variable, a layer or a variable path."""
        if not (isinstance(source, (str, keras.layers.Layer)) or is_variable(source)):
            raise TypeError("A local variable is given as a variable, a layer or a variable "
                            f"path; got {type(source).__name__}.")
        self.local_sources.append(source)

    def local_keys(self):
        """(ids, paths) of the variables whose gradients stay on this rank."""
        ids, paths = set(), set()
        for source in self.local_sources:
            if isinstance(source, str):
                paths.add(source)
            elif isinstance(source, keras.layers.Layer):
                ids.update(id(w) for w in source.trainable_weights)
            else:
                ids.add(id(source))
        return ids, paths

    def is_local(self, variable, keys=None):
        ids, paths = keys if keys is not None else self.local_keys()
        return variable is not None and (id(variable) in ids or path_of(variable) in paths)

    def __call__(self, grads, variables=None):
        """Returns `grads` reduced over the ranks; None entries stay None.

        `variables`, in the same order, lets local variables and explicit
        groups be honoured.
        """
        import tensorflow as tf

        from kdist.comm import graph_ops

        grads = list(grads)
        if graph_ops.single_rank(self.comm):
            return grads
        keys = self.local_keys()
        local = [self.is_local(v, keys) for v in (variables or [None] * len(grads))]
        reduced = list(grads)
        dense = [None] * len(grads)
        for i, grad in enumerate(grads):
            if grad is None or local[i]:
                continue
            if isinstance(grad, tf.IndexedSlices) and not self.sparse_as_dense:
                reduced[i] = self._reduce_slices(grad)
            else:
                dense[i] = grad
        if any(g is not None for g in dense):
            results = self._reducer_for(self._group_positions(variables))(dense)
            for i, result in enumerate(results):
                if dense[i] is not None:
                    reduced[i] = result
        if self.scale_local_gradients:
            for i, grad in enumerate(grads):
                if grad is not None and local[i]:
                    reduced[i] = divide(grad, graph_ops.size_when_run(self.comm, _dtype(grad)))
        return reduced

    def _reduce_slices(self, grad):
        """A sparse gradient's reduction: every rank's rows, gathered (and averaged)."""
        import tensorflow as tf

        from kdist.comm import graph_ops

        values = collectives.allgather(grad.values, comm=self.comm, name=f"{self.name}_values")
        indices = collectives.allgather(grad.indices, comm=self.comm,
                                        name=f"{self.name}_indices")
        if self.op == Average:
            values = values / graph_ops.size_when_run(self.comm, values.dtype)
        return tf.IndexedSlices(values, indices, dense_shape=grad.dense_shape)

    def _group_positions(self, variables):
        if self.groups is None or variables is None:
            return None
        positions = []
        for group in self.groups:
            ids = {id(m) for m in group if not isinstance(m, str)}
            paths = {m for m in group if isinstance(m, str)}
            members = [i for i, v in enumerate(variables)
                       if id(v) in ids or path_of(v) in paths]
            if members:
                positions.append(tuple(members))
        return tuple(positions)

    def _reducer_for(self, groups):
        reducer = self.reducers.get(groups)
        if reducer is None:
            reducer = self.reducers[groups] = tensors.TensorReducer(
                self._comm, self.compression, average=self.op == Average,
                bucket_bytes=self.bucket_bytes, num_groups=self.num_groups, name=self.name,
                groups=groups, prescale_factor=1.0 / self.gradient_predivide_factor,
                postscale_factor=self.gradient_predivide_factor)
        return reducer


def check_op(op):
    """`kdist.Average` or `kdist.Sum` from Horovod's `op` argument."""
    if op is None or op == Average:
        return Average
    if op == Sum:
        return Sum
    if op == Adasum:
        raise ValueError("Adasum is not available in kdist. Use op=kdist.Average (the default) "
                         "to average gradients, or op=kdist.Sum to add them.")
    raise ValueError(f"Gradients are reduced with op=kdist.Average or op=kdist.Sum; got "
                     f"op={op!r}.")


def check_groups(groups, num_groups):
    """(num_groups, explicit groups) from Horovod's `groups` and `num_groups`."""
    num_groups = _args.whole_number(num_groups or 0, "num_groups", minimum=0)
    if groups is None:
        return num_groups, None
    if not isinstance(groups, (list, tuple)):
        count = _args.whole_number(groups, "groups", minimum=1)
        return count, None
    explicit, seen = [], set()
    for group in groups:
        if not isinstance(group, (list, tuple)):
            raise TypeError("groups must be a number of groups or a list of lists of variables; "
                            f"got a {type(group).__name__} inside the list.")
        members = []
        for member in group:
            if not (isinstance(member, str) or is_variable(member)):
                raise TypeError("Each group lists variables (or variable paths); got "
                                f"{type(member).__name__}.")
            key = member if isinstance(member, str) else path_of(member)
            if key in seen:
                raise ValueError(f"Variable '{key}' is in more than one group; each gradient "
                                 "travels in one collective only.")
            seen.add(key)
            members.append(member)
        explicit.append(members)
    return num_groups, explicit


def is_variable(value):
    import tensorflow as tf

    return isinstance(value, (keras.Variable, tf.Variable))


def local_paths(sources):
    """The variable paths of local sources (variables, layers or paths)."""
    paths = set()
    for source in sources:
        if isinstance(source, str):
            paths.add(source)
        elif isinstance(source, keras.layers.Layer):
            paths.update(path_of(w) for w in source.trainable_weights)
        else:
            paths.add(path_of(source))
    return paths


def local_layer_list(local_layers, error=TypeError):
    """Horovod's `local_layers` (None, a layer or layers) as a list of Keras layers.

    Anything else raises `error`: Horovod's optimizer raises TypeError, its tape ValueError.
    """
    if local_layers is None:
        return []
    if isinstance(local_layers, keras.layers.Layer):
        return [local_layers]
    layers = list(local_layers)
    for layer in layers:
        if not isinstance(layer, keras.layers.Layer):
            raise error(f"local_layers must be Keras layers; got {type(layer).__name__}.")
    return layers


def _dtype(grad):
    import tensorflow as tf

    return (grad.values if isinstance(grad, tf.IndexedSlices) else grad).dtype


def divide(grad, size):
    import tensorflow as tf

    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values / size, grad.indices, grad.dense_shape)
    return grad / size
