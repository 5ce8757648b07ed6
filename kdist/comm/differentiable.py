"""Collectives on tensors that gradients flow through, with Horovod's gradients.

- allreduce (Sum, Average): the gradient is the same allreduce of the
  gradient; Min, Max and Product have none;
- allgather: the gradient, averaged over ranks, sliced back to this rank's rows;
- broadcast: the gradient averaged over ranks on the root, zero elsewhere;
- alltoall: the gradient sent back where its rows came from;
- reducescatter: the gradient gathered from every rank's block.

And the four that tensor parallelism (`kdist.tensor_parallel`) builds on, where
every rank of a group computes the same loss from the same data and each holds
a slice of some layer's weights, so an upstream gradient of a replicated tensor
is the same on every rank and is never averaged:

- copy_to_group: identity; the gradient summed over the group;
- reduce_from_group: a sum over the group; the gradient passed through;
- gather_from_group: the group's slices joined along an axis; the gradient
  sliced back to this rank's part;
- scatter_to_group: this rank's slice along an axis; the gradient gathered.
"""

import numpy as np
import tensorflow as tf

from kdist.comm import graph_ops
from kdist.comm.communicator import Average, Sum
from kdist.comm.fusion import block


def _reduce(tensors, op, comm, prescale, postscale, compression, label, key=None):
    if op in (Average, Sum):
        floating = all(t.dtype.is_floating for t in tensors)
        if floating:
            return compression.reduce(tensors, comm, op == Average, prescale, postscale,
                                      label, key)
        if op == Average:
            # Floating tensors are averaged by the reduction; integers are summed
            # and then divided, as Horovod averages them.
            results = [None] * len(tensors)
            floats = [i for i, t in enumerate(tensors) if t.dtype.is_floating]
            integers = [i for i, t in enumerate(tensors) if not t.dtype.is_floating]
            if floats:
                averaged = compression.reduce([tensors[i] for i in floats], comm, True,
                                              prescale, postscale, label, key)
                for i, r in zip(floats, averaged):
                    results[i] = r
            summed = _reduce([tensors[i] for i in integers], Sum, comm, prescale, postscale,
                             compression, label)
            for i, r in zip(integers, summed):
                results[i] = average_integers(tensors[i], r, comm)
            return results
    results = [None] * len(tensors)
    groups = {}
    for index, t in enumerate(tensors):
        groups.setdefault(t.dtype, []).append(index)
    for indices in groups.values():
        reduced = graph_ops.allreduce([tensors[i] for i in indices], comm, op=op,
                                      prescale=prescale, postscale=postscale, label=label)
        for i, r in zip(indices, reduced):
            results[i] = r
    return results


def average_integers(tensor, summed, comm):
    """`summed / size` for an integer `tensor`, truncated toward zero, as Horovod averages."""
    if tensor.dtype.is_floating:
        return summed
    return graph_ops.scale_integers(summed, 1.0 / comm.size)


def _gradient_op(op):
    if op not in (Average, Sum):
        raise ValueError(f"kdist defines the gradient of allreduce for Sum and Average only; "
                         f"this allreduce uses {op}.")
    return op


def allreduce(tensor, op, comm, prescale, postscale, compression, label):
    if not tensor.dtype.is_floating:
        return _reduce([tensor], op, comm, prescale, postscale, compression, label)[0]

    @tf.custom_gradient
    def reduced(x):
        def gradient(upstream):
            return _reduce([upstream], _gradient_op(op), comm, prescale, postscale,
                           compression, f"gradient of {label}")[0]

        return _reduce([x], op, comm, prescale, postscale, compression, label)[0], gradient

    return reduced(tensor)


def grouped_allreduce(tensors, op, comm, prescale, postscale, compression, label):
    if not all(t.dtype.is_floating for t in tensors):
        return _reduce(tensors, op, comm, prescale, postscale, compression, label)

    @tf.custom_gradient
    def reduced(*xs):
        def gradient(*upstream):
            upstream = [tf.zeros_like(x) if u is None else u for u, x in zip(upstream, xs)]
            return _reduce(upstream, _gradient_op(op), comm, prescale, postscale, compression,
                           f"gradient of {label}")

        return _reduce(list(xs), op, comm, prescale, postscale, compression, label), gradient

    return reduced(*tensors)


def allgather(tensor, comm, label):
    if not tensor.dtype.is_floating:
        return graph_ops.allgather(tensor, comm, label=label)

    @tf.custom_gradient
    def gathered(x):
        def gradient(upstream):
            averaged = graph_ops.allreduce([upstream], comm, average=True,
                                           label=f"gradient of {label}")[0]
            rows = tf.reshape(tf.shape(x, out_type=tf.int64)[0], [1])
            counts = graph_ops.allgather(rows, comm, label=f"gradient of {label}, rows")
            start = tf.reduce_sum(counts[:comm.rank])
            return averaged[start:start + rows[0]]

        return graph_ops.allgather(x, comm, label=label), gradient

    return gathered(tensor)


def broadcast(tensor, root, comm, label):
    if not tensor.dtype.is_floating:
        return graph_ops.broadcast(tensor, comm, root, label=label)

    @tf.custom_gradient
    def broadcast_value(x):
        def gradient(upstream):
            averaged = graph_ops.allreduce([upstream], comm, average=True,
                                           label=f"gradient of {label}")[0]
            if comm.rank == root:
                return averaged
            # Zeros that still wait for the allreduce: a graph would otherwise skip it
            # here alone, and this rank's collectives would fall out of step.
            with tf.control_dependencies([averaged]):
                return tf.zeros_like(upstream)

        return graph_ops.broadcast(x, comm, root, label=label), gradient

    return broadcast_value(tensor)


def alltoall(tensor, splits, comm, label):
    received_counts = []

    @tf.custom_gradient
    def exchanged(x):
        received, counts = graph_ops.alltoall(x, splits, comm, label=label)
        received_counts.append(counts)

        def gradient(upstream):
            return graph_ops.alltoall(upstream, counts, comm, label=f"gradient of {label}")[0]

        return received, gradient

    if not tensor.dtype.is_floating:
        return graph_ops.alltoall(tensor, splits, comm, label=label)
    received = exchanged(tensor)
    return received, received_counts[0]


def _own_block(x, comm):
    """This rank's rows of a reduce-scatter of `x` (the first ranks get one more)."""
    if x.shape[0] is not None:
        start, stop = block(x.shape[0], comm.rank, comm.size)
        return x[start:stop]
    rows = tf.shape(x)[0]
    base, extra = rows // comm.size, rows % comm.size
    start = comm.rank * base + tf.minimum(comm.rank, extra)
    stop = start + base + tf.cast(tf.less(comm.rank, extra), rows.dtype)
    return x[start:stop]


def reducescatter(tensor, op, comm, prescale, postscale, compression, label):
    def scatter(x):
        return _own_block(_reduce([x], op, comm, prescale, postscale, compression, label)[0],
                          comm)

    if not tensor.dtype.is_floating:
        return scatter(tensor)

    @tf.custom_gradient
    def scattered(x):
        def gradient(upstream):
            factor = prescale * postscale * (comm.size if op == Sum else 1)
            scaled = upstream * tf.cast(factor, upstream.dtype) if factor != 1 else upstream
            return graph_ops.allgather(scaled, comm, label=f"gradient of {label}")

        return scatter(x), gradient

    return scattered(tensor)


def grouped_reducescatter(tensors, op, comm, prescale, postscale, compression, label):
    """`reducescatter` of each tensor, reduced in one fused collective per dtype."""
    def scatter(*xs):
        return [_own_block(r, comm) for r in
                _reduce(list(xs), op, comm, prescale, postscale, compression, label)]

    if not all(t.dtype.is_floating for t in tensors):
        return scatter(*tensors)

    @tf.custom_gradient
    def scattered(*xs):
        def gradient(*upstream):
            factor = prescale * postscale * (comm.size if op == Sum else 1)
            return [graph_ops.allgather(u * tf.cast(factor, u.dtype) if factor != 1 else u,
                                        comm, label=f"gradient of {label}")
                    for u in upstream]

        return scatter(*xs), gradient

    return scattered(*tensors)


def copy_to_group(tensor, comm, label="tensor-parallel input"):
    """`tensor` unchanged; its gradient is the sum of the gradients over `comm`.

    For an input replicated on every rank of a group whose ranks each use it
    for their own slice of a layer: each rank's gradient covers its slice only.
    """
    tensor = tf.convert_to_tensor(tensor)
    if comm.size == 1:
        return tensor

    @tf.custom_gradient
    def copied(x):
        def gradient(upstream):
            return graph_ops.allreduce([upstream], comm, op="sum",
                                       label=f"gradient of {label}")[0]

        return tf.identity(x), gradient

    return copied(tensor)


def reduce_from_group(tensor, comm, label="tensor-parallel partial sum"):
    """The sum of `tensor` over `comm`; the gradient passes through unchanged.

    The upstream gradient of the sum is the same on every rank, and it is the
    gradient of each rank's term.
    """
    tensor = tf.convert_to_tensor(tensor)
    if comm.size == 1:
        return tensor

    @tf.custom_gradient
    def reduced(x):
        def gradient(upstream):
            return tf.identity(upstream)

        return graph_ops.allreduce([x], comm, op="sum", label=label)[0], gradient

    return reduced(tensor)


def _axis(tensor, axis):
    rank = tensor.shape.rank
    if rank is None or rank == 0:
        raise ValueError(f"Gathering or slicing along an axis needs a tensor of known rank of "
                         f"at least 1; got shape {tensor.shape}.")
    if not -rank <= axis < rank:
        raise ValueError(f"axis {axis} is outside a tensor of rank {rank}.")
    return axis % rank


def _gather(tensor, comm, axis, label):
    # graph_ops.allgather joins along the first axis, so `axis` travels there and back.
    perm = [axis] + [i for i in range(tensor.shape.rank) if i != axis]
    front = tensor if axis == 0 else tf.transpose(tensor, perm)
    gathered = graph_ops.allgather(front, comm, label=label)
    if front.shape[0] is not None:
        gathered.set_shape(tf.TensorShape([comm.size * front.shape[0]])
                           .concatenate(front.shape[1:]))
    return gathered if axis == 0 else tf.transpose(gathered, np.argsort(perm))


def _own_slice(tensor, comm, axis):
    width = tensor.shape[axis]
    if width is not None and width % comm.size:
        raise ValueError(f"Cannot cut axis {axis} of width {width} into {comm.size} equal "
                         f"slices, one per rank of the group.")
    return tf.split(tensor, comm.size, axis=axis)[comm.rank]


def gather_from_group(tensor, comm, axis=-1, label="tensor-parallel gather"):
    """Every rank's `tensor` joined along `axis`, in rank order (all slices the same shape).

    The gradient is this rank's slice of the upstream gradient, which is the
    same on every rank.
    """
    tensor = tf.convert_to_tensor(tensor)
    axis = _axis(tensor, axis)
    if comm.size == 1:
        return tensor

    @tf.custom_gradient
    def gathered(x):
        def gradient(upstream):
            return _own_slice(upstream, comm, axis)

        return _gather(x, comm, axis, label), gradient

    return gathered(tensor)


def scatter_to_group(tensor, comm, axis=-1, label="tensor-parallel scatter"):
    """This rank's slice of `tensor` along `axis`, cut into equal slices in rank order.

    `tensor` is the same on every rank; its gradient gathers every rank's
    slice of the gradient back.
    """
    tensor = tf.convert_to_tensor(tensor)
    axis = _axis(tensor, axis)
    if comm.size == 1:
        return tensor

    @tf.custom_gradient
    def scattered(x):
        def gradient(upstream):
            return _gather(upstream, comm, axis, f"gradient of {label}")

        return _own_slice(x, comm, axis), gradient

    return scattered(tensor)
