"""TensorFlow's CPU kernels with oneDNN's optimisations off and on, in one run.

    python benchmarks/onednn.py [--settings off,on,avx2] [--models dense,conv2d,gan]
                                [--steps 20] [--gan-steps 4]

Each setting runs every model in a fresh process (TensorFlow reads the switch
once, when it starts), one intra-op and one inter-op thread, after warm-up steps:

- `off`: `TF_ENABLE_ONEDNN_OPTS=0`, TensorFlow's own kernels, what its wheels
  run on x86 CPUs without AVX512_VNNI, AVX512_BF16, AVX_VNNI or AMX;
- `on`: `TF_ENABLE_ONEDNN_OPTS=1`, oneDNN's kernels with every feature of this
  CPU;
- `avx2`: `on` with oneDNN held to AVX2 (`ONEDNN_MAX_CPU_ISA=AVX2`), what an
  AVX2-only CPU (AMD EPYC Rome and Milan, Intel Haswell and Broadwell) gets
  when `kdist run` turns oneDNN on there.

Models: `dense` (an MLP, steps per second), `conv2d` (a small CNN on 32x32x3,
steps per second) and `gan` (the small 3DGAN of examples/gan_calorimeter through
benchmarks/gan_throughput.py on one rank, showers per second). Each process also
reports whether TensorFlow ran oneDNN's kernels, so a setting that did not take
shows. Prints one JSON object: the rates per model and setting, and each
setting's rate over `off` in the same run.
"""

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SETTINGS = {"off": {"TF_ENABLE_ONEDNN_OPTS": "0"},
            "on": {"TF_ENABLE_ONEDNN_OPTS": "1"},
            "avx2": {"TF_ENABLE_ONEDNN_OPTS": "1", "ONEDNN_MAX_CPU_ISA": "AVX2"}}
MODELS = ("dense", "conv2d", "gan")
WARMUP = 3


def _keras_model(kind):
    import keras

    if kind == "dense":
        return keras.Sequential([keras.Input((784,)), keras.layers.Dense(512, activation="relu"),
                                 keras.layers.Dense(512, activation="relu"),
                                 keras.layers.Dense(10)]), (784,)
    return keras.Sequential([
        keras.Input((32, 32, 3)), keras.layers.Conv2D(32, 3, activation="relu"),
        keras.layers.Conv2D(32, 3, activation="relu"), keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(64, 3, activation="relu"), keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(10)]), (32, 32, 3)


def worker(args):
    sys.path.insert(0, HERE)
    from _mlp import one_thread

    one_thread()
    import numpy as np

    from kdist.comm import onednn

    model, shape = _keras_model(args.model)
    model.compile(optimizer="sgd",
                  loss=__import__("keras").losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64,) + shape).astype("float32")
    y = rng.integers(0, 10, size=64)
    for _ in range(WARMUP):
        model.train_on_batch(x, y)
    started = time.perf_counter()
    for _ in range(args.steps):
        model.train_on_batch(x, y)
    seconds = time.perf_counter() - started
    print(json.dumps({"rate": args.steps / seconds, "unit": "steps/s",
                      "onednn": onednn.enabled()}))


def _gan(environ, steps):
    done = subprocess.run(
        [sys.executable, os.path.join(HERE, "gan_throughput.py"), "--models", "small",
         "--ranks", "1", "--steps", str(steps), "--ps-modes", ""],
        env=environ, capture_output=True, text=True, timeout=1800)
    if done.returncode:
        raise RuntimeError(f"gan_throughput.py failed:\n{done.stderr[-3000:]}")
    text = done.stdout
    result = json.loads(text[text.index("{") if text.startswith("{") else text.index("\n{"):])
    rate = result["models"]["small"]["showers_per_s"]["1"]
    return {"rate": rate, "unit": "showers/s", "onednn": None}


def _measure(model, setting, args):
    environ = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", **SETTINGS[setting])
    if setting != "avx2":
        environ.pop("ONEDNN_MAX_CPU_ISA", None)
    if model == "gan":
        return _gan(environ, args.gan_steps)
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", "--model",
                           model, "--steps", str(args.steps)],
                          env=environ, capture_output=True, text=True, timeout=1800)
    if done.returncode:
        raise RuntimeError(f"{model} under {setting} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--settings", default="off,on,avx2")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--gan-steps", type=int, default=4)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", choices=MODELS[:2], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    settings = [s for s in args.settings.split(",") if s]
    models = [m for m in args.models.split(",") if m]
    for name, known in ((settings, SETTINGS), (models, MODELS)):
        unknown = [each for each in name if each not in known]
        if unknown:
            parser.error(f"unknown {unknown}; choose from {sorted(known)}")
    sys.path.insert(0, os.path.dirname(HERE))
    from kdist.comm import onednn

    verdict = onednn.decide(onednn.cpu_flags())
    result = {"cpu": verdict["why"], "tensorflow_default_on": verdict["default"],
              "models": {}}
    for model in models:
        rates = {setting: _measure(model, setting, args) for setting in settings}
        row = {"unit": next(iter(rates.values()))["unit"],
               "rate": {s: round(r["rate"], 3) for s, r in rates.items()},
               "onednn": {s: r["onednn"] for s, r in rates.items()}}
        if "off" in rates:
            row["over_off"] = {s: round(r["rate"] / rates["off"]["rate"], 2)
                               for s, r in rates.items() if s != "off"}
        result["models"][model] = row
    print(json.dumps(result))


if __name__ == "__main__":
    main()
