"""A strided 3D convolution against the same convolution at stride 1 plus subsampling.

    python benchmarks/strided_conv.py [--batch 32] [--repeats 3]

The small calorimeter discriminator's first two layers are 3D convolutions
with stride 2 and "same" padding on odd sizes (25 and 13 cells). Such a
convolution equals a stride-1 convolution followed by keeping every other
cell (`model.EveryOther`), which the example now uses. For each layer this
times a forward and backward pass (gradients for the kernel and the input,
as a GAN's generator step needs) both ways, on one thread, checks that the
outputs agree, and prints one JSON object with `speedup`: strided time over
subsampled time, measured in the same run.
"""

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(os.path.dirname(HERE), "examples", "gan_calorimeter")
LAYERS = [  # (name, cells, input channels, kernel): the small discriminator's convolutions
    ("first", 25, 1, 5),
    ("second", 13, 8, 3),
]


def timed(step, repeats):
    step()  # traces
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - start)
    return best


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    if args.batch < 1 or args.repeats < 1:
        parser.error("--batch and --repeats must be at least 1")
    sys.path.insert(0, HERE)
    sys.path.insert(0, EXAMPLE)
    from _mlp import one_thread

    one_thread()
    import keras
    import numpy as np
    import tensorflow as tf

    import model

    results = {"batch": args.batch, "layers": {}}
    for name, cells, channels, kernel in LAYERS:
        inputs = tf.random.stateless_uniform((args.batch, cells, cells, cells, channels), (0, 1))
        strided = keras.layers.Conv3D(8, kernel, strides=2, padding="same")
        plain = keras.layers.Conv3D(8, kernel, padding="same")
        strided.build(inputs.shape)
        plain.build(inputs.shape)
        plain.set_weights(strided.get_weights())
        every_other = model.EveryOther()
        ways = {"strided": strided, "subsampled": lambda x: every_other(plain(x))}
        outputs = {way: np.asarray(layer(inputs)) for way, layer in ways.items()}
        difference = float(np.abs(outputs["strided"] - outputs["subsampled"]).max())

        def step_of(layer, variables):
            @tf.function
            def step():
                with tf.GradientTape() as tape:
                    tape.watch(inputs)
                    loss = tf.reduce_sum(tf.square(layer(inputs)))
                return tape.gradient(loss, [inputs] + variables)
            return step

        seconds = {"strided": timed(step_of(strided, strided.trainable_variables), args.repeats),
                   "subsampled": timed(step_of(ways["subsampled"], plain.trainable_variables),
                                       args.repeats)}
        results["layers"][name] = {
            "cells": cells, "channels_in": channels, "kernel": kernel,
            "strided_s": seconds["strided"], "subsampled_s": seconds["subsampled"],
            "speedup": seconds["strided"] / seconds["subsampled"],
            "max_output_difference": difference}
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
