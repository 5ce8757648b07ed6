"""Pipeline parallelism measured: bubble, memory per rank, and speed against one process.

    python benchmarks/pipeline.py [--parts bubble,memory,speed] [--steps 6] [--quick]

- **bubble**: 2 stages of two 2048-wide Dense layers each, micro-batches of
  128 rows, M = 1, 4, 8, 16 micro-batches, both schedules. The first stage
  never computes its input's gradient; its first layer takes 2432 features,
  which on this machine makes the two stages' passes equal within 3 %
  (`pass_seconds` in the output shows them).
  A stage's bubble is the share of the step it is idle: outside its own
  schedule but within the step's span (the longer of the two schedules; both
  start together), or blocked until the other stage's next message arrives
  (`PipelineModel.profile["waiting"]`). Taking a message in once it has
  arrived (copying its megabyte) is communication, reported apart as
  `receiving`. The table gives the mean over the stages, and the busiest
  stage's (the one that sets the pace), against the formula
  (S - 1) / (M + S - 1), which assumes stages of equal work and free
  messages.
- **memory**: 2 stages of eight 256-wide layers, M = 8 micro-batches of 4096
  rows (a micro-batch's activations in one stage: about 8 x 4 MB, against
  2 MB of weights); each rank's peak resident memory during training above
  what it held before the first step, for GPipe and 1F1B, with and without
  recomputation.
- **speed**: a model of eight 2048-wide layers (33.6M parameters, 384 MiB
  with Adam's two slots) against a simulated budget of 256 MiB of weights and
  optimizer state per rank: whole it does not fit, in two stages it does.
  Samples per second of the 2-stage pipeline (M = 8 micro-batches of 128
  rows, one thread per rank) against the whole model in one process with
  both cores, on batches of 1024.

Each configuration is its own job (`kdist run -n 2`, one rank per core).
Prints one JSON object, and markdown tables on stderr.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from kdist.pipeline.schedule import simulate  # noqa: E402
BUDGET_MB = 256


def _status_mb(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak():
    """Hands freed heap back to the system (else training reuses it unseen), then makes
    the kernel's peak resident size (VmHWM) start again from the current size."""
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _layers(count, width):
    import keras

    return [keras.layers.Dense(width, activation="relu") for _ in range(count)]


def _stage_builder(index, layers, width, inputs):
    import keras

    def build():
        keras.utils.set_random_seed(index)
        return keras.Sequential([keras.Input((inputs if index == 0 else width,))]
                                + _layers(layers, width), name=f"stage_{index}")

    return build


class _StepClock:
    """Seconds from the first timed step's start to the last one's end: the steps'
    pace, without fit's own start and the input pipeline's teardown."""

    def __new__(cls):
        import keras

        class Clock(keras.callbacks.Callback):
            start = end = None

            def on_train_batch_begin(self, batch, logs=None):
                if self.start is None:
                    self.start = time.perf_counter()

            def on_train_batch_end(self, batch, logs=None):
                self.end = time.perf_counter()

            @property
            def seconds(self):
                return self.end - self.start

        return Clock()


def child(args):
    import numpy as np

    import tensorflow as tf

    threads = 2 if args.stages == 1 else 1
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import keras

    import kdist
    from kdist.pipeline import PipelineModel

    kdist.init()
    features = args.features or args.width
    builders = [_stage_builder(i, args.layers // args.stages, args.width, features)
                for i in range(args.stages)]
    batch = args.micro_batch * args.micro_batches
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch * (args.steps + 2), features)).astype("float32")
    y = rng.normal(size=(len(x), args.width)).astype("float32")
    if args.stages == 1:
        model = keras.Sequential([keras.Input((features,))] + _layers(args.layers, args.width))
        model.compile(optimizer=args.optimizer, loss="mse")
    else:
        model = PipelineModel(builders, micro_batches=args.micro_batches,
                              schedule=args.schedule, recompute=args.recompute)
        model.compile(optimizer=args.optimizer, loss="mse")
    state_mb = sum(int(np.prod(w.shape)) for w in model.trainable_weights) * 4 / 2**20
    state_mb *= 3 if args.optimizer == "adam" else 1
    # The batches exist (and nothing is freed) before the memory is first read, so the
    # peak above it is the training's own: activations, gradients, messages.
    warm_up = tf.data.Dataset.from_tensor_slices((x[:2 * batch], y[:2 * batch])).batch(batch)
    timed = tf.data.Dataset.from_tensor_slices((x[2 * batch:], y[2 * batch:])).batch(batch)
    _reset_peak()
    before = _status_mb("VmRSS")
    # Two warm-up steps trace the stages; the timed steps follow.
    model.fit(warm_up, epochs=1, verbose=0)
    if args.stages > 1:
        model.reset_profile()
    clock = _StepClock()
    model.fit(timed, epochs=1, verbose=0, callbacks=[clock])
    seconds = clock.seconds
    peak = _status_mb("VmHWM")
    result = {"rank": kdist.rank(), "samples_per_s": args.steps * batch / seconds,
              "seconds": seconds,
              "peak_above_start_mb": peak - before, "weights_and_slots_mb": state_mb}
    if args.stages > 1:
        profile = model.profile
        result.update(scheduled=profile["scheduled"], waiting=profile["waiting"],
                      receiving=profile["receiving"],
                      busy=profile["scheduled"] - profile["waiting"],
                      forward=profile["forward"] / profile["micro_batches"],
                      backward=profile["backward"] / profile["micro_batches"])
        model.close()
    print("RESULT " + json.dumps(result), flush=True)


def run(**config):
    sys.path.insert(0, os.path.dirname(HERE))
    from kdist.cli import mpiexec_command

    command = [sys.executable, "-u", os.path.abspath(__file__), "--child"]
    for key, value in config.items():
        if value is True:
            command.append(f"--{key.replace('_', '-')}")
        elif value is not False:
            command += [f"--{key.replace('_', '-')}", str(value)]
    argv, env = mpiexec_command(max(config["stages"], 1), command)
    env.update({"TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": os.pathsep.join(
        [os.path.dirname(HERE), env.get("PYTHONPATH", "")])})
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=1800)
    results = [json.loads(r) for r in re.findall(r"RESULT (.*)$", done.stdout, re.M)]
    if done.returncode != 0 or len(results) != max(config["stages"], 1):
        raise SystemExit(f"{config} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    results = sorted(results, key=lambda r: r["rank"])
    if "busy" in results[0]:
        # The stages start each step together (they agree on its micro-batches), so
        # the longest schedule is the step's span; a stage is idle for the rest of it.
        span = max(r["scheduled"] for r in results)
        for r in results:
            r["bubble"] = 1 - r["busy"] / span
            r["receiving_share"] = r["receiving"] / span
    return results


def bubble(steps, quick=False):
    rows = []
    width = 128 if quick else 2048
    for schedule in ("gpipe", "1f1b"):
        for micro_batches in (4,) if quick else (1, 4, 8, 16):
            ranks = run(stages=2, layers=4, width=width, features=width * 19 // 16,
                        micro_batch=16 if quick else 128,
                        micro_batches=micro_batches, schedule=schedule, steps=steps,
                        optimizer="sgd")
            measured = sum(r["bubble"] for r in ranks) / len(ranks)
            busiest = min(r["bubble"] for r in ranks)
            formula = 1 / (micro_batches + 1)
            # The same schedule on an ideal clock with each stage's measured pass times:
            # what is left between it and the measurement is the messages' cost.
            _, ideal = simulate(schedule, 2, micro_batches, [r["forward"] for r in ranks],
                                [r["backward"] for r in ranks])
            rows.append({"schedule": schedule, "M": micro_batches, "formula": formula,
                         "measured": measured, "ratio": measured / formula,
                         "with_measured_times": ideal, "ratio_to_measured_times": measured / ideal,
                         "pass_seconds": [[r["forward"], r["backward"]] for r in ranks],
                         "receiving_share": [r["receiving_share"] for r in ranks],
                         "busiest_stage": busiest, "busiest_ratio": busiest / formula,
                         "per_stage": [r["bubble"] for r in ranks],
                         "samples_per_s": ranks[0]["samples_per_s"]})
    return rows


def memory(steps, quick=False):
    rows = []
    for schedule in ("gpipe",) if quick else ("gpipe", "1f1b"):
        for recompute in (False, True):
            ranks = run(stages=2, layers=16, width=256, micro_batch=256 if quick else 4096,
                        micro_batches=8, schedule=schedule, recompute=recompute, steps=steps,
                        optimizer="sgd")
            rows.append({"schedule": schedule, "recompute": recompute,
                         "peak_above_start_mb": [r["peak_above_start_mb"] for r in ranks],
                         "samples_per_s": ranks[0]["samples_per_s"]})
    return rows


def speed(steps):
    common = dict(layers=8, width=2048, micro_batch=128, micro_batches=8, steps=steps,
                  optimizer="adam")
    whole = run(stages=1, **common)[0]
    piped = run(stages=2, schedule="1f1b", **common)
    return {"budget_mb": BUDGET_MB,
            "whole": {"weights_and_slots_mb": whole["weights_and_slots_mb"],
                      "fits_budget": whole["weights_and_slots_mb"] <= BUDGET_MB,
                      "samples_per_s": whole["samples_per_s"]},
            "two_stages": {"weights_and_slots_mb": [r["weights_and_slots_mb"] for r in piped],
                           "fits_budget": all(r["weights_and_slots_mb"] <= BUDGET_MB
                                              for r in piped),
                           "samples_per_s": piped[0]["samples_per_s"],
                           "bubble": [r["bubble"] for r in piped],
                           "scheduled_share": [r["scheduled"] / r["seconds"] for r in piped],
                           "pass_seconds": [[r["forward"], r["backward"]] for r in piped]},
            "speed_ratio": piped[0]["samples_per_s"] / whole["samples_per_s"]}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--child", action="store_true")
    parser.add_argument("--parts", default="bubble,memory,speed")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--quick", action="store_true",
                        help="small layers and fewer cases: checks that the script runs")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--features", type=int, default=0, help="inputs (default: width)")
    parser.add_argument("--micro-batch", type=int, default=64)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--recompute", action="store_true")
    parser.add_argument("--optimizer", default="sgd")
    args = parser.parse_args()
    if args.child:
        return child(args)
    parts = args.parts.split(",")
    out = {}
    if "bubble" in parts:
        out["bubble"] = bubble(args.steps, args.quick)
        print("| schedule | M | formula | measured (mean of stages) | / formula | busiest "
              "stage | / formula | ideal clock, measured pass times | measured / that |\n"
              "|---|---|---|---|---|---|---|---|---|", file=sys.stderr)
        for r in out["bubble"]:
            print(f"| {r['schedule']} | {r['M']} | {r['formula']:.3f} | {r['measured']:.3f} | "
                  f"{r['ratio']:.2f} | {r['busiest_stage']:.3f} | {r['busiest_ratio']:.2f} | "
                  f"{r['with_measured_times']:.3f} | {r['ratio_to_measured_times']:.2f} |",
                  file=sys.stderr)
    if "memory" in parts:
        out["memory"] = memory(args.steps, args.quick)
        print("\n| schedule | recompute | peak above start, stage 0 / 1 (MB) | samples/s |\n"
              "|---|---|---|---|", file=sys.stderr)
        for r in out["memory"]:
            peaks = " / ".join(f"{p:.0f}" for p in r["peak_above_start_mb"])
            print(f"| {r['schedule']} | {r['recompute']} | {peaks} | {r['samples_per_s']:.0f} |",
                  file=sys.stderr)
    if "speed" in parts:
        out["speed"] = s = speed(args.steps)
        print(f"\nspeed: whole {s['whole']['samples_per_s']:.0f} samples/s "
              f"({s['whole']['weights_and_slots_mb']:.0f} MB), 2 stages "
              f"{s['two_stages']['samples_per_s']:.0f} samples/s, ratio "
              f"{s['speed_ratio']:.2f}", file=sys.stderr)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
