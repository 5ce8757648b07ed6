"""Exercises every collective on numpy arrays and tensors, eager and in tf.function."""

import numpy as np
import tensorflow as tf

import kdist
from common import report

kdist.init()
kdist.init()  # idempotent
r, n = kdist.rank(), kdist.size()
out = {"rank": r, "size": n, "local_rank": kdist.local_rank(), "local_size": kdist.local_size(),
       "cross_rank": kdist.cross_rank(), "cross_size": kdist.cross_size()}

value = np.array([r + 1.0, 10.0 * (r + 1)])
for name, op in [("average", kdist.Average), ("sum", kdist.Sum), ("min", kdist.Min),
                 ("max", kdist.Max), ("product", kdist.Product)]:
    out[f"np_{name}"] = kdist.allreduce(value, op=op).tolist()
out["np_sum_via_average_false"] = kdist.allreduce(value, average=False).tolist()
out["int_sum"] = kdist.allreduce(np.array([r, 1], dtype=np.int64), op=kdist.Sum).tolist()
out["tf_eager_average"] = kdist.allreduce(tf.constant(value, tf.float32)).numpy().tolist()


@tf.function
def graph_collectives(t):
    return (kdist.allreduce(t, op=kdist.Sum), kdist.broadcast(t, root_rank=n - 1),
            kdist.allgather(t[: r + 1]))


summed, broadcast, gathered = graph_collectives(tf.constant(value, tf.float32))
out["tf_graph_sum"] = summed.numpy().tolist()
out["tf_graph_broadcast"] = broadcast.numpy().tolist()
out["tf_graph_allgather"] = gathered.numpy().tolist()
out["np_broadcast"] = kdist.broadcast(np.full(3, float(r)), root_rank=1).tolist()
out["np_allgather_uneven"] = kdist.allgather(np.full((r + 1, 2), r, dtype=np.int32)).tolist()
out["object_allgather"] = kdist.allgather_object({"rank": r})
out["object_broadcast"] = kdist.broadcast_object(f"from {r}", root_rank=0)

# A sub-communicator: even and odd ranks.
sub = kdist.comm.world().split(color=r % 2)
out["sub_size"] = sub.size
out["sub_sum"] = kdist.allreduce(np.array([float(r)]), op=kdist.Sum, comm=sub).tolist()

# Variables: different values become the root's.
var = tf.Variable(np.full((2, 3), float(r), dtype=np.float32))
kdist.broadcast_variables([var], root_rank=0)
out["variable_after_broadcast"] = var.numpy().tolist()

try:
    kdist.allgather(np.zeros((1, r + 1)))
except ValueError as error:
    out["allgather_error"] = str(error)
try:
    kdist.allreduce(tf.ones([3 + r]))
except Exception as error:  # noqa: BLE001  (raised from inside a TensorFlow op)
    out["allreduce_error"] = str(error)

# Tensors large enough to travel alone (the C++ op's direct path, where
# averaging and pre/post-scaling ride on the reduction itself).
large = np.linspace(-1.0, 1.0, 100_000) * (r + 1)


@tf.function
def large_collectives(t):
    return (kdist.allreduce(t), kdist.allreduce(t, op=kdist.Max),
            kdist.allreduce(t, op=kdist.Average, prescale_factor=0.5, postscale_factor=3.0),
            kdist.allreduce(tf.cast(t, tf.float16)), kdist.allreduce(tf.cast(t, tf.float64)))


large_results = large_collectives(tf.constant(large, tf.float32))
base = np.linspace(-1.0, 1.0, 100_000)
mean_scale = np.mean([k + 1.0 for k in range(n)])
expected = [base * mean_scale, np.where(base < 0, base, base * n), 1.5 * base * mean_scale,
            base * mean_scale, base * mean_scale]
out["large_errors"] = [float(np.max(np.abs(x.numpy().astype(np.float64) - e)))
                       for x, e in zip(large_results, expected)]

# Horovod's other collectives.
out["prescaled"] = kdist.allreduce(value, op=kdist.Sum, prescale_factor=2.0,
                                   postscale_factor=0.5).tolist()
out["grouped"] = [t.numpy().tolist() for t in kdist.grouped_allreduce(
    [tf.constant([float(r)]), tf.constant([[1.0, 2.0]]), tf.constant([r], tf.int32)],
    op=kdist.Sum)]
out["reducescatter"] = kdist.reducescatter(
    tf.constant(np.arange(2 * n + 1, dtype=np.float32) * (r + 1)), op=kdist.Sum).numpy().tolist()
# r + n rows: r + 1 to rank 0, one to every other rank.
received, counts = kdist.alltoall(np.full((r + n, 1), r, dtype=np.int64),
                                  splits=[r + 1] + [1] * (n - 1))
out["alltoall"], out["alltoall_counts"] = received.ravel().tolist(), counts.tolist()

x = tf.Variable([1.0 + r, 2.0])
with tf.GradientTape(persistent=True) as tape:
    total = tf.reduce_sum(kdist.allreduce(x * x, op=kdist.Sum))
    gathered_sum = tf.reduce_sum(kdist.allgather(x) * float(r + 1))
    from_root = tf.reduce_sum(kdist.broadcast(x, root_rank=0) * 3.0)
out["grad_allreduce"] = tape.gradient(total, x).numpy().tolist()
out["grad_allgather"] = tape.gradient(gathered_sum, x).numpy().tolist()
out["grad_broadcast"] = tape.gradient(from_root, x).numpy().tolist()

evens = kdist.add_process_set([k for k in range(n) if k % 2 == 0])
out["process_set"] = [evens.size(), evens.rank(), evens.included()]
if evens.included():
    out["process_set_sum"] = kdist.allreduce(np.array([float(r)]), op=kdist.Sum,
                                             process_set=evens).tolist()
else:
    try:
        kdist.allreduce(np.ones(1), process_set=evens)
    except ValueError as error:
        out["process_set_error"] = str(error)
    try:
        kdist.allreduce(tf.ones(1), process_set=evens)
    except tf.errors.InvalidArgumentError as error:  # Horovod's error class
        out["process_set_error_class"] = "InvalidArgumentError"
# Horovod's root_rank is a rank of the whole job, also with a process set.
last_even = evens.ranks[-1]
if evens.included():
    out["process_set_broadcast"] = kdist.broadcast(
        tf.constant([float(r)]), root_rank=last_even, process_set=evens).numpy().tolist()
# A rank outside the set keeps its own gradient (Horovod's tape does the same).
point = tf.constant(float(r))
with tf.GradientTape() as tape:
    tape.watch(point)
    square = point * point
out["process_set_tape"] = float(kdist.DistributedGradientTape(
    tape, process_set=evens).gradient(square, [point])[0])
out["removed"] = kdist.remove_process_set(evens)
# Small integers wrap around when summed, as in C and Horovod; 64 of them take MPI's
# vectorised path, which saturated them.
for dtype, value in (("uint8", 229), ("int8", 100), ("int16", 30000), ("uint16", 60000)):
    wide = np.full(64, value, dtype=dtype)
    out[f"wrapped_{dtype}"] = [
        int(kdist.allreduce(wide, op=kdist.Sum)[0]),
        int(tf.function(lambda: kdist.allreduce(tf.constant(wide), op=kdist.Sum))()[0])]
out["homogeneous"] = kdist.is_homogeneous()
from mpi4py import MPI  # noqa: E402

# kdist's world is its own copy: a script's messages on COMM_WORLD never meet kdist's.
out["world_is_a_copy"] = MPI.Comm.Compare(kdist.comm.world().mpi, MPI.COMM_WORLD) == \
    MPI.CONGRUENT
if r == 0:
    MPI.COMM_WORLD.isend("the script's own message", dest=n - 1, tag=7)
if r == n - 1:
    ours = MPI.COMM_WORLD.irecv(source=0, tag=7)
kdist.allreduce(np.ones(2))  # kdist's traffic in between
if r == n - 1:
    out["own_message"] = ours.wait()
# In a graph, the gradient of a broadcast is zero off the root but must still run its
# allreduce there, or the ranks' next collectives fall out of step.
with tf.Graph().as_default(), tf.compat.v1.Session() as session:
    graph_grads = []
    for root in (0, n - 1):
        start = tf.ones([3]) * float(r)
        sent = kdist.broadcast(start, root_rank=root)
        graph_grads.append(session.run(
            [sent, tf.gradients(sent, start, tf.ones([3]))[0]])[1].tolist())
out["graph_broadcast_grads"] = graph_grads
# A tensor large enough to travel alone, averaged after the last rank has joined: no
# packed message carries the count of the ranks that train, the announcement does.
large_average = tf.function(lambda value: kdist.allreduce(tf.fill([70000], value)))
out["large_average"] = [float(large_average(tf.constant(float(r + 1)))[0])]
if r < n - 1:
    out["large_average"].append(float(large_average(tf.constant(float(r + 1)))[0]))
    out["large_sum"] = float(tf.function(lambda value: kdist.allreduce(
        tf.fill([70000], value), op=kdist.Sum))(tf.constant(float(r + 1)))[-1])
out["last_joined"] = kdist.join()
report(out)
