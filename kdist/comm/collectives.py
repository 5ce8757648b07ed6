"""Horovod's collectives, on numpy arrays and TensorFlow tensors.

Each function returns the kind of value it was given: numpy in, numpy out;
a tensor in, a tensor out. On tensors they work eagerly, inside
`tf.function` and inside functions compiled with XLA, and gradients flow
through `allreduce`, `grouped_allreduce`, `allgather`, `broadcast`,
`alltoall` and `reducescatter` as in Horovod. Every function takes
`process_set=` (a `kdist.ProcessSet`) or `comm=` (a `Communicator`) to run on
a subset of the ranks.
"""

import numpy as np

from kdist.comm import processes
from kdist.comm.communicator import Average, Sum, reduce_op
from kdist.comm.fusion import block


def _tf():
    import tensorflow as tf

    return tf


def _is_tensor(value):
    import sys

    tf = sys.modules.get("tensorflow")
    return tf is not None and (tf.is_tensor(value) or isinstance(value, tf.Variable))


def _resolve_op(average, op, values=()):
    if op is not None and str(op).lower() == "adasum" and any(
            type(v).__name__ == "IndexedSlices" for v in values):
        raise UnsupportedSparseReduction("Sparse (IndexedSlices) values can be summed or "
                                         "averaged, not reduced with Adasum.")
    if average is not None and op is not None:
        raise ValueError("Pass either `average` or `op` to allreduce, not both.")
    if op is None:
        return Sum if average is False else Average
    return reduce_op(op)


def resolve_comm(comm=None, process_set=None, outside=None):
    """The communicator for a collective: `comm`, the process set's, or the world's. On a
    rank outside the process set: `outside` if given, else an error (see
    `kdist.comm.process_sets.communicator_of`)."""
    if comm is not None and process_set is not None:
        raise ValueError("Pass either comm= or process_set=, not both.")
    if process_set is not None:
        from kdist.comm.process_sets import communicator_of

        return communicator_of(process_set, outside=outside)
    return comm if comm is not None else processes.world()


def _compression(compression):
    from kdist.comm import compression as compression_lib

    return compression_lib.get(compression)


def allreduce(tensor, average=None, device_dense="", device_sparse="", compression=None,
              op=None, prescale_factor=1.0, postscale_factor=1.0, name=None,
              process_set=None, ignore_name_scope=False, comm=None):
    """Reduces a value across ranks: Average (default), Sum, Min, Max or Product.

    `prescale_factor` multiplies each rank's value before the reduction and
    `postscale_factor` the result. An average divides by the number of ranks
    that contributed (ranks that have joined with `kdist.join` do not count).

    Example:

        On 2 ranks, where rank 0 holds `[1, 2]` and rank 1 `[2, 4]`:

        >>> import numpy as np, kdist
        >>> kdist.init()
        >>> value = np.array([1.0, 2.0]) * (kdist.rank() + 1)
        >>> kdist.allreduce(value)
        array([1.5, 3. ])
        >>> kdist.allreduce(value, op=kdist.Sum)
        array([3., 6.])
    """
    op = _resolve_op(average, op, [tensor])
    comm = resolve_comm(comm, process_set)
    if not _is_tensor(tensor):
        return _numpy_allreduce(np.asarray(tensor), op, comm, prescale_factor, postscale_factor,
                                name or "")
    tf = _tf()
    if isinstance(tensor, tf.IndexedSlices):
        _check_sparse(op, prescale_factor, postscale_factor)
        return _allreduce_sparse(tensor, op, comm)
    from kdist.comm import differentiable, graph_ops

    with graph_ops.separate_call():
        return differentiable.allreduce(tf.convert_to_tensor(tensor), op, comm, prescale_factor,
                                        postscale_factor, _compression(compression),
                                        label=name or "allreduce")


def _numpy_allreduce(array, op, comm, prescale, postscale, label):
    out = np.array(array, copy=True, order="C")
    if out.dtype.kind not in "fiub" and out.dtype.name != "bfloat16":
        raise TypeError(f"allreduce supports numeric arrays; got dtype {out.dtype}.")
    if out.dtype.kind != "f" and out.dtype.name != "bfloat16" and (
            op == Average or prescale != 1.0 or postscale != 1.0):
        # Integers as Horovod treats them: scaled in float64 and truncated back;
        # an average is the sum divided by the number of ranks, truncated too.
        if prescale != 1.0:
            out = np.trunc(out * prescale).astype(out.dtype)
        inner_op = Sum if op == Average else op
        summed = _numpy_allreduce(out, inner_op, comm, 1.0, 1.0, label)
        if op == Average:
            postscale = postscale / comm.size
        if postscale != 1.0:
            summed = np.trunc(summed * postscale).astype(out.dtype)
        return summed.reshape(out.shape)
    if op in (Average, Sum):
        return comm.allreduce_many([out], op=Sum, average=op == Average, prescale=prescale,
                                   postscale=postscale, label=label)[0].reshape(out.shape)
    if prescale != 1.0:
        out *= prescale
    comm.allreduce_(out, op=op, label=label)
    if postscale != 1.0:
        out *= postscale
    return out


def _check_sparse(op, prescale, postscale):
    if op not in (Average, Sum):
        raise UnsupportedSparseReduction(
            f"Sparse (IndexedSlices) values can be summed or averaged, not {op}.")
    if prescale != 1.0 or postscale != 1.0:
        raise UnsupportedSparseReduction(
            "Sparse (IndexedSlices) values cannot be prescaled or postscaled; scale them "
            "first, or convert them to dense tensors.")


def _allreduce_sparse(slices, op, comm):
    """Horovod's reduction of sparse gradients: gather every rank's rows and values."""
    tf = _tf()
    values = allgather(slices.values, comm=comm)
    indices = allgather(slices.indices, comm=comm)
    if op == Average:
        from kdist.comm import graph_ops

        values = values / graph_ops.size_when_run(comm, values.dtype)
    return tf.IndexedSlices(values, indices, dense_shape=slices.dense_shape)


def grouped_allreduce(tensors, average=None, device_dense="", device_sparse="",
                      compression=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                      process_set=None, name=None, comm=None):
    """Reduces a list of values in one fused collective; returns them in order.

    Example:

        >>> import numpy as np, kdist
        >>> [a.tolist() for a in kdist.grouped_allreduce([np.ones(2), np.zeros(3)])]
        [[1.0, 1.0], [0.0, 0.0, 0.0]]
    """
    tensors = list(tensors)
    op = _resolve_op(average, op, tensors)
    comm = resolve_comm(comm, process_set)
    if not any(_is_tensor(t) for t in tensors):
        if op in (Average, Sum):
            return _numpy_grouped(tensors, op, comm, prescale_factor, postscale_factor,
                                  name or "")
        return [_numpy_allreduce(np.asarray(t), op, comm, prescale_factor, postscale_factor,
                                 name or "") for t in tensors]
    tf = _tf()
    from kdist.comm import differentiable

    sparse = [i for i, t in enumerate(tensors) if isinstance(t, tf.IndexedSlices)]
    if sparse:
        _check_sparse(op, prescale_factor, postscale_factor)
    dense = [i for i in range(len(tensors)) if i not in set(sparse)]
    results = [None] * len(tensors)
    for i in sparse:
        results[i] = _allreduce_sparse(tensors[i], op, comm)
    if dense:
        reduced = differentiable.grouped_allreduce(
            [tf.convert_to_tensor(tensors[i]) for i in dense], op, comm, prescale_factor,
            postscale_factor, _compression(compression), label=name or "grouped_allreduce")
        for i, r in zip(dense, reduced):
            results[i] = r
    return results


def _numpy_grouped(arrays, op, comm, prescale, postscale, label):
    arrays = [np.asarray(a) for a in arrays]
    results = [None] * len(arrays)
    by_dtype = {}
    for index, a in enumerate(arrays):
        by_dtype.setdefault(a.dtype, []).append(index)
    for indices in by_dtype.values():
        reduced = comm.allreduce_many([arrays[i] for i in indices], op=Sum,
                                      average=op == Average, prescale=prescale,
                                      postscale=postscale, label=label)
        for i, r in zip(indices, reduced):
            results[i] = r
    return results


def broadcast(tensor, root_rank=0, name=None, process_set=None, ignore_name_scope=False,
              comm=None):
    """Returns `root_rank`'s value of `tensor` on every rank."""
    comm = resolve_comm(comm, process_set)
    root_rank = root_within(root_rank, comm, process_set)
    if not _is_tensor(tensor):
        out = np.array(tensor, copy=True, order="C")
        return comm.bcast_(out, root=root_rank, label=name or "")
    from kdist.comm import differentiable

    return differentiable.broadcast(_tf().convert_to_tensor(tensor), root_rank, comm,
                                    label=name or "broadcast")


def allgather(tensor, name=None, process_set=None, ignore_name_scope=False, comm=None):
    """Concatenates every rank's value along the first axis (sizes may differ)."""
    comm = resolve_comm(comm, process_set)
    if not _is_tensor(tensor):
        return comm.allgather_rows(np.asarray(tensor), label=name or "")
    from kdist.comm import differentiable

    return differentiable.allgather(_tf().convert_to_tensor(tensor), comm,
                                    label=name or "allgather")


def grouped_allgather(tensors, name=None, process_set=None, ignore_name_scope=False,
                      comm=None):
    """`allgather` of each value of a list; returns the gathered values in order.

    Example:

        On 2 ranks:

        >>> import numpy as np, kdist
        >>> [a.shape for a in kdist.grouped_allgather([np.ones((2, 3)), np.zeros(1)])]
        [(4, 3), (2,)]
    """
    return [allgather(t, name=name, process_set=process_set, comm=comm) for t in tensors]


def alltoall(tensor, splits=None, name=None, process_set=None, ignore_name_scope=False,
             comm=None):
    """Sends `splits[i]` rows of `tensor` to rank i and returns the rows received.

    Without `splits` the rows are split equally (their number must divide by
    the number of ranks) and only the received rows are returned; with
    `splits`, also how many rows came from each rank, as Horovod does.
    """
    comm = resolve_comm(comm, process_set)
    rows = np.shape(tensor)[0] if np.ndim(tensor) else 0
    if splits is None:
        if rows is None:  # a symbolic tensor whose rows are known only when it runs
            tf = _tf()
            rows = tf.shape(tensor, out_type=tf.int64)[0]
            counts = tf.fill([comm.size], rows // comm.size)
            counts = tf.ensure_shape(counts, [comm.size])
            with tf.control_dependencies([tf.debugging.assert_equal(
                    rows % comm.size, tf.constant(0, tf.int64),
                    message=f"alltoall without splits divides the first dimension equally "
                            f"over {comm.size} ranks; pass splits=.")]):
                counts = tf.identity(counts)
        elif np.ndim(tensor) == 0 or rows % comm.size:
            error = _argument_error(tensor)
            raise error(f"alltoall without splits divides the first dimension equally, "
                        f"but {rows} rows do not divide by {comm.size} ranks; pass splits=.")
        else:
            counts = np.full(comm.size, rows // comm.size, dtype=np.int64)
    else:
        counts = splits
    if not _is_tensor(tensor) and not _is_tensor(counts):
        received, received_counts = comm.alltoallv(np.asarray(tensor), np.asarray(counts),
                                                   label=name or "")
    else:
        from kdist.comm import differentiable

        received, received_counts = differentiable.alltoall(
            _tf().convert_to_tensor(tensor), counts, comm, label=name or "alltoall")
    return received if splits is None else (received, received_counts)


def _argument_error(value):
    """The class for a bad argument: TensorFlow's InvalidArgumentError (a ValueError too)
    for tensors, as Horovod's ops raise; ValueError for numpy values."""
    if _is_tensor(value):
        from kdist.comm.graph_ops import TensorArgumentError

        return TensorArgumentError
    return ValueError


class UnsupportedSparseReduction(NotImplementedError, ValueError):
    """A reduction Horovod does not define for `tf.IndexedSlices` (Min, Max, Product,
    Adasum, scaling): `NotImplementedError`, as in Horovod, and a `ValueError`."""


def reducescatter(tensor, device_dense="", compression=None, op=Average, name=None,
                  process_set=None, ignore_name_scope=False, prescale_factor=1.0,
                  postscale_factor=1.0, comm=None):
    """Reduces `tensor` across ranks and gives each rank its block of rows.

    Rank r receives rows `[start_r, start_r + n_r)` where the first
    `rows % size` ranks get one row more, as in Horovod.

    Example:

        On 2 ranks, rank 0 gets the sum's first two rows and rank 1 the last two:

        >>> import numpy as np, kdist
        >>> kdist.init()
        >>> block = kdist.reducescatter(np.arange(4.0), op=kdist.Sum)
        >>> block.shape
        (2,)
        >>> kdist.allgather(block)
        array([0., 2., 4., 6.])
    """
    op = reduce_op(op)
    comm = resolve_comm(comm, process_set)
    if np.ndim(tensor) == 0:
        raise ValueError("reducescatter needs a tensor of at least one dimension.")
    if not _is_tensor(tensor):
        reduced = _numpy_allreduce(np.asarray(tensor), op, comm, prescale_factor,
                                   postscale_factor, name or "")
        start, stop = block(reduced.shape[0], comm.rank, comm.size)
        return reduced[start:stop]
    from kdist.comm import differentiable

    return differentiable.reducescatter(_tf().convert_to_tensor(tensor), op, comm,
                                        prescale_factor, postscale_factor,
                                        _compression(compression), label=name or "reducescatter")


def grouped_reducescatter(tensors, device_dense="", compression=None, op=Average, name=None,
                          process_set=None, ignore_name_scope=False, prescale_factor=1.0,
                          postscale_factor=1.0, comm=None):
    """`reducescatter` of each value of a list, reduced in one fused collective per dtype.

    Example:

        On 2 ranks:

        >>> import numpy as np, kdist
        >>> blocks = kdist.grouped_reducescatter([np.arange(4.0), np.ones((2, 3))], op=kdist.Sum)
        >>> [b.shape for b in blocks]
        [(2,), (1, 3)]
    """
    op = reduce_op(op)
    comm = resolve_comm(comm, process_set)
    tensors = list(tensors)
    for t in tensors:
        if np.ndim(t) == 0:
            raise ValueError("reducescatter needs tensors of at least one dimension; got a "
                             "scalar.")
    if not any(_is_tensor(t) for t in tensors):
        reduced = grouped_allreduce(tensors, op=op, prescale_factor=prescale_factor,
                                    postscale_factor=postscale_factor, comm=comm,
                                    name=name or "grouped_reducescatter")
        return [r[slice(*block(r.shape[0], comm.rank, comm.size))] for r in reduced]
    tf = _tf()
    from kdist.comm import differentiable

    return differentiable.grouped_reducescatter(
        [tf.convert_to_tensor(t) for t in tensors], op, comm, prescale_factor,
        postscale_factor, _compression(compression), label=name or "grouped_reducescatter")


def broadcast_object(obj, root_rank=0, name=None, process_set=None, comm=None):
    """Returns `root_rank`'s picklable object on every rank."""
    comm = resolve_comm(comm, process_set)
    return comm.bcast_object(obj, root=root_within(root_rank, comm, process_set))


def broadcast_object_fn(root_rank=0, session=None, name=None, process_set=None, comm=None):
    """Horovod's factory: a function of one object that returns `root_rank`'s object.

    `session` (TensorFlow 1) is accepted and ignored.
    """
    def broadcast_one(obj):
        return broadcast_object(obj, root_rank=root_rank, process_set=process_set, comm=comm)

    return broadcast_one


def allgather_object(obj, name=None, process_set=None, comm=None):
    """Returns the list of every rank's picklable object, in rank order."""
    return resolve_comm(comm, process_set).allgather_object(obj)


def barrier(process_set=None, comm=None):
    """Waits until every rank has reached this call."""
    resolve_comm(comm, process_set).barrier()


def root_within(root_rank, comm, process_set=None):
    """`root_rank` as a rank of `comm`: with a process set, as in Horovod, `root_rank` is a
    rank of the whole job (and must be in the set); with `comm=`, a rank of `comm`."""
    if isinstance(root_rank, bool) or not isinstance(root_rank, (int, np.integer)):
        raise TypeError(f"root_rank must be an integer rank; got {root_rank!r}.")
    root_rank = int(root_rank)
    ranks = getattr(process_set, "ranks", None)
    if ranks is not None and process_set.process_set_id != 0:
        if root_rank not in ranks:
            raise ValueError(f"root_rank={root_rank} is not in the process set (its ranks: "
                             f"{ranks}); with process_set=, root_rank is a rank of the "
                             "whole job, as in Horovod.")
        return ranks.index(root_rank)
    if not 0 <= root_rank < comm.size:
        raise ValueError(f"root_rank={root_rank} is not a rank of this job (ranks 0 to "
                         f"{comm.size - 1}).")
    return root_rank


def broadcast_variables(variables, root_rank=0, process_set=None, comm=None):
    """Sets every variable to its value on `root_rank`, checking that models match.

    Before any bytes move, every rank compares the names, shapes and dtypes of
    its variables with the root's; a mismatch raises `ValueError` on every rank
    naming the first variable that differs, instead of corrupting weights or
    hanging.
    """
    comm = resolve_comm(comm, process_set)
    root_rank = root_within(root_rank, comm, process_set)
    variables = list(variables)
    import sys

    tf = sys.modules.get("tensorflow")
    if tf is not None and not tf.executing_eagerly():
        return _broadcast_variables_in_graph(variables, root_rank, comm)
    if comm.size == 1:
        return
    signature = [(variable_name(v), tuple(v.shape), np.dtype(_numpy_dtype(v)).str)
                 for v in variables]
    compare_signatures(comm.allgather_object(signature), root_rank)
    groups = {}
    for v, (_, _, dtype) in zip(variables, signature):
        groups.setdefault(dtype, []).append(v)
    for dtype, group in groups.items():
        if comm.rank == root_rank:
            flat = np.concatenate([np.asarray(v.numpy(), dtype=dtype).reshape(-1) for v in group]
                                  or [np.empty(0, dtype)])
        else:
            flat = np.empty(sum(int(np.prod(v.shape)) for v in group), dtype=dtype)
        flat = np.ascontiguousarray(flat)
        comm.bcast_(flat.view(np.uint8), root=root_rank, label="broadcast_variables")
        offset = 0
        for v in group:
            n = int(np.prod(v.shape))
            v.assign(flat[offset:offset + n].reshape(tuple(v.shape)))
            offset += n


def _broadcast_variables_in_graph(variables, root_rank, comm):
    """`broadcast_variables` inside a `tf.function` (or an XLA program): one
    broadcast per dtype of every variable's value, then assignments.

    Shapes and dtypes are checked by the collective's own header (a rank whose
    variables hold another number of values fails on every rank); names are
    checked only eagerly. Returns the group of assignments.
    """
    tf = _tf()
    from kdist.comm import graph_ops

    groups = {}
    for v in variables:
        groups.setdefault(v.dtype, []).append(v)
    assignments = []
    for dtype, group in groups.items():
        flat = tf.concat([tf.reshape(tf.convert_to_tensor(v), [-1]) for v in group], axis=0)
        flat = graph_ops.broadcast(flat, comm, root=root_rank, label="broadcast_variables")
        sizes = [int(np.prod(v.shape)) for v in group]
        for v, value in zip(group, tf.split(flat, sizes)):
            assignments.append(v.assign(tf.reshape(value, v.shape)))
    return tf.group(*[a for a in assignments if tf.is_tensor(a) or isinstance(a, tf.Operation)])


def broadcast_(variables, root_rank=0, name=None, process_set=None, comm=None):
    """Horovod's in-place broadcast: sets each variable to `root_rank`'s value and
    returns the new values (as tensors), eagerly or inside `tf.function`.

    Example:

        On 2 ranks:

        >>> import tensorflow as tf, kdist
        >>> v = tf.Variable([float(kdist.rank())])
        >>> [t.numpy().tolist() for t in kdist.broadcast_([v], root_rank=1)]
        [[1.0]]
    """
    variables = list(variables)
    done = broadcast_variables(variables, root_rank=root_rank, process_set=process_set,
                               comm=comm)
    tf = _tf()
    with tf.control_dependencies([done] if done is not None else []):
        return [tf.identity(tf.convert_to_tensor(v)) for v in variables]


def broadcast_global_variables(root_rank=0):
    """Horovod's TF1 call; Keras 3 has no global variable collection to broadcast.

    Raises `NotImplementedError` saying what to use instead.
    """
    raise NotImplementedError(
        "broadcast_global_variables broadcasts TensorFlow 1's global variable collection, "
        "which Keras 3 models do not use. Call kdist.broadcast_variables(model.variables, "
        f"root_rank={root_rank}) or add kdist.callbacks.BroadcastGlobalVariablesCallback("
        f"{root_rank}) to fit's callbacks.")


def variable_name(v):
    """A variable's path (Keras 3) or name."""
    return getattr(v, "path", None) or getattr(v, "name", "?")


def _numpy_dtype(v):
    dtype = v.dtype
    return getattr(dtype, "as_numpy_dtype", dtype)


def compare_signatures(signatures, root_rank=0, what="to broadcast"):
    """Raises `ValueError` naming the first variable whose shape or dtype differs from the root's.

    `signatures[rank]` is that rank's list of `(name, shape, dtype)`.
    """
    root = signatures[root_rank]
    for other_rank, theirs in enumerate(signatures):
        for mine, root_var in zip(theirs, root):
            if tuple(mine[1:]) != tuple(root_var[1:]):
                raise ValueError(
                    f"Variable '{root_var[0]}' has shape {tuple(root_var[1])} "
                    f"({np.dtype(root_var[2])}) on rank {root_rank} but '{mine[0]}' has shape "
                    f"{tuple(mine[1])} ({np.dtype(mine[2])}) on rank {other_rank}: every rank "
                    "must build the same model.")
        if len(theirs) != len(root):
            extra = theirs[len(root):] or root[len(theirs):]
            owner = other_rank if len(theirs) > len(root) else root_rank
            raise ValueError(
                f"Rank {other_rank} has {len(theirs)} variables {what} but rank {root_rank} has "
                f"{len(root)}; the first extra one is '{extra[0][0]}' on rank {owner}: every "
                "rank must build the same model.")
