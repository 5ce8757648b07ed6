"""Horovod's TF2 core API on 2 ranks: the tape, grouped collectives, accessors, errors."""

import numpy as np
import tensorflow as tf

import kdist as hvd
from common import report

hvd.init()
rank, size = hvd.rank(), hvd.size()
out = {}

# DistributedGradientTape: rank r's loss is (r + 1) * w, so the average gradient is 1.5.
w = tf.Variable([1.0, 2.0])


def tape_gradient(op=hvd.Average, persistent=False):
    with tf.GradientTape(persistent=persistent) as tape:
        loss = (rank + 1.0) * tf.reduce_sum(w)
    tape = hvd.DistributedGradientTape(tape, op=op)
    grads = tape.gradient(loss, {"w": w})
    return grads["w"]


out["tape_eager"] = tape_gradient().numpy().tolist()
out["tape_sum"] = tape_gradient(op=hvd.Sum).numpy().tolist()
out["tape_function"] = tf.function(tape_gradient)().numpy().tolist()
out["tape_xla"] = tf.function(tape_gradient, jit_compile=True)().numpy().tolist()

# PartialDistributedGradientTape: the local layer keeps its own gradient, divided by size.
shared, local = tf.keras.layers.Dense(1, use_bias=False), tf.keras.layers.Dense(1, use_bias=False)
x = tf.ones((1, 1))
shared.build((None, 1)), local.build((None, 1))
shared.kernel.assign([[1.0]]), local.kernel.assign([[1.0]])
with tf.GradientTape() as tape:
    loss = (rank + 1.0) * (shared(x) + local(x))
tape = hvd.PartialDistributedGradientTape(tape, local_layers=[local])
local_grads, global_grads = tape.get_local_and_global_gradients(
    loss, [shared.kernel, local.kernel])
out["partial"] = [float(global_grads[0][1].numpy().ravel()[0]),
                  float(local_grads[0][1].numpy().ravel()[0])]

# Grouped collectives, eagerly and in a function.
rows = [tf.fill((rank + 1, 2), float(rank)), tf.fill((2, 3), rank + 1)]
out["grouped_allgather"] = [t.shape.as_list() for t in hvd.grouped_allgather(rows)]
scatter_inputs = [tf.reshape(tf.range(8.0), (4, 2)) * (rank + 1), tf.range(6, dtype=tf.int32) * (rank + 1)]
out["grouped_reducescatter"] = [t.numpy().tolist() for t in tf.function(
    lambda: hvd.grouped_reducescatter(scatter_inputs, op=hvd.Sum))()]
out["reducescatter_int_average"] = hvd.reducescatter(
    tf.constant([3, -3, 5, 7], tf.int32) * (rank + 1)).numpy().tolist()
out["allreduce_int_average"] = hvd.allreduce(tf.constant([3, -3], tf.int64) * (rank + 1)).numpy().tolist()
out["numpy_int_average"] = hvd.allreduce(np.array([3, -3]) * (rank + 1)).tolist()

# Grouped allreduce with sparse and dense values.
slices = tf.IndexedSlices(tf.fill((1, 2), float(rank + 1)), tf.constant([rank]), tf.constant([2, 2]))
sparse, dense = hvd.grouped_allreduce([slices, tf.fill((2,), float(rank))])
out["grouped_sparse"] = [type(sparse).__name__, tf.convert_to_tensor(sparse).numpy().tolist(),
                         dense.numpy().tolist()]

# In-place broadcast and the accessors, inside a function.
v = tf.Variable([float(rank), 10.0 * rank])


@tf.function
def in_function():
    values = hvd.broadcast_([v], root_rank=1)
    return values[0], hvd.rank_op(), hvd.size_op(), hvd.local_rank_op(), hvd.local_size_op()


value, r_op, s_op, lr_op, ls_op = in_function()
out["broadcast_"] = [value.numpy().tolist(), v.numpy().tolist()]
out["ops"] = [int(r_op), int(s_op), int(lr_op), int(ls_op)]
odd = hvd.add_process_set([1])
out["included"] = [int(hvd.process_set_included_op(0)),
                   int(hvd.process_set_included_op(odd.process_set_id)),
                   int(hvd.process_set_included_op(99))]

# Ranks that run different collectives: FailedPreconditionError on both, and the job goes on.
errors = []
for case in ("shape", "dtype"):
    tensor = (tf.ones([17 + rank] * 2) if case == "shape"
              else tf.ones([4], tf.int32 if rank == 0 else tf.float32))
    try:
        hvd.reducescatter(tensor)
        errors.append("no error")
    except tf.errors.FailedPreconditionError as error:
        errors.append("FailedPreconditionError" if "rank 1" in str(error) else str(error))
out["mismatch"] = errors
out["after_mismatch"] = hvd.allreduce(tf.constant([1.0]), op=hvd.Sum).numpy().tolist()

# Horovod's error classes for arguments it refuses.
kinds = []
for call in (lambda: hvd.allreduce(slices, op=hvd.Max),
             lambda: hvd.allreduce(slices, op=hvd.Adasum),
             lambda: hvd.grouped_allreduce([slices], op=hvd.Sum, prescale_factor=2.0),
             lambda: hvd.alltoall(tf.ones([3])),
             lambda: hvd.alltoall(tf.ones([size], tf.int32 if rank == 0 else tf.float32))):
    try:
        call()
        kinds.append("no error")
    except NotImplementedError:
        kinds.append("NotImplementedError")
    except tf.errors.InvalidArgumentError:
        kinds.append("InvalidArgumentError")
    except tf.errors.FailedPreconditionError:
        kinds.append("FailedPreconditionError")
out["error_kinds"] = kinds
# Integers scale in float64 and are truncated back, as in Horovod.
out["int_scaled"] = [hvd.allreduce(tf.constant([10, -10]), op=hvd.Sum, prescale_factor=0.25)
                     .numpy().tolist(),
                     hvd.reducescatter(tf.constant([10, 7]), op=hvd.Sum, postscale_factor=0.5)
                     .numpy().tolist()]
compressed, context = hvd.Compression.fp16.compress(tf.ones(2, tf.float64))
out["fp16"] = [compressed.dtype.name,
               hvd.Compression.fp16.decompress(compressed, context).dtype.name]

# Elastic state of a custom loop: synced from rank 0, restored to the last commit.
variable = tf.Variable([float(rank + 1)] * 2)
state = hvd.elastic.TensorFlowState([variable], batch=20 + rank)
state.sync()
synced = [variable.numpy().tolist(), state.batch]
variable.assign([5.0, 5.0])
state.batch = 21
state.restore()
out["elastic_state"] = synced + [variable.numpy().tolist(), state.batch]

try:
    hvd.BroadcastGlobalVariablesHook
except AttributeError as error:
    out["missing_name"] = str(error)
report(out)
