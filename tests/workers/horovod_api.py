"""Horovod's optimizer, callback and batch-norm behaviours on several ranks, in one job.

Rank r's gradients are built to differ by rank, so that each check can tell
a sum from an average, and a gradient reduced once from one reduced twice.
"""

import keras
import numpy as np
import tensorflow as tf

import kdist
from common import report

kdist.init()
r, n = kdist.rank(), kdist.size()
out = {}


def scalar_variable(value=0.0):
    return tf.Variable(value, dtype=tf.float32)


def rank_loss(x):
    """A loss whose gradient with respect to `x` is r + 1 on rank r."""
    return lambda: (r + 1.0) * x


# -- gradients are reduced exactly once, whichever protocol delivers them ----------------------
once = {}
x = scalar_variable()
opt = kdist.DistributedOptimizer(keras.optimizers.SGD(1.0), op=kdist.Sum)
with tf.GradientTape() as tape:
    loss = rank_loss(x)()
opt.apply([tape.gradient(loss, x)], [x])
once["apply_eager"] = float(x.numpy())

x = scalar_variable()
opt = kdist.DistributedOptimizer(keras.optimizers.SGD(1.0), op=kdist.Sum)


@tf.function
def raw_step():
    with tf.GradientTape() as tape:
        loss = rank_loss(x)()
    opt.apply_gradients([(tape.gradient(loss, x), x)])


raw_step()
once["apply_gradients_traced"] = float(x.numpy())

x = scalar_variable()
opt = kdist.DistributedOptimizer(keras.optimizers.SGD(1.0), op=kdist.Sum)
grads_and_vars = opt._compute_gradients(rank_loss(x), [x])
once["computed_gradient"] = float(grads_and_vars[0][0].numpy())
opt.apply_gradients(grads_and_vars, experimental_aggregate_gradients=False)
once["compute_then_apply_eager"] = float(x.numpy())

x = scalar_variable()
opt = kdist.DistributedOptimizer(keras.optimizers.SGD(1.0), op=kdist.Sum)


@tf.function
def horovod_step():
    grads_and_vars = opt._compute_gradients(rank_loss(x), var_list=[x])
    clipped = [(tf.clip_by_value(g, -100.0, 100.0), v) for g, v in grads_and_vars]
    opt.apply_gradients(clipped)


horovod_step()
once["compute_clip_apply_traced"] = float(x.numpy())

keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((1,)),
                          keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")])
model.compile(optimizer=kdist.DistributedOptimizer(keras.optimizers.SGD(1.0), op=kdist.Sum),
              loss=lambda y_true, y_pred: keras.ops.sum(y_pred))
model.fit(np.full((1, 1), r + 1.0), np.zeros((1, 1)), epochs=1, verbose=0)
once["fit"] = float(model.get_weights()[0][0, 0])
out["once"] = once

# -- accumulation: local sums, one reduction per cycle -----------------------------------------
x = scalar_variable()
opt = kdist.DistributedOptimizer(keras.optimizers.SGD(1.0), backward_passes_per_step=2)


@tf.function
def accumulating_step():
    opt.apply_gradients(opt._compute_gradients(rank_loss(x), var_list=[x]))


trace = []
for _ in range(3):
    accumulating_step()
    trace.append(float(x.numpy()))
out["accumulated_trace"] = trace
out["accumulated_counter"] = int(opt._agg_helper.counter.numpy())

# -- local variables stay on their rank --------------------------------------------------------
model = keras.Sequential([
    keras.Input((3,)),
    keras.layers.Dense(2, kernel_initializer=keras.initializers.Constant(0.5), name="shared"),
    keras.layers.Dense(1, kernel_initializer=keras.initializers.Constant(float(r + 1)),
                       name="own")])
features = np.full((4, 3), 0.5, dtype=np.float32)
with tf.GradientTape(persistent=True) as tape:
    loss = tf.reduce_sum(model(features)) * (r + 1.0)
local_grads = tape.gradient(loss, model.trainable_weights)
partial = {}
for scale in (True, False):
    opt = kdist.PartialDistributedOptimizer(keras.optimizers.SGD(0.1),
                                            local_layers=model.layers[1],
                                            scale_local_gradients=scale)
    reduced = opt._compute_gradients(loss, model.trainable_weights, tape=tape)
    partial[str(scale)] = [np.asarray(g).tolist() for g, _ in reduced]
out["partial"] = partial
out["partial_local_tape"] = [np.asarray(g).tolist() for g in local_grads]
out["partial_mean_tape"] = [kdist.allreduce(np.asarray(g, np.float64)).tolist()
                            for g in local_grads]

# The same through fit, with two passes per update: the local kernel moves by its own
# gradient (divided by the number of ranks), the rest by the average.
before = [w.numpy() for w in model.trainable_weights]
targets = np.full((4, 1), float(r), dtype=np.float32)
with tf.GradientTape() as tape:
    loss = keras.losses.MeanSquaredError()(targets[:2], model(features[:2]))
pass_grads = [g.numpy() for g in tape.gradient(loss, model.trainable_weights)]
own = model.layers[1]
opt = kdist.DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=2,
                                 average_aggregated_gradients=True)
opt.register_local_var(own.kernel)
model.compile(optimizer=opt, loss="mse")
model.fit(features, targets, batch_size=2, epochs=1, verbose=0, shuffle=False)
expected = []
for w, g, v in zip(before, pass_grads, model.trainable_weights):
    step = g / n if v is own.kernel else kdist.allreduce(g)
    expected.append(w - 0.1 * step)
out["fit_local_error"] = float(max(np.max(np.abs(v.numpy() - e))
                                   for v, e in zip(model.trainable_weights, expected)))
out["fit_local_kernel"] = own.kernel.numpy().tolist()
out["fit_shared_kernel"] = model.layers[0].kernel.numpy().tolist()

# -- sparse gradients: allgathered, or reduced as dense ----------------------------------------
sparse = {}
for as_dense in (False, True):
    table = tf.Variable(np.zeros((4, 2), np.float32))
    opt = kdist.DistributedOptimizer(keras.optimizers.SGD(1.0), sparse_as_dense=as_dense)
    rows = [r, 3]
    grads_and_vars = opt._compute_gradients(
        lambda: tf.reduce_sum(tf.gather(table, rows)) * (r + 1.0), [table])
    grad = grads_and_vars[0][0]
    sparse[str(as_dense)] = {
        "kind": type(grad).__name__,
        "rows": int(grad.values.shape[0]) if isinstance(grad, tf.IndexedSlices) else None,
    }
    opt.apply_gradients(grads_and_vars)
    sparse[str(as_dense)]["table"] = table.numpy().tolist()
out["sparse"] = sparse

# -- explicit groups, and the scale factors around the sum ---------------------------------------
variables = [tf.Variable(np.zeros(k, np.float32), name=f"v{k}") for k in (1, 2, 3, 4)]
opt = kdist.DistributedOptimizer(keras.optimizers.SGD(1.0),
                                 groups=[[variables[0], variables[2]]])
grads_and_vars = opt._compute_gradients(
    lambda: (r + 1.0) * tf.add_n([tf.reduce_sum(v) for v in variables]), variables)
out["grouped_gradients"] = [g.numpy().tolist() for g, _ in grads_and_vars]
reducer = next(iter(opt._reducers.values()))
out["grouped_buckets"] = [[len(bucket) for bucket in plan] for plan in reducer.plans]
sums = kdist.comm.TensorReducer(average=False, prescale_factor=0.5, postscale_factor=3.0)(
    [tf.constant([r + 1.0]), tf.constant([r + 1], tf.int32)])
out["scaled_sums"] = [s.numpy().tolist() for s in sums]
opt = kdist.DistributedOptimizer(keras.optimizers.SGD(1.0), gradient_predivide_factor=4.0)
x = scalar_variable()
out["predivided_gradient"] = float(opt._compute_gradients(rank_loss(x), [x])[0][0].numpy())
reducer = next(iter(opt._reducers.values()))
out["predivide_factors"] = [reducer.prescale_factor, reducer.postscale_factor]

# -- the broadcast callback leaves local variables alone ---------------------------------------
init = keras.initializers.Constant(float(r))
model = keras.Sequential([keras.Input((3,)),
                          keras.layers.Dense(3, kernel_initializer=init, bias_initializer=init),
                          keras.layers.Dense(2, kernel_initializer=init, bias_initializer=init)])
model.compile(optimizer=kdist.DistributedOptimizer(keras.optimizers.SGD(0.0)), loss="mse")
callback = kdist.callbacks.BroadcastGlobalVariablesCallback(
    root_rank=np.int64(n - 1), local_variables=model.layers[0].variables)
model.fit(np.ones((2, 3)), np.ones((2, 2)), epochs=1, verbose=0, callbacks=[callback])
out["broadcast_local"] = [float(np.mean(v)) for v in model.layers[0].get_weights()]
out["broadcast_shared"] = [float(np.mean(v)) for v in model.layers[1].get_weights()]

# -- SyncBatchNormalization equals BatchNormalization on the global batch ----------------------
rng = np.random.default_rng(5)
counts = [3 + 2 * k for k in range(n)]  # uneven shares of the global batch
data = (rng.normal(size=(sum(counts), 4)) * 1.5 + 0.5).astype(np.float32)
upstream = rng.normal(size=data.shape).astype(np.float32)
start = sum(counts[:r])
mine = slice(start, start + counts[r])
options = dict(momentum=0.9, gamma_initializer=keras.initializers.Constant(1.3),
               beta_initializer=keras.initializers.Constant(-0.2))


def forward_and_backward(layer, x, weights):
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = layer(x, training=True)
        loss = tf.reduce_sum(y * weights)
    dx, dgamma, dbeta = tape.gradient(loss, [x, layer.gamma, layer.beta])
    return y, dx, dgamma, dbeta


sync = kdist.SyncBatchNormalization(**options)
sync.build((None, 4))
y, dx, dgamma, dbeta = [t.numpy() for t in tf.function(forward_and_backward)(
    sync, tf.constant(data[mine]), tf.constant(upstream[mine]))]
plain = keras.layers.BatchNormalization(**options)
plain.build((None, 4))
y_ref, dx_ref, dgamma_ref, dbeta_ref = [t.numpy() for t in forward_and_backward(
    plain, tf.constant(data), tf.constant(upstream))]
out["sync_bn"] = {
    "outputs": float(np.max(np.abs(y - y_ref[mine]))),
    "input_gradients": float(np.max(np.abs(dx - dx_ref[mine]))),
    "gamma_gradient": float(np.max(np.abs(kdist.allreduce(dgamma, op=kdist.Sum) - dgamma_ref))),
    "beta_gradient": float(np.max(np.abs(kdist.allreduce(dbeta, op=kdist.Sum) - dbeta_ref))),
    "moving_mean": float(np.max(np.abs(sync.moving_mean.numpy() - plain.moving_mean.numpy()))),
    "moving_variance": float(np.max(np.abs(sync.moving_variance.numpy()
                                           - plain.moving_variance.numpy()))),
    "inference": float(np.max(np.abs(sync(data[mine], training=False).numpy()
                                     - plain(data[mine], training=False).numpy()))),
    "local_statistics_differ": float(np.max(np.abs(np.mean(data[mine], 0) - np.mean(data, 0)))),
}
report(out)
