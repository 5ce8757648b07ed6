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

    Returns a numpy array for a numpy array (or anything else numpy takes), a tensor for a
    tensor, shaped like the input. An average divides by the number of ranks that
    contributed: ranks that have joined with `kdist.join` do not count.

    Integers are averaged as Horovod averages them: summed, divided by the number of
    ranks and truncated toward zero (`[3]` and `[6]` on two ranks give `[4]`);
    `prescale_factor` and `postscale_factor` scale integers in float64 and truncate
    back, as Horovod does. Arrays that are not numeric raise `TypeError`.

    A `tf.IndexedSlices` (an embedding's gradient) is reduced as Horovod reduces it, by
    allgathering its indices and values (the values divided by the number of ranks for
    Average). It takes Sum or Average only, and no scaling: anything else raises
    `kdist.comm.collectives.UnsupportedSparseReduction`, both a `NotImplementedError`
    (as in Horovod) and a `ValueError`.

    Gradients flow through Sum and Average: the gradient is the same allreduce of the
    upstream gradient. Min, Max and Product have no gradient (`ValueError` when one is
    taken).

    Args:
        tensor: a numpy array (or a list, a number) or a TensorFlow tensor, variable or
            `tf.IndexedSlices`.
        average: Horovod's older switch: `True` means `op=kdist.Average`, `False`
            `op=kdist.Sum`. Pass `average` or `op`, not both (`ValueError`).
        compression: a `kdist.Compression` mode (or its name or config) for floating
            tensors reduced with Sum or Average; numpy arrays travel as they are. Called
            this way, top-k keeps no residual between calls.
        op: `kdist.Average` (the default), `kdist.Sum`, `kdist.Min`, `kdist.Max` or
            `kdist.Product`. `kdist.Adasum` and any other value raise `ValueError`.
        prescale_factor: multiplies each rank's value before the reduction.
        postscale_factor: multiplies the result.
        name: labels the collective in error messages, stall reports and the timeline.
        process_set: a registered `kdist.ProcessSet` to run on instead of the world.
        comm: a `kdist.comm.Communicator` to run on instead of the world (not with
            `process_set`: passing both raises `ValueError`).
        device_dense: accepted for compatibility; no effect (kdist reduces on the host).
        device_sparse: accepted for compatibility; no effect.
        ignore_name_scope: accepted for compatibility; no effect.

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
    """Reduces a list of values as `kdist.allreduce` does; returns them in order.

    The values are fused by dtype, as the optimizer's buckets are: one collective per
    dtype (for numpy arrays reduced with Min, Max or Product, one per value).
    `tf.IndexedSlices` in the list are reduced by allgather, as `allreduce` reduces
    them. Gradients flow through it as through `allreduce`. The arguments are
    `allreduce`'s, with `tensors` a list.

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
    """Returns `root_rank`'s value of `tensor` on every rank.

    Gradients flow through it: the root gets the upstream gradient averaged over the
    ranks, the other ranks zero.

    Args:
        tensor: a numpy array or a TensorFlow tensor, the same shape and dtype on every
            rank.
        root_rank: the rank whose value every rank receives. With `process_set=`, as in
            Horovod, a rank of the whole job that must be one of the set's; with `comm=`,
            a rank of that communicator. A rank outside them raises `ValueError`, one
            that is not an integer `TypeError`.
        name: labels the collective in error messages, stall reports and the timeline.
        process_set: a registered `kdist.ProcessSet` to run on instead of the world.
        comm: a `kdist.comm.Communicator` to run on instead of the world (not with
            `process_set`: passing both raises `ValueError`).
        ignore_name_scope: accepted for compatibility; no effect.
    """
    comm = resolve_comm(comm, process_set)
    root_rank = root_within(root_rank, comm, process_set)
    if not _is_tensor(tensor):
        out = np.array(tensor, copy=True, order="C")
        return comm.bcast_(out, root=root_rank, label=name or "")
    from kdist.comm import differentiable

    return differentiable.broadcast(_tf().convert_to_tensor(tensor), root_rank, comm,
                                    label=name or "broadcast")


def allgather(tensor, name=None, process_set=None, ignore_name_scope=False, comm=None):
    """Concatenates every rank's value along the first axis, in rank order.

    The first dimension may differ between ranks; other dimensions or dtypes that differ
    are a mismatch (see `kdist.comm.CollectiveMismatch`). Scalars raise `ValueError`. In
    a graph the result's first dimension is unknown. Under XLA the result's shape is
    fixed when the function is compiled (the number of ranks times this rank's rows),
    so every rank must give the same number of rows (an error says so otherwise); a
    rank that has joined (`kdist.join`) gives none, and zeros fill the rows it would
    have sent, at the end.

    Gradients flow through it: the upstream gradient is averaged over the ranks and
    sliced back to this rank's rows.

    Args:
        tensor: a numpy array or a TensorFlow tensor of at least one dimension.
        name: labels the collective in error messages, stall reports and the timeline.
        process_set: a registered `kdist.ProcessSet` to run on instead of the world.
        comm: a `kdist.comm.Communicator` to run on instead of the world (not with
            `process_set`: passing both raises `ValueError`).
        ignore_name_scope: accepted for compatibility; no effect.

    Example:

        >>> import numpy as np, kdist
        >>> kdist.allgather(np.array([[1, 2]])).tolist()  # one process: its own rows
        [[1, 2]]
    """
    comm = resolve_comm(comm, process_set)
    if not _is_tensor(tensor):
        return comm.allgather_rows(np.asarray(tensor), label=name or "")
    from kdist.comm import differentiable

    return differentiable.allgather(_tf().convert_to_tensor(tensor), comm,
                                    label=name or "allgather")


def grouped_allgather(tensors, name=None, process_set=None, ignore_name_scope=False,
                      comm=None):
    """`kdist.allgather` of each value of a list; returns the gathered values in order.

    Example:

        On 2 ranks:

        >>> import numpy as np, kdist
        >>> [a.shape for a in kdist.grouped_allgather([np.ones((2, 3)), np.zeros(1)])]
        [(4, 3), (2,)]
    """
    return [allgather(t, name=name, process_set=process_set, comm=comm) for t in tensors]


def alltoall(tensor, splits=None, name=None, process_set=None, ignore_name_scope=False,
             comm=None):
    """Sends `splits[i]` consecutive rows of `tensor` to rank i; returns the rows received.

    Without `splits` the rows are split equally and only the received rows, in rank
    order, are returned. With `splits` it returns `(received, received_splits)`, the
    second holding how many rows came from each rank, as Horovod does.

    Gradients flow through it: each row's gradient goes back to the rank it came from.
    Its result's shape is known only when it runs, so it cannot be compiled with XLA
    (`ValueError`). On tensors it always runs in Python (a py-function op in a graph).

    Args:
        tensor: a numpy array or a TensorFlow tensor of at least one dimension.
        splits: one non-negative row count per rank, adding up to the number of rows
            (`ValueError` otherwise). Without it the number of rows must divide by the
            number of ranks: `ValueError` otherwise, for tensors TensorFlow's
            `InvalidArgumentError`, which is a `ValueError` too; a tensor whose rows are
            known only when it runs is checked then.
        name: labels the collective in error messages, stall reports and the timeline.
        process_set: a registered `kdist.ProcessSet` to run on instead of the world.
        comm: a `kdist.comm.Communicator` to run on instead of the world (not with
            `process_set`: passing both raises `ValueError`).
        ignore_name_scope: accepted for compatibility; no effect.

    Example:

        >>> import numpy as np, kdist
        >>> kdist.alltoall(np.arange(4)).tolist()  # one process: every row stays
        [0, 1, 2, 3]
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

    Of `n` rows, the first `n % size` ranks get `n // size + 1` rows and the others
    `n // size`, in rank order, as in Horovod. It is an allreduce of the whole tensor
    (as `kdist.allreduce` reduces it, with the same arguments) followed by the slice.
    Scalars raise `ValueError`. Gradients flow through it: the gradient is gathered
    from every rank's block.

    Args:
        tensor: a numpy array or a TensorFlow tensor of at least one dimension.
        op: `kdist.Average` (the default), `kdist.Sum`, `kdist.Min`, `kdist.Max` or
            `kdist.Product`.
        compression: a `kdist.Compression` mode for floating tensors (Sum or Average).
        prescale_factor: multiplies each rank's value before the reduction.
        postscale_factor: multiplies the result.
        name: labels the collective in error messages, stall reports and the timeline.
        process_set: a registered `kdist.ProcessSet` to run on instead of the world.
        comm: a `kdist.comm.Communicator` to run on instead of the world (not with
            `process_set`: passing both raises `ValueError`).
        device_dense: accepted for compatibility; no effect (kdist reduces on the host).
        ignore_name_scope: accepted for compatibility; no effect.

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
    """`kdist.reducescatter` of each value of a list, reduced in one fused collective per
    dtype.

    Each value is split into blocks of rows as `reducescatter` splits it, and gradients
    flow through it as through `reducescatter`. The arguments are `reducescatter`'s,
    with `tensors` a list; a scalar among them raises `ValueError`.

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
    """Returns `root_rank`'s picklable object on every rank.

    `root_rank` is read as `kdist.broadcast` reads it (a rank of the whole job with
    `process_set=`, of `comm` with `comm=`). `name` has no effect.
    """
    comm = resolve_comm(comm, process_set)
    return comm.bcast_object(obj, root=root_within(root_rank, comm, process_set))


def broadcast_object_fn(root_rank=0, session=None, name=None, process_set=None, comm=None):
    """Horovod's factory: a function of one object that returns `root_rank`'s object.

    The function calls `kdist.broadcast_object` with these arguments. `session`
    (TensorFlow 1) and `name` are accepted and ignored.
    """
    def broadcast_one(obj):
        return broadcast_object(obj, root_rank=root_rank, process_set=process_set, comm=comm)

    return broadcast_one


def allgather_object(obj, name=None, process_set=None, comm=None):
    """Returns the list of every rank's picklable object, in rank order.

    A rank that has joined (`kdist.join`) cannot take part: the job ends with a message
    saying so. `name` has no effect.

    Example:

        >>> import kdist
        >>> kdist.allgather_object({"rank": kdist.rank()})  # one process
        [{'rank': 0}]
    """
    return resolve_comm(comm, process_set).allgather_object(obj)


def barrier(process_set=None, comm=None):
    """Returns when every rank (of the world, the process set or `comm`) has called it."""
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

    Eagerly, before any bytes move, every rank compares the names, shapes and dtypes
    of its variables with the root's; a mismatch raises `ValueError` on every rank
    naming the first variable that differs, instead of corrupting weights or
    hanging. The variables then travel in one broadcast per dtype. Returns None.

    Inside a `tf.function` (Horovod's first-batch pattern: `if first_batch:
    hvd.broadcast_variables(model.variables, root_rank=0)` in the train step) it
    becomes one broadcast op per dtype and the assignments, and returns their group;
    it works under XLA. There the names are not compared (that would need a
    collective while tracing); a rank whose variables hold another number of values
    or another dtype still fails on every rank, as any mismatched collective does.

    ```python
    kdist.broadcast_variables(model.variables + model.optimizer.variables, root_rank=0)
    ```

    Args:
        variables: Keras variables or `tf.Variable`s, in the same order on every rank.
        root_rank: the rank whose values every rank takes, read as `kdist.broadcast`
            reads it.
        process_set: a registered `kdist.ProcessSet` to run on instead of the world.
        comm: a `kdist.comm.Communicator` to run on instead of the world.
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

    It is `kdist.broadcast_variables` (with its checks), then the variables' values.
    `name` has no effect.

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
