"""Tensor-parallel layers against the unsplit Keras layers, on every rank of the job.

Every rank builds the same unsplit layers with the same random weights, gives
each split layer this rank's slice of them (`load_from_full`), and compares,
for the same loss, the outputs, the gradients of the inputs and the gradient
of each weight slice with the unsplit layer's (sliced alike). Then a Megatron
MLP (column then row) and a copy of it compiled with XLA train 3 SGD steps
beside the unsplit MLP. Wrong-size layers report their errors.

`python tensor_parallel.py pairs` (on 4 ranks): two groups of two ranks, each
splitting its layers over its own `kdist.ProcessSet` with its own data.
"""

import sys

import keras
import numpy as np
import tensorflow as tf

import kdist
from kdist.comm.differentiable import reduce_from_group
from kdist.comm.process_sets import communicator_of
from kdist.tensor_parallel import (
    ColumnParallelDense,
    ColumnParallelEinsumDense,
    RowParallelDense,
    RowParallelEinsumDense,
    TensorParallelMultiHeadAttention,
)
from workers.common import report

TOLERANCE = dict(rtol=1e-5, atol=1e-5)

kdist.init()
pairs = sys.argv[1:] == ["pairs"]
if pairs:
    sets = [kdist.ProcessSet([0, 1]), kdist.ProcessSet([2, 3])]
    for process_set in sets:
        kdist.add_process_set(process_set)
    group = sets[kdist.rank() // 2]
    comm = communicator_of(group)
    # Each pair sees its own data, so that a sum over the wrong ranks would show.
    seed = 100 + kdist.rank() // 2
else:
    group = None
    comm = kdist.comm.world()
    seed = 0
rank, size = comm.rank, comm.size
rng = np.random.default_rng(seed)
keras.utils.set_random_seed(seed)


def normal(*shape):
    return rng.normal(size=shape).astype("float32")


def mine(array, axis):
    """This rank's slice of `array` along `axis`."""
    return np.split(np.asarray(array), size, axis=axis)[rank]


def compare(got, expected):
    got, expected = np.asarray(got), np.asarray(expected)
    if got.shape != expected.shape:
        return {"ok": False, "gap": f"shape {got.shape} instead of {expected.shape}"}
    return {"ok": bool(np.allclose(got, expected, **TOLERANCE)),
            "gap": float(np.max(np.abs(got - expected))) if got.size else 0.0}


def randomize(layer):
    """Random weights (biases too, so that a bias added twice would show)."""
    layer.set_weights([0.5 * normal(*w.shape) for w in layer.get_weights()])


def check(reference, layer, inputs, apply=None, input_axes=None, output_axis=None,
          weight_axes=()):
    """Forward and backward of `layer` on this rank's inputs against `reference` on all.

    `input_axes[i]`: the axis along which the split layer gets a slice of input
    i (None: the whole input); `output_axis`: the axis of the output it
    returns a slice of; `weight_axes`: the axis each weight is split along.
    """
    apply = apply or (lambda lay, xs: lay(*xs))
    input_axes = input_axes or [None] * len(inputs)
    full = [tf.constant(x) for x in inputs]
    apply(reference, full)  # builds it
    randomize(reference)
    layer.load_from_full(reference)
    with tf.GradientTape() as tape:
        tape.watch(full)
        expected = apply(reference, full)
        weights = tf.constant(normal(*expected.shape))
        loss = tf.reduce_sum(expected * weights)
    expected_grads = tape.gradient(loss, full + reference.trainable_weights)
    given = [x if axis is None else tf.constant(mine(x, axis))
             for x, axis in zip(full, input_axes)]
    with tf.GradientTape() as tape:
        tape.watch(given)
        got = apply(layer, given)
        if output_axis is None:
            loss = tf.reduce_sum(got * weights)
        else:
            # The loss of the whole output, from each rank's part of it.
            loss = reduce_from_group(tf.reduce_sum(got * mine(weights, output_axis)), comm)
    grads = tape.gradient(loss, given + layer.trainable_weights)
    n = len(inputs)
    result = {
        "output": compare(got, expected if output_axis is None else mine(expected,
                                                                        output_axis)),
        "inputs": [compare(g, e if axis is None else mine(e, axis))
                   for g, e, axis in zip(grads[:n], expected_grads[:n], input_axes)],
        "weights": [compare(g, e if axis is None else mine(e, axis))
                    for g, e, axis in zip(grads[n:], expected_grads[n:], weight_axes)],
        "full_weights": [compare(g, e) for g, e in zip(layer.full_weights(),
                                                       reference.get_weights())],
        "counts": [len(layer.trainable_weights), len(reference.trainable_weights)],
    }
    return result


def cases():
    out = {}
    tokens = normal(2, 5, 8)
    attention_axes = [1, 0, 1, 0, 1, 0, 0, None]  # q, k, v, output: kernel and bias each
    out["attention_self_causal"] = check(
        keras.layers.MultiHeadAttention(4, 3, value_dim=2),
        TensorParallelMultiHeadAttention(4, 3, value_dim=2, group=group), [tokens],
        apply=lambda layer, xs: layer(xs[0], xs[0], use_causal_mask=True),
        weight_axes=attention_axes)
    if pairs:
        return out

    x = normal(4, 8)
    out["column_dense"] = check(keras.layers.Dense(6), ColumnParallelDense(6, group=group),
                                [x], output_axis=1, weight_axes=[1, 0])
    out["column_dense_gathered"] = check(
        keras.layers.Dense(6, activation="tanh"),
        ColumnParallelDense(6, group=group, gather_output=True, activation="tanh"), [x],
        weight_axes=[1, 0])
    out["row_dense"] = check(keras.layers.Dense(5, activation="tanh"),
                             RowParallelDense(5, group=group, activation="tanh"), [x],
                             input_axes=[1], weight_axes=[0, None])
    out["row_dense_whole_input"] = check(
        keras.layers.Dense(5), RowParallelDense(5, group=group, input_is_parallel=False), [x],
        weight_axes=[0, None])

    out["einsum_column_heads"] = check(
        keras.layers.EinsumDense("abc,cde->abde", (None, 4, 3), bias_axes="de"),
        ColumnParallelEinsumDense("abc,cde->abde", (None, 4, 3), "d", group=group,
                                  bias_axes="de"),
        [tokens], output_axis=2, weight_axes=[1, 0])
    # A bias shared by the heads is held whole and its gradient summed over the group.
    out["einsum_column_shared_bias_gathered"] = check(
        keras.layers.EinsumDense("abc,cde->abde", (None, 4, 3), bias_axes="e"),
        ColumnParallelEinsumDense("abc,cde->abde", (None, 4, 3), "d", group=group,
                                  bias_axes="e", gather_output=True),
        [tokens], weight_axes=[1, None])
    # A Communicator as the group (the world's ranks in one sub-communicator).
    out["einsum_row_heads"] = check(
        keras.layers.EinsumDense("abcd,cde->abe", (None, 8), bias_axes="e"),
        RowParallelEinsumDense("abcd,cde->abe", (None, 8), "c", bias_axes="e",
                               group=comm.split(0)),
        [normal(2, 5, 4, 3)], input_axes=[2], weight_axes=[0, None])

    mask = rng.random((2, 5, 6)) < 0.7
    mask[:, :, 0] = True  # every query attends somewhere
    out["attention_cross_masked"] = check(
        keras.layers.MultiHeadAttention(4, 3, output_shape=7),
        TensorParallelMultiHeadAttention(4, 3, output_shape=7, group=group),
        [tokens, normal(2, 6, 5), normal(2, 6, 9)],
        apply=lambda layer, xs: layer(xs[0], xs[1], key=xs[2], attention_mask=mask),
        weight_axes=attention_axes)
    return out


def mlp_training(steps=3, xla=True):
    """A Megatron MLP trained eagerly, and (with `xla`) its copy in an XLA-compiled step,
    beside the unsplit MLP: losses and the gathered weights after each step."""
    x, y = normal(6, 8), normal(6, 8)
    reference = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, "gelu"),
                                  keras.layers.Dense(8)])
    randomize(reference)

    def split_mlp():
        column = ColumnParallelDense(16, group=group, activation="gelu")
        row = RowParallelDense(8, group=group)
        column.load_from_full(reference.layers[0])
        row.load_from_full(reference.layers[1])
        return keras.Sequential([keras.Input((8,)), column, row])

    eager, compiled = split_mlp(), split_mlp()

    def train_step(model, optimizer):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
        grads = tape.gradient(loss, model.trainable_weights)
        optimizer.apply_gradients(zip(grads, model.trainable_weights))
        return loss

    optimizers = [keras.optimizers.SGD(0.1) for _ in range(3)]
    xla_step = tf.function(lambda: train_step(compiled, optimizers[2]), jit_compile=True)
    models = {"eager": eager, "xla": compiled} if xla else {"eager": eager}
    losses = {"reference": [], **{name: [] for name in models}}
    weights = {name: [] for name in models}
    for _ in range(steps):
        losses["reference"].append(float(train_step(reference, optimizers[0])))
        losses["eager"].append(float(train_step(eager, optimizers[1])))
        if xla:
            losses["xla"].append(float(xla_step()))
        full = reference.get_weights()
        for name, model in models.items():
            gathered = [w for layer in model.layers for w in layer.full_weights()]
            weights[name].append([compare(g, e) for g, e in zip(gathered, full)])
    return {"losses": losses, "weights": weights,
            "loss_fell": losses["reference"][-1] < losses["reference"][0]}


def attention_under_xla():
    """Self-attention's forward and gradients in one XLA-compiled function."""
    tokens = tf.constant(normal(2, 5, 8))
    reference = keras.layers.MultiHeadAttention(4, 2)
    reference(tokens, tokens)
    randomize(reference)
    layer = TensorParallelMultiHeadAttention(4, 2, group=group)
    layer.load_from_full(reference)

    def forward_backward(attention, x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(tf.sin(attention(x, x)))
        return loss, tape.gradient(loss, [x] + attention.trainable_weights)

    expected = forward_backward(reference, tokens)
    got = tf.function(lambda x: forward_backward(layer, x), jit_compile=True)(tokens)
    axes = [None, 1, 0, 1, 0, 1, 0, 0, None]
    return {"loss": compare(got[0], expected[0]),
            "grads": [compare(g, e if axis is None else mine(e, axis))
                      for g, e, axis in zip(got[1], expected[1], axes)]}


def errors():
    """What wrong sizes for this group say (every size divides in a world of one)."""
    attempts = {
        "units": lambda: ColumnParallelDense(5, group=group),
        "heads": lambda: TensorParallelMultiHeadAttention(3, 4, group=group),
        "einsum_heads": lambda: ColumnParallelEinsumDense("abc,cde->abde", (None, 3, 4), "d",
                                                          group=group),
        "row_width": lambda: RowParallelDense(4, group=group, input_is_parallel=False)(
            np.ones((2, 5), "float32")),
        "load_rows": lambda: RowParallelDense(4, group=group).load_from_full(
            [np.ones((5, 4), "float32"), np.ones(4, "float32")]),
    }
    said = {}
    for name, attempt in attempts.items():
        try:
            attempt()
            said[name] = None
        except ValueError as error:
            said[name] = str(error)
    return said


def with_data_parallelism():
    """Two pairs each hold the MLP split in two and train on half of every global batch;
    each rank averages its gradients with the rank holding the same slices in the other
    pair. Returns the largest difference from the whole MLP trained on the global batch."""
    same_slice = kdist.ProcessSet([rank, rank + 2])
    kdist.add_process_set(same_slice)

    def whole():
        keras.utils.set_random_seed(7)
        return keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu"),
                                 keras.layers.Dense(4)])

    data = np.random.default_rng(7)
    x, y = data.normal(size=(64, 16)).astype("float32"), data.normal(size=(64, 4))
    reference = whole()
    reference.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    reference.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0)

    split = keras.Sequential([keras.Input((16,)),
                              ColumnParallelDense(32, activation="relu", group=group),
                              RowParallelDense(4, group=group)])
    for layer, full in zip(split.layers, whole().layers):
        layer.load_from_full(full)
    split.compile(optimizer=kdist.DistributedOptimizer(keras.optimizers.SGD(0.1),
                                                       process_set=same_slice), loss="mse")
    # Pair p takes rows 8p to 8p + 7 of every global batch of 16.
    rows = np.arange(64).reshape(4, 2, 8)[:, kdist.rank() // 2].reshape(-1)
    split.fit(x[rows], y[rows], batch_size=8, epochs=3, shuffle=False, verbose=0)
    gathered = [w for layer in split.layers for w in layer.full_weights()]
    return max(float(np.max(np.abs(g - e))) for g, e in zip(gathered, reference.get_weights()))


result = {"group_size": size, "group_rank": rank}
if pairs:
    result["cases"] = cases()
    result["mlp"] = mlp_training(steps=2, xla=False)
    result["data_parallel_error"] = with_data_parallelism()
else:
    result["cases"] = cases()
    result["mlp"] = mlp_training()
    result["xla_attention"] = attention_under_xla()
    result["errors"] = errors()
report(result)
