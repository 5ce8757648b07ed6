"""How a custom loop's gradients travel: one collective per tensor against fused ones.

    kdist run -n 2 --no-prefix benchmarks/custom_loop.py [--layers 12] [--width 256]
        [--steps 100] [--rounds 3]

The same `tf.function` train step of an MLP with `--layers` hidden Dense
layers (2 variables each) is run in five ways, interleaved step by step so
that whatever else the machine does touches all alike:

- `local`: the tape's own gradients, no communication (the compute floor);
- `per_tensor`: `[kdist.allreduce(g) for g in grads]`, a port of Horovod code
  written for Horovod's background fusion: kdist's fusion queue collects the
  separate allreduces and fuses those every rank has ready;
- `per_tensor_unfused`: the same with the queue off (`KDIST_FUSION=0` while it
  is traced): one announced collective each;
- `grouped`: `kdist.grouped_allreduce(grads)`;
- `tape`: `kdist.DistributedGradientTape`, which fuses like `DistributedOptimizer`.

Per round, each way's median step time; the figures are medians over rounds,
with each way's communication cost (step - local) and its ratio to the tape's.
Rank 0 prints one JSON object.
"""

import argparse
import json
import os
import time

import numpy as np
import tensorflow as tf

import kdist


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    kdist.init()
    tf.keras.utils.set_random_seed(0)
    model = tf.keras.Sequential([tf.keras.Input((args.width,))] + [
        tf.keras.layers.Dense(args.width, activation="relu") for _ in range(args.layers)] + [
        tf.keras.layers.Dense(10)])
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    rng = np.random.default_rng(kdist.rank())
    x = tf.constant(rng.normal(size=(64, args.width)).astype("float32"))
    y = tf.constant(rng.integers(0, 10, 64))

    def step(way):
        reduce = "per_tensor" if way == "per_tensor_unfused" else way

        @tf.function
        def run():
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            if reduce == "tape":
                tape = kdist.DistributedGradientTape(tape)
            grads = tape.gradient(loss, model.trainable_variables)
            if reduce == "per_tensor":
                grads = [kdist.allreduce(g) for g in grads]
            elif reduce == "grouped":
                grads = kdist.grouped_allreduce(grads)
            return tf.add_n([tf.reduce_sum(g) for g in grads])
        return run

    ways = ["local", "per_tensor", "per_tensor_unfused", "grouped", "tape"]
    steps = {way: step(way) for way in ways}
    chosen = os.environ.get("KDIST_FUSION")
    for way in ways:  # trace (the queue is chosen then) and warm up
        os.environ["KDIST_FUSION"] = "0" if way == "per_tensor_unfused" else "1"
        for _ in range(3):
            steps[way]()
    if chosen is None:
        os.environ.pop("KDIST_FUSION")
    else:
        os.environ["KDIST_FUSION"] = chosen
    medians = {way: [] for way in ways}
    for _ in range(args.rounds):
        times = {way: [] for way in ways}
        for _ in range(args.steps):
            for way in ways:
                kdist.barrier()
                start = time.perf_counter()
                steps[way]()
                times[way].append(time.perf_counter() - start)
        for way in ways:
            medians[way].append(float(np.median(times[way])) * 1e3)
    step_ms = {way: float(np.median(medians[way])) for way in ways}
    cost = {way: step_ms[way] - step_ms["local"] for way in ways if way != "local"}
    # What a broken benchmark would get wrong: every way of reducing gives each rank the
    # same averaged gradients (their sum here), and the local step each rank its own.
    sums = {way: float(steps[way]().numpy()) for way in ways}
    sums_per_rank = kdist.allgather_object(sums)
    result = {
        "ranks": kdist.size(), "tensors": len(model.trainable_variables),
        "gradient_sum_per_rank": sums_per_rank,
        "parameters": int(sum(np.prod(v.shape) for v in model.trainable_variables)),
        "step_ms": step_ms, "communication_ms": cost,
        "communication_vs_tape": {way: cost[way] / cost["tape"] if cost["tape"] > 0 else None
                                  for way in cost},
    }
    if kdist.rank() == 0:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
