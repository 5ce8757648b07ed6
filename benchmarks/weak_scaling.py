"""Weak scaling of `model.fit` with kdist's DistributedOptimizer and strategies.

    python benchmarks/weak_scaling.py [--ranks 2] [--rounds 3] [--steps 400] [--modes ...]

The 784-512-512-10 MLP (670k parameters), batch 64 per rank, one thread per
rank, synthetic data. In one run, alternating so that machine noise hits all
alike, it times:
- `single`: one process, plain Keras optimizer;
- `side_by_side`: N independent processes with no communication (the floor:
  what sharing the machine costs before any allreduce);
- `kdist`: N ranks with `kdist.DistributedOptimizer` (its C++ allreduce op);
- `kdist_py_function`: the same with `KDIST_NATIVE_OPS=0` (MPI called from a
  py-function op, the path used when the C++ op cannot be built);
- `mpi_strategy`: a tf.distribute-style script (global batches, plain `fit`)
  with `kdist.distribute.MPIStrategy` under mpiexec;
- `tf_multi_worker`: the same script with kdist's `MultiWorkerMirroredStrategy`
  (TensorFlow's gRPC collectives), workers started by `kdist launch`;
- `tf_keras_multi_worker`: the same MLP in tf_keras (Keras 2) with TensorFlow's
  stock multi-worker strategy, when tf_keras is installed;
- `single_xla`, `kdist_xla`: `single` and `kdist` with the train step compiled
  by XLA (`jit_compile=True`; kdist's allreduce runs as an XLA custom call).
Every process is bound to one core (mpiexec binds its ranks the same way).
Efficiency = single ms/step / mode's ms/step (1.0 is perfect weak scaling).
Every round launches each mode afresh, so `--rounds 10` gives the spread over 10
launches (`slowest_over_fastest`).
Prints one JSON object.
"""

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def _mpi_strategy():
    import kdist

    return kdist.distribute.MPIStrategy()


def _tf_multi_worker():
    import kdist

    return kdist.distribute.MultiWorkerMirroredStrategy()


STRATEGY_MODES = {"mpi_strategy": _mpi_strategy, "tf_multi_worker": _tf_multi_worker}
ALL_MODES = ("single", "side_by_side", "kdist", "kdist_py_function", "mpi_strategy",
             "tf_multi_worker", "tf_keras_multi_worker", "single_xla", "kdist_xla")


def worker(args):
    from _mlp import build_mlp, one_thread, synthetic_mnist_like

    if args.cpu is None and "TF_CONFIG" in os.environ:
        # A TF worker started by `kdist launch`: one core each, as mpiexec binds ranks.
        args.cpu = json.loads(os.environ["TF_CONFIG"])["task"]["index"] % (os.cpu_count() or 1)
    if args.cpu is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {args.cpu})
    if args.mode == "tf_keras_multi_worker":
        return tf_keras_worker(args)
    one_thread()
    import keras

    import kdist

    kdist.init()
    jit = args.mode.endswith("_xla")
    if args.mode in STRATEGY_MODES:
        # Written the tf.distribute way: global batches, the strategy splits them.
        import tensorflow as tf

        strategy = STRATEGY_MODES[args.mode]()
        replicas = strategy.num_replicas_in_sync
        x, y = synthetic_mnist_like(64 * replicas * args.steps, seed=0)
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = \
            tf.data.experimental.AutoShardPolicy.DATA
        data = tf.data.Dataset.from_tensor_slices((x, y)).batch(64 * replicas)
        data = data.with_options(options).prefetch(2)
        with strategy.scope():
            model = build_mlp()
            model.compile(optimizer=keras.optimizers.Adam(1e-3),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    else:
        model = build_mlp()
        x, y = synthetic_mnist_like(64 * args.steps, seed=kdist.rank())
        data = None
        optimizer = keras.optimizers.Adam(1e-3)
        if args.mode.startswith("kdist"):
            optimizer = kdist.DistributedOptimizer(optimizer)
        model.compile(optimizer=optimizer, jit_compile=jit,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    class StepTimes(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.times = []

        def on_train_batch_end(self, batch, logs=None):
            self.times.append(time.perf_counter())

    timer = StepTimes()
    if data is None:
        model.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0, callbacks=[timer])
    else:
        model.fit(data, epochs=1, shuffle=False, verbose=0, callbacks=[timer])
    steps = np.diff(timer.times)[50:]
    ms = float(np.median(steps)) * 1e3
    # What a broken benchmark would get wrong: data-parallel ranks end with the same
    # weights (independent processes and one process have nothing to agree on).
    difference = None
    if kdist.size() > 1:
        flat = np.concatenate([np.ravel(w) for w in model.get_weights()])
        everyone = kdist.allgather_object(flat)
        difference = max(float(np.max(np.abs(w - everyone[0]))) for w in everyone)
    if kdist.rank() == 0:
        print("RESULT " + json.dumps({"ms_per_step": ms,
                                      "weights_across_ranks_max_difference": difference}))


def tf_keras_worker(args):
    """The same MLP in tf_keras (Keras 2) with TensorFlow's stock multi-worker strategy."""
    from _mlp import synthetic_mnist_like

    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import tf_keras

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    replicas = strategy.num_replicas_in_sync
    x, y = synthetic_mnist_like(64 * replicas * args.steps, seed=0)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(64 * replicas)
    data = data.with_options(options).prefetch(2)
    with strategy.scope():
        tf_keras.utils.set_random_seed(0)
        model = tf_keras.Sequential([
            tf_keras.Input((784,)),
            tf_keras.layers.Dense(512, activation="relu"),
            tf_keras.layers.Dense(512, activation="relu"),
            tf_keras.layers.Dense(10),
        ])
        model.compile(optimizer=tf_keras.optimizers.Adam(1e-3),
                      loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    class StepTimes(tf_keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.times = []

        def on_train_batch_end(self, batch, logs=None):
            self.times.append(time.perf_counter())

    timer = StepTimes()
    model.fit(data, epochs=1, verbose=0, callbacks=[timer])
    ms = float(np.median(np.diff(timer.times)[50:])) * 1e3
    if json.loads(os.environ["TF_CONFIG"])["task"]["index"] == 0:
        print("RESULT " + json.dumps({"ms_per_step": ms}))


TF_LAUNCHED = ("tf_multi_worker", "tf_keras_multi_worker")


def launch(mode, ranks, steps):
    from kdist.cli import mpiexec_command

    command = [sys.executable, "-u", os.path.abspath(__file__), "--worker", "--mode", mode,
               "--steps", str(steps)]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    if mode in TF_LAUNCHED:
        import io

        from kdist.distribute.launch import launch_tf

        out = io.BytesIO()
        env = {k: v for k, v in env.items() if not k.startswith(("OMPI_", "PMIX_", "PMI_"))}
        if launch_tf(ranks, command, env=env, out=out) != 0:
            raise RuntimeError(f"{mode} failed:\n{out.getvalue().decode()[-3000:]}")
        line = next(line for line in out.getvalue().decode().splitlines()
                    if line.startswith("[0] RESULT "))
        return json.loads(line[len("[0] RESULT "):])
    if mode == "kdist_py_function":
        env["KDIST_NATIVE_OPS"] = "0"
    if ranks == 1 or mode == "side_by_side":
        env = {k: v for k, v in env.items() if not k.startswith(("OMPI_", "PMIX_", "PMI_"))}
        argv = command + (["--cpu", "0"] if ranks == 1 else [])
    else:
        argv, mpi_env = mpiexec_command(ranks, command)
        argv[1:1] = [a for name in ("KDIST_NATIVE_OPS", "OMPI_MCA_mpi_yield_when_idle")
                     if name in env for a in ("-x", name)]
        env.update({k: v for k, v in mpi_env.items() if k.startswith("OMPI_ALLOW")})
    if mode == "side_by_side":
        # Independent processes, each its own world of one (no MPI at all), each on its
        # own core as mpiexec places ranks.
        procs = [subprocess.Popen(command + ["--cpu", str(i % (os.cpu_count() or 1))],
                                  env=env, stdout=subprocess.PIPE, text=True)
                 for i in range(ranks)]
        outputs = [p.communicate()[0] for p in procs]
        out = outputs[0]
    else:
        out = subprocess.run(argv, env=env, stdout=subprocess.PIPE, text=True,
                             check=True).stdout
    line = next(line for line in out.splitlines() if line.startswith("RESULT "))
    return json.loads(line[7:])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--modes", default=",".join(ALL_MODES),
                        help="comma-separated subset of: " + ", ".join(ALL_MODES))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="single", help=argparse.SUPPRESS)
    parser.add_argument("--cpu", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - set(ALL_MODES))
    if unknown:
        parser.error(f"unknown modes {unknown}; choose from {ALL_MODES}")
    if args.steps <= 50:
        parser.error("--steps must be more than 50: the first 50 steps are warm-up and "
                     "are not timed")
    if "single" not in modes:
        modes.insert(0, "single")  # the baseline every efficiency is measured against
    if "tf_keras_multi_worker" in modes and importlib.util.find_spec("tf_keras") is None:
        print("tf_keras is not installed: skipping tf_keras_multi_worker", file=sys.stderr)
        modes.remove("tf_keras_multi_worker")
    samples = {mode: [] for mode in modes}
    agreement = {mode: None for mode in modes}
    for _ in range(args.rounds):
        for mode in modes:
            result = launch(mode, 1 if mode.startswith("single") else args.ranks, args.steps)
            samples[mode].append(result["ms_per_step"])
            difference = result.get("weights_across_ranks_max_difference")
            if difference is not None:
                agreement[mode] = max(difference, agreement[mode] or 0.0)
    ms = {k: float(np.median(v)) for k, v in samples.items()}
    efficiency = {k: round(ms["single"] / v, 3) for k, v in ms.items()
                  if k not in ("single", "single_xla", "kdist_xla")}
    if "kdist_xla" in ms and "single_xla" in ms:
        efficiency["kdist_xla"] = round(ms["single_xla"] / ms["kdist_xla"], 3)
    print(json.dumps({
        "benchmark": "weak_scaling",
        "model": "MLP 784-512-512-10 (669,706 parameters), Adam",
        "ranks": args.ranks,
        "batch_per_rank": 64,
        "threads_per_rank": 1,
        "each_process_bound_to_one_core": True,
        "ms_per_step": {k: round(v, 3) for k, v in ms.items()},
        "samples_ms": {k: [round(x, 3) for x in v] for k, v in samples.items()},
        # Launch to launch: the slowest round's median step over the fastest's.
        "slowest_over_fastest": {k: round(max(v) / min(v), 3) for k, v in samples.items()},
        "efficiency": efficiency,
        "weights_across_ranks_max_difference": agreement,
        "targets": {"kdist": 0.90, "mpi_strategy": 0.90, "tf_multi_worker": 0.50},
    }, indent=2))


if __name__ == "__main__":
    main()
