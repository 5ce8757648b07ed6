"""Steps to a target loss against the batch size, and where the gradient noise scale puts the knee.

    python benchmarks/noise_scale.py [--batches 4,8,...,2048] [--target 0.15]

McCandlish et al. (2018) predict that training to a given loss takes
`S = S_min (1 + B_crit / B)` steps at batch `B`, with the best learning rate
for each batch: well below `B_crit` doubling the batch halves the steps, well
above it the steps stop falling. They also predict `B_crit` to be close to
the simple noise scale `B_simple = tr(Sigma) / |G|^2`, which
`kdist.callbacks.GradientNoiseScale` measures during data-parallel training.

This script trains a small MLP (the generated task of `ps_convergence.py`)
with plain SGD at each batch size and a grid of learning rates, counts the
steps to the target training loss (the best rate for each batch), fits the
curve above, and measures `B_simple` at the weights where each run first
reached the target, with `kdist.callbacks.estimate_noise_scale` on gradients at two
batch sizes (what the callback does with each rank's batch and the global
one). One process; prints one JSON object and the table on stderr.
"""

import argparse
import json
import math
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
from ps_convergence import task  # noqa: E402

RATES = [0.0125 * 2 ** k for k in range(14)]  # 0.0125 .. 102.4


def build():
    import keras

    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((20,)), keras.layers.Dense(64, activation="relu"),
                             keras.layers.Dense(4)])


def steps_to_target(x, y, batch, rate, target, max_steps, check_every):
    """Steps of SGD at `batch` and `rate` until the full training loss is below `target`
    (None if it never is), and the weights then."""
    import keras
    import tensorflow as tf

    model = build()
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    optimizer = keras.optimizers.SGD(rate)
    optimizer.build(model.trainable_variables)

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)

    @tf.function
    def full_loss():
        return loss_fn(y, model(x, training=False))

    rng = np.random.default_rng(batch)
    for done in range(1, max_steps + 1):
        rows = rng.integers(0, len(x), batch)
        step(tf.gather(x, rows), tf.gather(y, rows))
        if done % check_every(done) == 0:
            loss = float(full_loss())
            if not math.isfinite(loss) or loss > 10:
                return None, None
            if loss < target:
                return done, model
    return None, None


def noise_scale_at(model, x, y, small, big, repeats=200, seed=0):
    """B_simple at the model's weights from mean |G_b|^2 at two batch sizes."""
    import keras
    import tensorflow as tf

    from kdist.callbacks import estimate_noise_scale

    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def norm_sq(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=False))
        grads = tape.gradient(loss, model.trainable_variables)
        return tf.add_n([tf.reduce_sum(g * g) for g in grads])

    rng = np.random.default_rng(seed)
    means = []
    for size in (small, big):
        values = []
        for _ in range(repeats):
            rows = rng.choice(len(x), size, replace=False)
            values.append(float(norm_sq(tf.gather(x, rows), tf.gather(y, rows))))
        means.append(float(np.mean(values)))
    return estimate_noise_scale(means[0], means[1], small, big)[0]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="4,8,16,32,64,128,256,512,1024,2048")
    parser.add_argument("--target", type=float, default=0.15)
    parser.add_argument("--max-steps", type=int, default=20000)
    args = parser.parse_args()
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(2)
    (x, y), _ = task()
    x, y = tf.constant(x), tf.constant(y)
    # Check the loss often while steps are few, so that short runs are counted finely.
    check_every = lambda done: 1 if done < 50 else 5 if done < 500 else 25  # noqa: E731
    rows, at_target = [], {}
    lowest = RATES[0]
    for batch in (int(b) for b in args.batches.split(",")):
        tried = {}
        # The best rate grows with the batch: start the scan just below the last one's.
        for rate in [r for r in RATES if r >= lowest]:
            steps, model = steps_to_target(x, y, batch, rate, args.target, args.max_steps,
                                           check_every)
            tried[rate] = steps
            if steps is not None and (batch not in at_target or steps < at_target[batch][0]):
                at_target[batch] = (steps, model, rate)
            elif batch in at_target and at_target[batch][2] < rate / 2:
                break  # two rates past the best: larger ones only get worse
        best = at_target.get(batch)
        if best:
            lowest = best[2] / 2
        rows.append({"batch": batch, "steps": best[0] if best else None,
                     "rate": best[2] if best else None, "examples": best[0] * batch if best
                     else None, "steps_per_rate": {str(r): s for r, s in tried.items()}})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    reached = [r for r in rows if r["steps"]]
    from scipy.optimize import curve_fit

    # log S = log S_min + log(1 + B_crit / B), fitted in logs so that every batch counts
    # alike (the small batches' thousands of steps would otherwise decide alone).
    batches = np.array([r["batch"] for r in reached], float)
    (log_s_min, log_b_crit), _ = curve_fit(
        lambda b, log_s, log_c: log_s + np.log1p(np.exp(log_c) / b), batches,
        np.log([r["steps"] for r in reached]), p0=[0.0, np.log(np.median(batches))])
    fitted = {"s_min": float(np.exp(log_s_min)), "b_crit": float(np.exp(log_b_crit))}
    # The noise scale where each run first reached the target.
    for row in reached:
        row["noise_scale_at_target"] = noise_scale_at(at_target[row["batch"]][1], x, y,
                                                      small=16, big=256)
    measured = float(np.median([r["noise_scale_at_target"] for r in reached]))
    print(json.dumps({"target_loss": args.target, "rows": reached, "fit": fitted,
                      "noise_scale_at_target_median": measured,
                      "ratio_b_crit_to_noise_scale": fitted["b_crit"] / measured}, indent=1))
    print("| batch | best rate | steps to target | examples | B_simple there |\n"
          "|---|---|---|---|---|", file=sys.stderr)
    for r in reached:
        print(f"| {r['batch']} | {r['rate']:g} | {r['steps']} | {r['examples']} | "
              f"{r['noise_scale_at_target']:.0f} |", file=sys.stderr)
    print(f"fit: S_min {fitted['s_min']:.0f}, B_crit {fitted['b_crit']:.0f}; "
          f"B_simple at the target (median) {measured:.0f}", file=sys.stderr)


if __name__ == "__main__":
    main()
