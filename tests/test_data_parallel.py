"""Synchronous data parallelism: N ranks at batch b behave as one process at batch N*b."""

import numpy as np
import pytest

pytestmark = pytest.mark.mpi


ENGINES = {"native": {}, "py_function": {"KDIST_NATIVE_OPS": "0"}}


# Each engine with one optimizer: the optimizer only changes what is applied after
# the reduction, which both engines hand back alike.
@pytest.mark.parametrize("engine,optimizer,lr,tolerance", [("native", "adam", 1e-3, 1e-4),
                                                           ("py_function", "sgd", 0.05, 1e-5)])
def test_two_ranks_match_one_process_on_the_global_batch(mpirun, python_run, optimizer, lr,
                                                         tolerance, engine):
    args = ["--optimizer", optimizer, "--lr", lr, "--global-batch", 16, "--steps", 20]
    single = python_run("train.py", args)
    job = mpirun("train.py", n=2, args=args, env=ENGINES[engine])
    rank0, rank1 = job.rank(0), job.rank(1)
    assert rank0["native"] == (engine == "native"), "the engine under test must be the one used"
    assert rank0["weights"] == rank1["weights"], "ranks must hold bit-identical weights"
    np.testing.assert_allclose(rank0["weights"], single["weights"], atol=tolerance, rtol=0)
    assert rank0["iterations"] == single["iterations"] == 20
    assert rank0["loss_after"] < rank0["loss_before"]


def test_broadcast_starts_every_rank_from_the_root_weights(mpirun):
    job = mpirun("train.py", n=2, args=["--seed-per-rank", "--steps", 5])
    rank0, rank1 = job.rank(0), job.rank(1)
    assert rank0["built"] != rank1["built"]
    # Before the first step, not merely by the end: both start from rank 0's.
    assert rank0["first_step"] == rank1["first_step"] == rank0["built"]
    assert rank0["weights"] == rank1["weights"]


def test_compressed_gradients_keep_ranks_identical_and_differ_from_exact_as_their_kind_does(
        mpirun):
    args = ["--steps", 20, "--lr", 0.1]
    runs = {kind: mpirun("train.py", n=2, args=args + ["--compression", kind])
            for kind in ("none", "fp16", "topk")}
    for kind, job in runs.items():
        assert job.rank(0)["weights"] == job.rank(1)["weights"], kind
        assert job.rank(0)["loss_after"] < 0.9 * job.rank(0)["loss_before"], kind
    exact = np.array(runs["none"].rank(0)["weights"])
    # fp16 rounds each gradient to 11 significant bits: close to exact, not equal.
    fp16 = np.abs(np.array(runs["fp16"].rank(0)["weights"]) - exact).max()
    assert 0 < fp16 < 2e-3
    # top-k sends 30% of the entries each step and defers the rest: further from
    # exact after 20 steps, but its error feedback keeps it learning (above).
    topk = np.abs(np.array(runs["topk"].rank(0)["weights"]) - exact).max()
    assert topk > 20 * fp16 and topk > 1e-3


def test_gradient_accumulation_equals_one_larger_batch(mpirun, python_run):
    # 2 ranks x 2 accumulated passes x batch 4 == one process with batch 16.
    args = ["--global-batch", 16, "--steps", 10]
    accumulated = mpirun("train.py", n=2, args=args + ["--accumulate", 2])
    single = python_run("train.py", args)
    assert accumulated.rank(0)["iterations"] == 10 * 2, "every backward pass counts"
    np.testing.assert_allclose(accumulated.rank(0)["weights"], single["weights"], atol=1e-5)


OVERLAP_GRAPH = """
import os
import keras
import tensorflow as tf
import kdist
from workers.common import report

kdist.init()
found = {}
for overlap in ("1", "0"):
    os.environ["KDIST_OVERLAP"] = overlap
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16),
                              keras.layers.Dense(16), keras.layers.Dense(4)])
    # Small buckets: about one layer each.
    optimizer = kdist.DistributedOptimizer(keras.optimizers.SGD(0.1), bucket_bytes=1200)
    optimizer.build(model.trainable_variables)
    grads = {}

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2)
        gradients = tape.gradient(loss, model.trainable_variables)
        grads["first"], grads["last"] = gradients[0], gradients[-1]
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        return loss

    graph = step.get_concrete_function(tf.TensorSpec((4, 8)), tf.TensorSpec((4, 4))).graph
    reductions = {op.get_attr("label").decode().split(", bucket ")[-1]: op
                  for op in graph.get_operations() if op.type == "KdistAllreduce"}

    def ancestors(op):
        seen, todo = set(), [op]
        while todo:
            for before in [t.op for t in todo[-1].inputs] + list(todo.pop().control_inputs):
                if before.name not in seen:
                    seen.add(before.name)
                    todo.append(before)
        return seen

    seen = ancestors(reductions["0"])
    found[overlap] = {"buckets": len(reductions),
                      "needs_last_layer": grads["last"].op.name in seen,
                      "needs_first_layer": grads["first"].op.name in seen,
                      # Every rank must run the buckets in one order.
                      "in_order": all(reductions[str(i - 1)].name in ancestors(reductions[str(i)])
                                      for i in range(1, len(reductions)))}
report(found)
"""


def test_the_first_bucket_reduces_the_last_layer_without_waiting_for_the_first(mpirun):
    """Buckets run in backpropagation order and start before backpropagation ends."""
    out = mpirun(OVERLAP_GRAPH, n=2, timeout=120).results[0]
    assert out["1"]["buckets"] >= 3
    assert out["1"]["needs_last_layer"] and not out["1"]["needs_first_layer"]
    assert out["1"]["in_order"]
    # KDIST_OVERLAP=0: the same buckets, each after the whole backward pass.
    assert out["0"]["buckets"] == out["1"]["buckets"]
    assert out["0"]["needs_last_layer"] and out["0"]["needs_first_layer"]
