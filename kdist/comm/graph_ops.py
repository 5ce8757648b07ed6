"""Collectives on TensorFlow tensors: eager, in graphs, and in XLA programs.

Each function picks the engine for where it runs:

- kdist's C++ ops (`kdist.comm.native`) in graphs and eagerly, when they
  could be built; inside a function compiled with XLA they become custom
  calls (their XLA lowering is built the first time this happens);
- otherwise a py-function around `Communicator`, which XLA cannot compile:
  there the error says what to do.

Both follow the same wire protocol, so ranks agree whichever they use.
"""

import contextlib
import os
import threading
import weakref

import numpy as np
import tensorflow as tf

from kdist import _tf_private
from kdist.comm import ending
from kdist.comm import job
from kdist.comm import protocol
from kdist.comm.communicator import protocol_op
from kdist.comm import native


# AutoGraph must not rewrite kdist's own code when a user's tf.function calls it.
_tf_private.leave_unconverted("kdist")


class TensorCollectiveMismatch(protocol.CollectiveMismatch, tf.errors.FailedPreconditionError):
    """Ranks ran different collectives on tensors: a `CollectiveMismatch` that is also
    TensorFlow's `FailedPreconditionError`, the error Horovod's ops (and kdist's C++ ops)
    raise, whichever engine ran the collective."""

    def __init__(self, message):
        tf.errors.FailedPreconditionError.__init__(self, None, None, message)


class TensorArgumentError(ValueError, tf.errors.InvalidArgumentError):
    """A collective's tensor argument is invalid: a `ValueError` that is also TensorFlow's
    `InvalidArgumentError`, as Horovod's ops raise."""

    def __init__(self, message):
        tf.errors.InvalidArgumentError.__init__(self, None, None, message)


def _python_collective(function, *args):
    """Runs a collective in Python on behalf of a tensor op, with TensorFlow's error class."""
    try:
        return function(*args)
    except TensorCollectiveMismatch:
        raise
    except protocol.CollectiveMismatch as error:
        raise TensorCollectiveMismatch(str(error)) from None


# The last kdist collective op added to each TensorFlow 1 graph, or the last
# ordered one of each function graph (see in_order).
_last_op = weakref.WeakKeyDictionary()
# Each outermost function graph's queued allreduces since its last ordered collective.
_queued = weakref.WeakKeyDictionary()

# Ops that run functions of their own (branches, loop bodies, nested tf.functions),
# which may hold ordered collectives.
_FUNCTION_OPS = frozenset(("If", "StatelessIf", "While", "StatelessWhile", "Case",
                           "StatelessCase", "PartitionedCall", "StatefulPartitionedCall"))


def _outermost(graph):
    """The function graph that `graph` (a function graph) is nested in, or itself."""
    while _tf_private.is_function_graph(getattr(graph, "outer_graph", None)):
        graph = graph.outer_graph
    return graph


@contextlib.contextmanager
def in_order():
    """Makes the collective op built inside run after the previous one of its graph.

    Every rank must run collectives in the same order. Inside `tf.function`
    TensorFlow runs stateful ops in program order already, but not the queued
    allreduces (`queued_allreduce`), which only the outermost function graph
    builds: an ordered collective, there or in a branch, loop or function nested
    in it, waits for those built before it (see queued_allreduce for those built
    after). A TensorFlow 1 graph (`tf.compat.v1`, a `Session`) orders nothing,
    and two collectives fetched in one `Session.run` could run in another order
    on each rank: there each collective is made to wait for the one built before
    it.
    """
    if tf.executing_eagerly():
        yield
        return
    graph = tf.compat.v1.get_default_graph()
    if tf.inside_function():
        # From a nested graph, TensorFlow turns these into control inputs of the
        # op that runs it.
        queued = _queued.pop(_outermost(graph), [])
        before = len(graph.get_operations())
        with tf.control_dependencies(queued):
            yield
        _remember_last_collective(graph, before)
        return
    previous = _last_op.get(graph)
    before = len(graph.get_operations())
    with tf.control_dependencies([previous] if previous is not None else []):
        yield
    _remember_last_collective(graph, before)


def _remember_last_collective(graph, before):
    built = graph.get_operations()[before:]
    collectives = [op for op in built if op.type.startswith(("Kdist", "PyFunc", "EagerPyFunc"))]
    if collectives:
        _last_op[graph] = collectives[-1]


_separate = threading.local()


@contextlib.contextmanager
def separate_call():
    """Marks the allreduce built inside as one a user's code calls on its own
    (`kdist.allreduce`), which the fusion queue may fuse with its neighbours.
    kdist's own callers (optimizers, the tape, metrics) fuse already."""
    previous = getattr(_separate, "on", False)
    _separate.on = True
    try:
        yield
    finally:
        _separate.on = previous


def fusion_enabled():
    """Whether separate allreduces in a `tf.function` go through the fusion queue
    (`KDIST_FUSION`, on unless set to 0)."""
    return os.environ.get("KDIST_FUSION", "1").lower() not in ("0", "false", "no", "off")


_QUEUED_OP = "KdistAllreduceAsync"


def _out_of_program_order():
    """Lets TensorFlow run the queued allreduce out of program order; False if it cannot.

    The op is stateful, so that TensorFlow never folds, merges or moves it, but
    TensorFlow runs stateful ops of a function one after another, which would
    leave the queue nothing to fuse. TensorFlow's own collectives are exempt
    through a list of op types (`ASYNC_STATEFUL_OPS`); kdist adds its one op
    type to it, a process-wide change that `KDIST_FUSION=0` leaves undone.
    """
    return _tf_private.run_out_of_program_order(_QUEUED_OP)


def _queueable(tensors, comm):
    """Whether these tensors' allreduce may go through the fusion queue.

    Only one tensor at a time, from a separate call (see separate_call), on the
    world communicator (one queue, so no two can wait for each other), and in
    the outermost graph of a `tf.function`: every rank runs the same graph, so
    node names match, and nothing there runs twice at once (a loop body's
    iterations may overlap, so one node could be waiting twice). Not under XLA,
    which runs a custom call in place.
    """
    if len(tensors) != 1 or not getattr(_separate, "on", False) or not fusion_enabled():
        return False
    if not tf.inside_function() or in_xla() or comm is not job.world():
        return False
    graph = tf.compat.v1.get_default_graph()
    return _outermost(graph) is graph and _out_of_program_order()


def queued_allreduce(ops, tensor, comm, mpi_op, average, prescale, postscale):
    """One tensor's allreduce through the C++ fusion queue (native/fusion.h).

    It waits for the graph's last ordered collective and for every op built
    before it that runs a function (a branch, a loop, a nested tf.function):
    those may hold ordered collectives, which must not run beside the queue.
    """
    graph = tf.compat.v1.get_default_graph()
    previous = _last_op.get(graph)
    before = [previous] if previous is not None else []
    before += [op for op in graph.get_operations() if op.type in _FUNCTION_OPS]
    with tf.control_dependencies(before):
        result = ops.kdist_allreduce_async(tensor, comm=comm.fortran_handle, reduce_op=mpi_op,
                                           average=bool(average), prescale=float(prescale),
                                           postscale=float(postscale))
    _queued.setdefault(graph, []).append(result.op)
    return result


def in_xla():
    """True while tracing a function that XLA will compile (`jit_compile=True`)."""
    if tf.executing_eagerly():
        return False
    return _tf_private.graph_in_xla_context(tf.compat.v1.get_default_graph())


def _native_ops(comm):
    if comm.mpi is None:
        return None
    if in_xla():
        native.load_xla()
        return native.load()
    return native.load()


def single_rank(comm):
    """Whether a collective on `comm` may be left out of what is built here: it has one
    rank now and whenever that runs. Not in a graph of a fault-tolerant job, whose world
    may grow again after the graph was traced (replacements join): there the ops stay,
    and look their communicator up each time they run."""
    if comm.size != 1:
        return False
    return comm.mpi is None or tf.executing_eagerly() or not ending.fault_tolerant()


def size_when_run(comm, dtype):
    """`comm`'s number of ranks as a `dtype` tensor, as it is when what is built here
    runs: in a graph of a fault-tolerant job the world may shrink or grow after it was
    traced (the world's size then comes from `kdist.size_op`)."""
    if comm is job.world() and not tf.executing_eagerly() and ending.fault_tolerant():
        from kdist.comm import process_ops

        return tf.cast(process_ops.size_op(), dtype)
    return tf.cast(comm.size, dtype)


def _dtype_code(dtype):
    return protocol.dtype_code(np.dtype(tf.as_dtype(dtype).as_numpy_dtype))


def allreduce(tensors, comm, op="sum", average=False, prescale=1.0, postscale=1.0, label=""):
    """Reduces a list of tensors of one dtype across `comm` in one fused collective.

    Returns tensors shaped like the inputs: `reduce(t * prescale) * postscale`,
    divided by the number of ranks that contributed with `average`.
    """
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if not tensors:
        return []
    dtype = tensors[0].dtype
    if any(t.dtype != dtype for t in tensors):
        raise TypeError("A fused allreduce needs tensors of one dtype; got "
                        f"{sorted({t.dtype.name for t in tensors})}.")
    _dtype_code(dtype)
    if average and not dtype.is_floating:
        raise TypeError(f"A fused average needs floating tensors; got {dtype.name}. Use "
                        "kdist.allreduce, which averages integers, or op=kdist.Sum.")
    if (prescale != 1.0 or postscale != 1.0) and not dtype.is_floating:
        # As Horovod scales integers: in float64, truncated back to the integer type.
        if prescale != 1.0:
            tensors = [scale_integers(t, prescale) for t in tensors]
        summed = allreduce(tensors, comm, op=op, label=label)
        return [scale_integers(t, postscale) if postscale != 1.0 else t for t in summed]
    if single_rank(comm):
        factor = prescale * postscale
        return [t if factor == 1.0 else t * tf.cast(factor, dtype) for t in tensors]
    mpi_op = protocol_op(op)
    ops = _native_ops(comm)
    if ops is not None and _queueable(tensors, comm):
        return [queued_allreduce(ops, tensors[0], comm, mpi_op, average, prescale, postscale)]
    if ops is not None:
        with in_order():
            return ops.kdist_allreduce(tensors, comm=comm.fortran_handle, reduce_op=mpi_op,
                                       average=bool(average), prescale=float(prescale),
                                       postscale=float(postscale), label=label)

    def reduce(*arrays):
        return comm.allreduce_many(arrays, op=op, average=average, prescale=prescale,
                                   postscale=postscale, label=label)

    if tf.executing_eagerly():
        results = _python_collective(reduce, *[t.numpy() for t in tensors])
        return [tf.convert_to_tensor(r, dtype=dtype) for r in results]
    with in_order():
        results = tf.numpy_function(reduce, tensors, [dtype] * len(tensors), stateful=True,
                                    name="kdist_allreduce")
    for result, t in zip(results, tensors):
        result.set_shape(t.shape)
    return list(results)


def scale_integers(tensor, factor):
    """`tensor * factor` for an integer tensor: computed in float64, truncated toward zero."""
    return tf.cast(tf.cast(tensor, tf.float64) * factor, tensor.dtype)


def allgather(tensor, comm, label=""):
    """Concatenates every rank's `tensor` along the first axis (sizes may differ).

    Under XLA the result's shape is fixed when the program is compiled, so
    every rank must then give the same number of rows.
    """
    tensor = tf.convert_to_tensor(tensor)
    if tensor.shape.rank == 0:
        raise ValueError("allgather needs a tensor of at least one dimension; got a scalar.")
    _dtype_code(tensor.dtype)
    if single_rank(comm):
        return tf.identity(tensor)
    ops = _native_ops(comm)
    if ops is not None:
        with in_order():
            return ops.kdist_allgather(tensor, comm=comm.fortran_handle, size=comm.size,
                                       label=label)
    if tf.executing_eagerly():
        return tf.convert_to_tensor(_python_collective(
            lambda a: comm.allgather_rows(a, label=label), tensor.numpy()))
    with in_order():
        result = tf.numpy_function(lambda a: comm.allgather_rows(a, label=label), [tensor],
                                   tensor.dtype, stateful=True, name="kdist_allgather")
    result.set_shape(tf.TensorShape([None]).concatenate(tensor.shape[1:]))
    return result


def broadcast(tensor, comm, root=0, label=""):
    """Returns rank `root`'s value of `tensor` on every rank of `comm`."""
    tensor = tf.convert_to_tensor(tensor)
    _dtype_code(tensor.dtype)
    comm._check_root(root)
    if single_rank(comm):
        return tf.identity(tensor)
    ops = _native_ops(comm)
    if ops is not None:
        with in_order():
            return ops.kdist_broadcast(tensor, comm=comm.fortran_handle, root=int(root),
                                       label=label)

    def bcast(array):
        out = np.array(array, copy=True, order="C")
        return comm.bcast_(out, root=int(root), label=label)

    if tf.executing_eagerly():
        return tf.convert_to_tensor(_python_collective(bcast, tensor.numpy()))
    with in_order():
        result = tf.numpy_function(bcast, [tensor], tensor.dtype, stateful=True,
                                   name="kdist_broadcast")
    result.set_shape(tensor.shape)
    return result


def alltoall(tensor, splits, comm, label=""):
    """Sends `splits[i]` rows of `tensor` to rank i; returns (received rows, row counts)."""
    tensor = tf.convert_to_tensor(tensor)
    if in_xla():
        raise ValueError("alltoall's result has a shape known only when it runs, so it cannot "
                         "be compiled with XLA; call it outside the jit-compiled function or "
                         "compile with jit_compile=False.")
    _dtype_code(tensor.dtype)

    def exchange(array, counts):
        received, received_counts = comm.alltoallv(array, counts, label=label)
        return received, received_counts.astype(np.int64)

    splits = tf.cast(tf.convert_to_tensor(splits), tf.int64)
    if tf.executing_eagerly():
        received, counts = _python_collective(exchange, tensor.numpy(), splits.numpy())
        return tf.convert_to_tensor(received), tf.convert_to_tensor(counts)
    with in_order():
        received, counts = tf.numpy_function(exchange, [tensor, splits],
                                             [tensor.dtype, tf.int64], stateful=True,
                                             name="kdist_alltoall")
    received.set_shape(tf.TensorShape([None]).concatenate(tensor.shape[1:]))
    counts.set_shape([comm.size])
    return received, counts
