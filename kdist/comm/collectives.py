"""Collectives on numpy arrays and TensorFlow tensors, eager or inside `tf.function`.

Each function returns the kind of value it was given: numpy in, numpy out;
a tensor in, a tensor out. Inside a traced function the MPI call runs as a
py-function op, so the collectives can sit in a Keras train step.
"""

import numpy as np

from kdist.comm import processes
from kdist.comm.processes import REDUCE_OPS, Average, Sum


def _tf():
    import tensorflow as tf

    return tf


def _is_tensor(value):
    tf = _tf()
    return isinstance(value, (tf.Tensor, tf.Variable)) or tf.is_tensor(value)


def _resolve_op(average, op):
    if average is not None and op is not None:
        raise ValueError("Pass either `average` or `op` to allreduce, not both.")
    if op is None:
        op = Sum if average is False else Average
    if op not in REDUCE_OPS:
        raise ValueError(f"Unknown reduction op {op!r}; use one of {REDUCE_OPS}.")
    return op


def _numpy_allreduce(array, op, comm, prescale_factor, postscale_factor):
    out = np.array(array, copy=True, order="C")
    if out.dtype.kind not in "fiub":
        raise TypeError(f"allreduce supports numeric arrays; got dtype {out.dtype}.")
    if op == Average and out.dtype.kind != "f":
        raise TypeError(f"Averaging needs a floating array; got {out.dtype}. "
                        "Use op=kdist.Sum or convert to float first.")
    if prescale_factor != 1.0:
        out = out * prescale_factor
    comm.allreduce_(out, op=op)
    if postscale_factor != 1.0:
        out = out * postscale_factor
    return out


def _on_host(fn, tensor, out_dtype, name):
    """Runs a numpy function on a tensor, eagerly or as a graph op."""
    tf = _tf()
    tensor = tf.convert_to_tensor(tensor)
    if tf.executing_eagerly():
        return tf.convert_to_tensor(fn(tensor.numpy()), dtype=out_dtype)
    result = tf.numpy_function(fn, [tensor], out_dtype, stateful=True, name=name)
    return result


def allreduce(tensor, average=None, op=None, name=None, prescale_factor=1.0,
              postscale_factor=1.0, comm=None):
    """Reduces a value across all ranks: Average (default), Sum, Min, Max or Product.

    Example:

    >>> import numpy as np, kdist
    >>> kdist.allreduce(np.array([1.0, 2.0]))  # one process: unchanged
    array([1., 2.])
    """
    op = _resolve_op(average, op)
    comm = comm if comm is not None else processes.world()
    if not _is_tensor(tensor):
        return _numpy_allreduce(np.asarray(tensor), op, comm, prescale_factor, postscale_factor)
    tf = _tf()
    tensor = tf.convert_to_tensor(tensor)
    if op == Average and not tensor.dtype.is_floating:
        raise TypeError(f"Averaging needs a floating tensor; got {tensor.dtype.name}. "
                        "Use op=kdist.Sum or cast first.")
    result = _on_host(
        lambda a: _numpy_allreduce(a, op, comm, prescale_factor, postscale_factor).astype(a.dtype),
        tensor, tensor.dtype, name or "kdist_allreduce")
    result.set_shape(tensor.shape)
    return result


def broadcast(tensor, root_rank=0, name=None, comm=None):
    """Returns `root_rank`'s value of `tensor` on every rank."""
    comm = comm if comm is not None else processes.world()
    _check_root(root_rank, comm)

    def bcast(array):
        out = np.array(array, copy=True, order="C")
        return comm.bcast_(out, root=root_rank)

    if not _is_tensor(tensor):
        return bcast(np.asarray(tensor))
    tf = _tf()
    tensor = tf.convert_to_tensor(tensor)
    result = _on_host(bcast, tensor, tensor.dtype, name or "kdist_broadcast")
    result.set_shape(tensor.shape)
    return result


def allgather(tensor, name=None, comm=None):
    """Concatenates every rank's value along the first axis (sizes may differ)."""
    comm = comm if comm is not None else processes.world()
    if not _is_tensor(tensor):
        return comm.allgather_rows(np.asarray(tensor))
    tf = _tf()
    tensor = tf.convert_to_tensor(tensor)
    result = _on_host(comm.allgather_rows, tensor, tensor.dtype, name or "kdist_allgather")
    result.set_shape(tf.TensorShape([None]).concatenate(tensor.shape[1:]))
    return result


def broadcast_object(obj, root_rank=0, comm=None):
    """Returns `root_rank`'s picklable object on every rank."""
    comm = comm if comm is not None else processes.world()
    _check_root(root_rank, comm)
    return comm.bcast_object(obj, root=root_rank)


def allgather_object(obj, comm=None):
    """Returns the list of every rank's picklable object, in rank order."""
    comm = comm if comm is not None else processes.world()
    return comm.allgather_object(obj)


def barrier(comm=None):
    (comm if comm is not None else processes.world()).barrier()


def _check_root(root_rank, comm):
    if not 0 <= int(root_rank) < comm.size:
        raise ValueError(f"root_rank={root_rank} is not a rank of this job (size {comm.size}).")


def broadcast_variables(variables, root_rank=0, comm=None):
    """Sets every variable to its value on `root_rank`, checking that models match.

    Before any bytes move, every rank compares the names, shapes and dtypes of
    its variables with the root's; a mismatch raises `ValueError` on every rank
    naming the first variable that differs, instead of corrupting weights or
    hanging.
    """
    comm = comm if comm is not None else processes.world()
    _check_root(root_rank, comm)
    variables = list(variables)
    if comm.size == 1:
        return
    signature = [(_variable_name(v), tuple(v.shape), np.dtype(_numpy_dtype(v)).str)
                 for v in variables]
    signatures = comm.allgather_object(signature)
    _compare_signatures(signatures, root_rank)
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
        comm.bcast_(flat.view(np.uint8), root=root_rank)
        offset = 0
        for v in group:
            n = int(np.prod(v.shape))
            v.assign(flat[offset:offset + n].reshape(tuple(v.shape)))
            offset += n


def _variable_name(v):
    return getattr(v, "path", None) or getattr(v, "name", "?")


def _numpy_dtype(v):
    dtype = v.dtype
    return getattr(dtype, "as_numpy_dtype", dtype)


def _compare_signatures(signatures, root_rank):
    root = signatures[root_rank]
    for other_rank, theirs in enumerate(signatures):
        if len(theirs) != len(root):
            raise ValueError(
                f"Rank {other_rank} has {len(theirs)} variables to broadcast but root rank "
                f"{root_rank} has {len(root)}: every rank must build the same model.")
        for mine, root_var in zip(theirs, root):
            if mine[1:] != root_var[1:]:
                raise ValueError(
                    f"Variable '{root_var[0]}' has shape {root_var[1]} ({np.dtype(root_var[2])}) "
                    f"on root rank {root_rank} but '{mine[0]}' has shape {mine[1]} "
                    f"({np.dtype(mine[2])}) on rank {other_rank}: every rank must build the "
                    "same model.")
