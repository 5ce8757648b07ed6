"""Images per second of a Keras application on random images: 1 rank, N ranks, N processes alone.

    python benchmarks/synthetic.py [--model MobileNetV2] [--batch-size 16] [--image-size 64]
        [--ranks 2] [--warmup-batches 3] [--batches-per-iter 5] [--iters 5]
        [--fp16-allreduce] [--rounds 2] [--links 10,2]

The benchmark Horovod ships as its synthetic TensorFlow 2 benchmark, written for kdist
with the same choices: any model of `keras.applications` built without weights
(`--model`), a batch of random images of `--image-size` pixels and random labels per
rank, plain SGD, a `tf.function` step with `kdist.DistributedGradientTape` (fp16 on the
wire with `--fp16-allreduce`) and the model's and optimizer's variables broadcast from
rank 0 after the first step. After the warm-up, every iteration of `--batches-per-iter`
steps is timed; a rank's images per second are the batch times steps over the time.

Cases, each launched afresh every round, in turns:
- `one_rank`: one process, all the machine's cores (what `python script.py` gets);
- `ranks`: N ranks under mpiexec, each given its share of the cores by `kdist.init()`;
- `alone`: N processes computing at once with no communication, each pinned to its share
  of the cores: the floor N ranks on these cores can reach, since the cores are shared;
- `ranks_over_<R>gbit` (with `--links`, root only): N ranks on two emulated hosts
  (network namespaces, tests/emulated_hosts.py) whose link is limited to R Gbit/s by
  tc's token bucket filter (network.py's link: a burst of 1 ms at the rate).

Every process inherits this one's environment: set `TF_ENABLE_ONEDNN_OPTS=1` for the
oneDNN kernels that `kdist run` turns on where TensorFlow leaves them off (the JSON
records the setting). Prints one JSON object: per case the median over rounds of the
total images per second (and the mean and 1.96 standard deviations over iterations per
rank, as Horovod's script prints), and `ranks_over_alone`, the N ranks' total over the
floor's.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))


def worker(args):
    import numpy as np

    if args.pin_by_rank:
        # Emulated hosts share this machine's cores: one core per rank, as on real hosts.
        cores = sorted(os.sched_getaffinity(0))
        args.cpus = str(cores[int(os.environ["OMPI_COMM_WORLD_RANK"]) % len(cores)])
    if args.cpus:
        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
    import tensorflow as tf

    if args.cpus:
        threads = len(args.cpus.split(","))
        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(min(2, threads))
    import keras

    import kdist

    alone = args.alone
    if not alone:
        kdist.init()
    rank, size = (0, 1) if alone else (kdist.rank(), kdist.size())
    build = getattr(keras.applications, args.model)
    model = build(weights=None, input_shape=(args.image_size, args.image_size, 3),
                  classes=args.classes)
    optimizer = keras.optimizers.SGD(0.01)
    loss_function = keras.losses.SparseCategoricalCrossentropy()
    generator = tf.random.Generator.from_seed(rank)
    images = generator.uniform([args.batch_size, args.image_size, args.image_size, 3])
    labels = generator.uniform([args.batch_size, 1], maxval=args.classes, dtype=tf.int64)
    compression = kdist.Compression.fp16 if args.fp16_allreduce else kdist.Compression.none

    @tf.function
    def step(first):
        with tf.GradientTape() as tape:
            loss = loss_function(labels, model(images, training=True))
        if not alone:
            tape = kdist.DistributedGradientTape(tape, compression=compression)
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        if first and not alone:
            # After the first step, so that the optimizer's slots exist.
            kdist.broadcast_variables(model.variables, root_rank=0)
            kdist.broadcast_variables(optimizer.variables, root_rank=0)
        return loss

    step(True)
    for _ in range(args.warmup_batches):
        step(False)
    rates = []
    for _ in range(args.iters):
        started = time.perf_counter()
        for _ in range(args.batches_per_iter):
            loss = step(False)
        loss.numpy()
        rates.append(args.batch_size * args.batches_per_iter / (time.perf_counter() - started))
    # Equal on every rank when the gradients were averaged and the start broadcast.
    checksum = float(sum(np.sum(v.numpy(), dtype=np.float64) for v in model.trainable_variables))
    result = {"rank": rank, "ranks": size, "images_per_second": statistics.mean(rates),
              "spread": 1.96 * float(np.std(rates)), "weights_checksum": checksum}
    print("RESULT " + json.dumps(result), flush=True)


def worker_arguments(args):
    return ["--model", args.model, "--batch-size", str(args.batch_size),
            "--image-size", str(args.image_size), "--classes", str(args.classes),
            "--warmup-batches", str(args.warmup_batches),
            "--batches-per-iter", str(args.batches_per_iter), "--iters", str(args.iters)] + (
        ["--fp16-allreduce"] if args.fp16_allreduce else [])


def results_of(output):
    return [json.loads(line[len("RESULT "):]) for line in output.splitlines()
            if line.startswith("RESULT ")]


def without_mpi(environ):
    return {k: v for k, v in environ.items() if not k.startswith(("OMPI_", "PMIX_", "PMI_"))}


def core_shares(ranks):
    """Each of `ranks` processes' cores, as a comma-separated list."""
    cores = sorted(os.sched_getaffinity(0))
    if ranks >= len(cores):
        return [str(cores[i % len(cores)]) for i in range(ranks)]
    share = len(cores) // ranks
    return [",".join(str(c) for c in cores[i * share:(i + 1) * share]) for i in range(ranks)]


def run_case(case, args, timeout=1800):
    """The RESULT lines of every process of one case."""
    from kdist.cli import mpiexec_command

    command = [sys.executable, "-u", os.path.abspath(__file__), "--worker"]
    command += worker_arguments(args)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    if case == "one_rank":
        done = subprocess.run(command + ["--alone"], env=without_mpi(env), text=True,
                              capture_output=True, timeout=timeout)
        outputs, codes = [done.stdout + done.stderr], [done.returncode]
    elif case == "alone":
        processes = [subprocess.Popen(command + ["--alone", "--cpus", cpus],
                                      env=without_mpi(env), text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
                     for cpus in core_shares(args.ranks)]
        outputs = [p.communicate(timeout=timeout)[0] for p in processes]
        codes = [p.returncode for p in processes]
    elif case == "ranks":
        argv, mpi_env = mpiexec_command(args.ranks, command)
        env.update(mpi_env)
        done = subprocess.run(argv, env=env, text=True, capture_output=True, timeout=timeout)
        outputs, codes = [done.stdout + done.stderr], [done.returncode]
    else:
        return over_link(case, command, args, timeout)
    results = [r for output in outputs for r in results_of(output)]
    if any(codes) or not results:
        raise RuntimeError(f"case {case} failed:\n{''.join(outputs)[-3000:]}")
    return results


def over_link(case, command, args, timeout):
    import emulated_hosts

    gbit = float(case[len("ranks_over_"):-len("gbit")])
    with emulated_hosts.EmulatedHosts(2) as hosts:
        for index in range(2):
            hosts.limit_link(index, gbit)
        forward = [name for name in ("TF_ENABLE_ONEDNN_OPTS",) if name in os.environ]
        # The worker pins itself (--pin-by-rank): a rank may own several cores.
        done = hosts.run_job(max(1, args.ranks // 2), command + ["--pin-by-rank"],
                             forward=forward, env={"TF_CPP_MIN_LOG_LEVEL": "3"}, pin=False,
                             timeout=timeout)
    results = results_of(done.stdout)
    if done.returncode or not results:
        raise RuntimeError(f"case {case} failed:\n{(done.stdout + done.stderr)[-3000:]}")
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="MobileNetV2",
                        help="a model of keras.applications (default MobileNetV2)")
    parser.add_argument("--batch-size", type=int, default=16, help="images per rank and step")
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--classes", type=int, default=1000)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--warmup-batches", type=int, default=3)
    parser.add_argument("--batches-per-iter", type=int, default=5)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--fp16-allreduce", action="store_true")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--links", default="",
                        help="comma-separated link rates in Gbit/s for two emulated hosts")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--alone", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cpus", help=argparse.SUPPRESS)
    parser.add_argument("--pin-by-rank", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    import keras

    if not callable(getattr(keras.applications, args.model, None)):
        parser.error(f"keras.applications has no model {args.model!r}")
    for name in ("batch_size", "image_size", "classes", "ranks", "batches_per_iter",
                 "iters", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    try:
        links = [float(rate) for rate in args.links.split(",") if rate]
    except ValueError:
        parser.error(f"--links takes numbers; got {args.links!r}")
    if links:
        import emulated_hosts

        why = emulated_hosts.available()
        if why:
            parser.error(f"--links: {why}")
        if args.ranks % 2:
            parser.error("--links places the ranks on two hosts: --ranks must be even")
    cases = ["one_rank", "ranks", "alone"] + [f"ranks_over_{rate:g}gbit" for rate in links]
    rounds = {case: [] for case in cases}
    for _ in range(args.rounds):
        for case in cases:
            results = run_case(case, args)
            rounds[case].append({"total": round(sum(r["images_per_second"]
                                                    for r in results), 1),
                                 "per_rank": [[round(r["images_per_second"], 1),
                                               round(r["spread"], 1)] for r in results]})
    summary = {case: {"images_per_second": round(statistics.median(
        r["total"] for r in runs), 1), "rounds": runs} for case, runs in rounds.items()}
    floor = summary["alone"]["images_per_second"]
    ratios = {case: round(summary[case]["images_per_second"] / floor, 3)
              for case in cases if case.startswith("ranks")}
    print(json.dumps({"benchmark": "synthetic", "model": args.model,
                      "batch_size": args.batch_size, "image_size": args.image_size,
                      "ranks": args.ranks, "fp16_allreduce": args.fp16_allreduce,
                      "TF_ENABLE_ONEDNN_OPTS": os.environ.get("TF_ENABLE_ONEDNN_OPTS"),
                      "cases": summary, "ranks_over_alone": ratios}, indent=1))


if __name__ == "__main__":
    main()
