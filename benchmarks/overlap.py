"""How much of the gradient allreduce a compute-bound step hides behind backpropagation.

    kdist run -n 2 --no-prefix benchmarks/overlap.py [--width 1024] [--depth 4]
        [--batch 256] [--bucket-mb 4] [--inter-op-threads 2] [--rounds 3] [--steps 20]
        [--model mlp|conv] [--probe]

Three copies of one MLP (784, then `--depth` layers of `--width`, then 10;
4.0M parameters and 16 MB of gradient by default) train side by side, one
step each in turn, every step started together on all ranks (a barrier
before it), so that whatever else the machine does touches all three alike:

- `plain`: the plain Keras optimizer, no communication (the compute floor);
- `serial`: `kdist.DistributedOptimizer` with every bucket waiting for the
  whole backward pass (`KDIST_OVERLAP=0`);
- `overlap`: the same buckets, each reduced as soon as its gradients exist;
- `raw_allreduce`: one `MPI.COMM_WORLD.Allreduce` of a buffer of the gradient's bytes,
  the floor for the communication alone;
- `forward`: the plain model's forward pass and loss alone, so that plain - forward is
  the backward pass (and update) that overlap can hide the transfer behind.

`communication_ms` = serial - plain, `hidden_fraction` =
(serial - overlap) / (serial - plain), per round from the median step times;
the figures are the medians over rounds. Overlap needs a second inter-op
thread per rank (`--inter-op-threads`, one intra-op thread either way) and a
core for it to run on; with two ranks on two cores there is none to spare,
and that run shows what sharing costs.

Rank 0 prints one JSON object.
"""

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _mlp import build_convnet, synthetic_images, synthetic_mnist_like  # noqa: E402

SETTLE = 2


def build(width, depth, distributed, overlap, bucket_bytes, conv=False):
    import keras

    import kdist

    keras.utils.set_random_seed(0)
    if conv:
        model = build_convnet(width, dense=128 * depth)
    else:
        model = keras.Sequential(
            [keras.Input((784,))]
            + [keras.layers.Dense(width, activation="relu") for _ in range(depth)]
            + [keras.layers.Dense(10)])
    optimizer = keras.optimizers.SGD(0.01)
    if distributed:
        optimizer = kdist.DistributedOptimizer(optimizer, bucket_bytes=bucket_bytes)
    model.compile(optimizer=optimizer, jit_compile=False,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model, overlap


def first_step(model, overlap, x, y):
    """Traces the step with `KDIST_OVERLAP` set as the model asks (read when traced)."""
    saved = os.environ.get("KDIST_OVERLAP")
    os.environ["KDIST_OVERLAP"] = "1" if overlap else "0"
    try:
        model.train_on_batch(x, y)
    finally:
        if saved is None:
            os.environ.pop("KDIST_OVERLAP")
        else:
            os.environ["KDIST_OVERLAP"] = saved


def forward_pass(model):
    """The plain model's forward pass and loss, compiled as its training step is: what
    precedes the backward pass, so that plain - forward is the backward pass (with the
    optimizer's update, which no communication can hide either)."""
    import keras
    import tensorflow as tf

    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def forward(x, y):
        return loss(y, model(x, training=True))

    return forward


def interleaved(models, forward, x, y, batch, steps, comm, raw):
    """Step times (ms) of each model, then of one raw allreduce of `raw` (its gradient's
    bytes), then of the plain model's forward pass, per step: rows of [plain, serial,
    overlap, raw, forward]."""
    import tensorflow as tf

    received = np.empty_like(raw)
    times = []
    for step in range(steps + SETTLE):
        rows = slice(batch * step, batch * (step + 1))
        row = []
        for model in models:
            comm.Barrier()
            start = time.perf_counter()
            model.train_on_batch(x[rows], y[rows])
            row.append((time.perf_counter() - start) * 1e3)
        comm.Barrier()
        start = time.perf_counter()
        comm.Allreduce(raw, received)
        row.append((time.perf_counter() - start) * 1e3)
        inputs, labels = tf.constant(x[rows]), tf.constant(y[rows])
        start = time.perf_counter()
        forward(inputs, labels).numpy()
        row.append((time.perf_counter() - start) * 1e3)
        times.append(row)
    return np.array(times[SETTLE:])


def link_probe(comm, repeats=9):
    """[bytes, median ms] of raw allreduces of 64 KiB to 16 MiB."""
    rows = []
    for nbytes in (2**16, 2**18, 2**20, 2**22, 2**24):
        data = np.ones(nbytes // 4, np.float32)
        out = np.empty_like(data)
        times = []
        for _ in range(repeats):
            comm.Barrier()
            start = time.perf_counter()
            comm.Allreduce(data, out)
            times.append((time.perf_counter() - start) * 1e3)
        rows.append([nbytes, round(float(np.median(times)), 4)])
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--bucket-mb", type=float, default=4.0,
                        help="most MiB per bucket; 0: kdist's default for the job")
    parser.add_argument("--inter-op-threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--model", choices=("mlp", "conv"), default="mlp",
                        help="conv: the convolutional net of benchmarks/_mlp.py on 32x32 "
                             "images, --width filters and a dense layer of 128 x --depth")
    parser.add_argument("--probe", action="store_true",
                        help="also time raw allreduces of 64 KiB to 16 MiB (the link's "
                             "latency and bandwidth, for the cost model)")
    args = parser.parse_args()
    if min(args.width, args.depth, args.batch, args.inter_op_threads, args.rounds) < 1:
        parser.error("--width, --depth, --batch, --inter-op-threads and --rounds must be "
                     "positive")
    if args.steps <= SETTLE or args.bucket_mb < 0:
        parser.error(f"--steps must be more than {SETTLE} and --bucket-mb not negative")

    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(args.inter_op_threads)
    from mpi4py import MPI

    import kdist

    kdist.init()
    if kdist.size() < 2:
        parser.error("run it on 2 or more ranks: kdist run -n 2 benchmarks/overlap.py")
    bucket_bytes = int(args.bucket_mb * 2**20) or None
    data = synthetic_images if args.model == "conv" else synthetic_mnist_like
    x, y = data(args.batch * (args.steps + SETTLE), seed=kdist.rank())
    built = [build(args.width, args.depth, name != "plain", name == "overlap", bucket_bytes,
                   conv=args.model == "conv")
             for name in ("plain", "serial", "overlap")]
    for model, overlap in built:
        first_step(model, overlap, x[:args.batch], y[:args.batch])
    models = [model for model, _ in built]
    parameters = sum(int(np.prod(v.shape)) for v in models[0].trainable_variables)
    raw = np.ones(parameters, np.float32)
    forward = forward_pass(models[0])
    forward(x[:args.batch], y[:args.batch])
    rounds = []
    for _ in range(args.rounds):
        plain, serial, overlap, allreduce, forward_ms = np.median(
            interleaved(models, forward, x, y, args.batch, args.steps, MPI.COMM_WORLD, raw),
            axis=0)
        communication = serial - plain
        rounds.append({"plain_ms": round(plain, 3), "forward_ms": round(forward_ms, 3),
                       "serial_ms": round(serial, 3),
                       "overlap_ms": round(overlap, 3),
                       "raw_allreduce_ms": round(allreduce, 3),
                       "communication_ms": round(communication, 3),
                       "hidden_fraction": round((serial - overlap) / communication, 3)
                       if communication > 0 else None})
    median = {key: round(float(np.median([r[key] for r in rounds if r[key] is not None])), 3)
              for key in rounds[0] if any(r[key] is not None for r in rounds)}
    # A synchronous step waits for the slowest rank's compute: each rank's own.
    plain_per_rank = MPI.COMM_WORLD.allgather(median["plain_ms"])
    forward_per_rank = MPI.COMM_WORLD.allgather(median["forward_ms"])
    probe = link_probe(MPI.COMM_WORLD) if args.probe else None
    # What a broken benchmark would get wrong: the serial and overlapping models took the
    # same steps on the same data from the same start, so their weights must be the same
    # bytes, and the same on every rank.
    serial_weights = np.concatenate([v.numpy().ravel() for v in models[1].trainable_variables])
    overlap_weights = np.concatenate([v.numpy().ravel() for v in models[2].trainable_variables])
    serial_vs_overlap = MPI.COMM_WORLD.allreduce(
        float(np.max(np.abs(serial_weights - overlap_weights))), op=MPI.MAX)
    everyone = MPI.COMM_WORLD.allgather(overlap_weights)
    across_ranks = max(float(np.max(np.abs(w - everyone[0]))) for w in everyone)
    if kdist.rank() == 0:
        reducer = next(iter(models[2].optimizer._reducers.values()))
        print(json.dumps({
            "benchmark": "overlap",
            "model": (f"convnet {args.width}/{2 * args.width} filters, dense {128 * args.depth}"
                      if args.model == "conv" else f"MLP 784-{args.depth}x{args.width}-10")
            + f" ({parameters:,} parameters)",
            "batch_per_rank": args.batch,
            "ranks": kdist.size(),
            "gradient_megabytes": round(4 * parameters / 1e6, 2),
            "buckets": sum(len(plan) for plan in reducer.plans),
            "inter_op_threads": args.inter_op_threads,
            "steps_per_round": args.steps,
            "median": median,
            "plain_ms_per_rank": plain_per_rank,
            "forward_ms_per_rank": forward_per_rank,
            "rounds": rounds,
            "weights_serial_vs_overlap_max_difference": serial_vs_overlap,
            "weights_across_ranks_max_difference": across_ranks,
            **({"probe": probe} if probe else {}),
        }), flush=True)


if __name__ == "__main__":
    main()
