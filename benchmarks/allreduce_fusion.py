"""kdist's fused allreduce of a model's gradients vs one raw MPI Allreduce of the same bytes.

    kdist run -n 2 --no-prefix benchmarks/allreduce_fusion.py

Measures, on the 784-512-512-10 MLP's gradient set (6 tensors, 2.7 MB):
- `raw_mpi4py`: one `MPI.COMM_WORLD.Allreduce` of a float32 buffer of the same size (the floor);
- `kdist_numpy`: `Communicator.allreduce_many` on the numpy gradients (announce, pack,
  allreduce, average), the path of `kdist.allreduce` on numpy arrays;
- `kdist_in_graph`: the DistributedOptimizer's path inside `tf.function`, as in `fit`
  (kdist's C++ allreduce op), less the cost of calling a `tf.function` that only passes
  the same gradients through;
- `kdist_in_graph_py_function`: the same through the py-function op (the fallback).
The cases take turns call by call; prints one JSON object on rank 0: each case's
median ms per call, and the median of its ratio to the raw allreduce next to it.
"""

import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _mlp import build_mlp, one_thread  # noqa: E402

one_thread()
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from mpi4py import MPI  # noqa: E402

import kdist  # noqa: E402
from kdist.comm import graph_ops  # noqa: E402
from kdist.comm.tensors import TensorReducer  # noqa: E402

REPEATS = int(os.environ.get("REPEATS", "300"))


def interleaved(cases, repeats=REPEATS):
    """ms per call of each case, {name: array}; the cases take turns, call by call.

    The speed between the two cores changes within a launch (see
    benchmarks/core_placement.py), so every case is timed next to the others:
    neighbouring calls see the same machine.
    """
    comm = MPI.COMM_WORLD
    for _ in range(20):
        for fn in cases.values():
            fn()
    samples = {name: [] for name in cases}
    for _ in range(repeats):
        for name, fn in cases.items():
            comm.Barrier()
            start = time.perf_counter()
            fn()
            samples[name].append((time.perf_counter() - start) * 1e3)
    return {name: np.array(times) for name, times in samples.items()}


def main():
    kdist.init()
    model = build_mlp()
    grads_np = [np.random.default_rng(i).normal(size=v.shape).astype(np.float32)
                for i, v in enumerate(model.trainable_variables)]
    nbytes = sum(g.nbytes for g in grads_np)
    flat = np.ones(nbytes // 4, np.float32)
    out = np.empty_like(flat)

    raw = lambda: MPI.COMM_WORLD.Allreduce(flat, out, op=MPI.SUM)  # noqa: E731
    world = kdist.comm.world()
    fused_numpy = lambda: world.allreduce_many(grads_np, average=True)  # noqa: E731

    opt = kdist.DistributedOptimizer(keras.optimizers.SGD())
    fallback = TensorReducer()
    grads_tf = [tf.constant(g) for g in grads_np]

    # Each function first makes fresh tensors, as a backward pass would, so that the op
    # may reduce them in place; the pass-through function does the same and no more.
    @tf.function
    def in_graph(grads):
        return opt.allreduce_gradients([g * 1.0 for g in grads])

    @tf.function
    def in_graph_py_function(grads):
        return fallback([g * 1.0 for g in grads])

    @tf.function
    def pass_through(grads):
        return [g * 1.0 for g in grads]

    # Traced while the C++ ops are hidden, so that it keeps the py-function op.
    native_ops = graph_ops._native_ops
    graph_ops._native_ops = lambda comm: None
    in_graph_py_function.get_concrete_function(grads_tf)
    graph_ops._native_ops = native_ops

    fused_graph = lambda: [g.numpy() for g in in_graph(grads_tf)]  # noqa: E731
    fused_graph_py = lambda: [g.numpy() for g in in_graph_py_function(grads_tf)]  # noqa: E731
    call_only = lambda: [g.numpy() for g in pass_through(grads_tf)]  # noqa: E731

    cases = {"raw_mpi4py": raw, "kdist_numpy": fused_numpy, "graph_call": call_only,
             "graph_allreduce": fused_graph, "graph_allreduce_py": fused_graph_py}
    times = interleaved(cases)
    per_call = {"raw_mpi4py": times["raw_mpi4py"], "kdist_numpy": times["kdist_numpy"],
                "kdist_in_graph": times["graph_allreduce"] - times["graph_call"],
                "kdist_in_graph_py_function": times["graph_allreduce_py"] - times["graph_call"]}
    ms = {k: float(np.median(v)) for k, v in per_call.items()}
    # Each call's ratio to the raw allreduce next to it, then the median.
    ratios = {k: float(np.median(v / per_call["raw_mpi4py"])) for k, v in per_call.items()}
    if kdist.rank() == 0:
        print(json.dumps({
            "benchmark": "allreduce_fusion",
            "ranks": kdist.size(),
            "gradient_tensors": len(grads_np),
            "megabytes": round(nbytes / 1e6, 3),
            "ms": {k: round(v, 4) for k, v in ms.items()},
            "ratio_to_raw": {k: round(v, 3) for k, v in ratios.items()},
            "target_ratio": 1.15,
        }, indent=2))


if __name__ == "__main__":
    main()
