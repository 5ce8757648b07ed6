"""Large-batch tools: LARS, learning-rate scaling rules, the gradient noise scale."""

import math

import keras
import numpy as np
import pytest

import kdist
from kdist.callbacks import GradientNoiseScale, estimate_noise_scale, scale_learning_rate
from kdist.optimizers import LARS


def _apply(optimizer, values, grads):
    variables = [keras.Variable(np.array(v, dtype="float32")) for v in values]
    optimizer.apply([np.array(g, dtype="float32") for g in grads], variables)
    return [keras.ops.convert_to_numpy(v) for v in variables]


def test_lars_matches_a_hand_computed_step():
    kernel = np.array([[1.0, 2.0], [3.0, -4.0]])
    bias = np.array([0.5, -0.5])
    g_kernel = np.array([[0.2, -0.1], [0.4, 0.3]])
    g_bias = np.array([1.0, 2.0])
    lr, eta, decay = 0.1, 0.02, 0.01
    new_kernel, new_bias = _apply(
        LARS(keras.optimizers.SGD(lr), eta=eta, weight_decay=decay), [kernel, bias],
        [g_kernel, g_bias])
    w, g = np.linalg.norm(kernel), np.linalg.norm(g_kernel)
    trust = eta * w / (g + decay * w + 1e-9)
    np.testing.assert_allclose(new_kernel, kernel - lr * trust * (g_kernel + decay * kernel),
                               rtol=1e-6)
    # A bias is neither adapted nor decayed: plain SGD.
    np.testing.assert_allclose(new_bias, bias - lr * g_bias, rtol=1e-6)

    # LARC's clip: the trust ratio over the rate, capped at 1.
    big_eta = 10.0
    clipped, = _apply(LARS(keras.optimizers.SGD(lr), eta=big_eta, clip=True), [kernel],
                      [g_kernel])
    np.testing.assert_allclose(clipped, kernel - lr * g_kernel, rtol=1e-6)
    small, = _apply(LARS(keras.optimizers.SGD(lr), eta=eta, clip=True), [kernel], [g_kernel])
    ratio = min(eta * w / (g + 1e-9) / lr, 1.0)
    np.testing.assert_allclose(small, kernel - lr * ratio * g_kernel, rtol=1e-6)


def test_lars_exclusions_and_zero_norms():
    kernel, grad = np.ones((2, 2)), np.full((2, 2), 0.5)
    excluded, = _apply(LARS(keras.optimizers.SGD(1.0), exclude=("variable",)), [kernel],
                       [grad])
    np.testing.assert_allclose(excluded, kernel - grad)
    vector, = _apply(LARS(keras.optimizers.SGD(1.0), eta=0.5, skip_vectors=False),
                     [np.array([3.0, 4.0])], [np.array([0.0, 1.0])])
    np.testing.assert_allclose(vector, [3.0, 4.0 - 0.5 * 5.0 / 1.0], rtol=1e-6)
    # A zero weight (a fresh layer) takes the plain gradient instead of no step at all.
    zero, = _apply(LARS(keras.optimizers.SGD(1.0)), [np.zeros((2, 2))], [grad])
    np.testing.assert_allclose(zero, -grad)


def test_lars_trains_under_the_distributed_optimizer_and_saves(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 4)).astype("float32")
    y = (x @ np.array([1.0, -2.0, 0.5, 3.0]) + 1.0).astype("float32")[:, None]
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.LayerNormalization(), keras.layers.Dense(1)])
    model.compile(kdist.DistributedOptimizer(
        LARS(keras.optimizers.SGD(0.1, momentum=0.9), eta=0.05, weight_decay=1e-4)), "mse")
    before = model.evaluate(x, y, verbose=0)
    model.fit(x, y, batch_size=32, epochs=5, verbose=0)
    assert model.evaluate(x, y, verbose=0) < 0.2 * before
    model.save(tmp_path / "lars.keras")
    loaded = keras.models.load_model(tmp_path / "lars.keras")
    inner = loaded.optimizer.inner_optimizer
    assert isinstance(inner, LARS) and inner.eta == 0.05 and inner.weight_decay == 1e-4
    for a, b in zip(loaded.optimizer.variables, model.optimizer.variables):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(a),
                                      keras.ops.convert_to_numpy(b))


@pytest.mark.parametrize("make, message", [
    (lambda: LARS("sgd"), "keras.optimizers.Optimizer"),
    (lambda: LARS(keras.optimizers.SGD(), eta=0), "eta"),
    (lambda: LARS(keras.optimizers.SGD(), weight_decay=-1), "weight_decay"),
    (lambda: LARS(keras.optimizers.SGD(), exclude=[3]), "substrings"),
])
def test_lars_refuses_bad_arguments(make, message):
    with pytest.raises((TypeError, ValueError), match=message):
        make()


def test_learning_rate_scaling_rules_and_the_warmup_that_uses_them():
    assert scale_learning_rate(0.1, "linear", size=8) == pytest.approx(0.8)
    assert scale_learning_rate(0.1, "sqrt", size=16) == pytest.approx(0.4)
    assert scale_learning_rate(0.1, "linear") == pytest.approx(0.1 * kdist.size())
    with pytest.raises(ValueError, match="rule"):
        scale_learning_rate(0.1, "cubic")
    with pytest.raises(ValueError, match="size"):
        scale_learning_rate(0.1, "linear", size=0)
    # One process: the rule's target is the rate itself, and so is the whole ramp.
    warmup = kdist.callbacks.LearningRateWarmupCallback(0.1, warmup_epochs=2, scaling="linear")
    assert [warmup.learning_rate_at(e) for e in (0.0, 1.0, 2.0)] == pytest.approx([0.1] * 3)
    with pytest.raises(ValueError, match="rule"):
        kdist.callbacks.LearningRateWarmupCallback(0.1, scaling="log")


def test_the_noise_scale_formula_inverts_its_model():
    # |G_b|^2 = |G|^2 + S / b exactly: the estimate gives back |G|^2 and S.
    signal, variance = 2.5, 40.0
    scale, got_signal, got_variance = estimate_noise_scale(
        signal + variance / 4, signal + variance / 16, 4, 16)
    assert (got_signal, got_variance) == pytest.approx((signal, variance))
    assert scale == pytest.approx(variance / signal)
    assert math.isnan(estimate_noise_scale(4.0, 1.0, 4, 8)[0])  # no signal left
    assert math.isnan(estimate_noise_scale(1.0, 2.0, 4, 8)[0])  # a negative variance
    with pytest.raises(ValueError, match="2 ranks"):
        estimate_noise_scale(1.0, 1.0, 8, 8)


def test_the_noise_scale_needs_the_distributed_optimizer_and_two_ranks():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    with pytest.raises(ValueError, match="DistributedOptimizer"):
        model.fit(np.zeros((4, 2)), np.zeros(4), verbose=0,
                  callbacks=[GradientNoiseScale(batch_size=2)])
    model.compile(kdist.DistributedOptimizer(keras.optimizers.SGD()), "mse")
    with pytest.raises(ValueError, match="2 ranks"):
        model.fit(np.zeros((4, 2)), np.zeros(4), verbose=0,
                  callbacks=[GradientNoiseScale(batch_size=2)])


NOISE_SCALE = """
import keras, numpy as np, kdist
from workers.common import report

kdist.init()
rng = np.random.default_rng(0)
n = 16384
x = rng.normal(size=(n, 4)).astype("float32")
y = (x[:, :1] + 1.5 * rng.normal(size=(n, 1))).astype("float32")
# At zero weights each example's gradient of (w.x + b - y)^2 is -2y(x, 1).
per_example = np.hstack([-2 * y * x, -2 * y])
mean = per_example.mean(axis=0)
brute = float(((per_example - mean) ** 2).sum(axis=1).mean() / (mean @ mean))
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, kernel_initializer="zeros")])
# A zero rate keeps the weights where the brute-force estimate was taken.
model.compile(kdist.DistributedOptimizer(keras.optimizers.SGD(0.0)), "mse")
# A traced train function must be traced again to record the norms.
model.train_on_batch(x[:8], y[:8])
callback = kdist.callbacks.GradientNoiseScale(batch_size=8)
history = model.fit(x[kdist.rank()::2], y[kdist.rank()::2], batch_size=8, epochs=1, verbose=0,
                    callbacks=[callback])
report({"brute": brute, "estimate": callback.history,
        "logged": history.history["gradient_noise_scale"]})
"""


def test_the_noise_scale_estimate_agrees_with_brute_force_on_two_ranks(mpirun):
    result = mpirun(NOISE_SCALE, n=2, timeout=240)
    first, second = result.results[0], result.results[1]
    assert first["estimate"] == second["estimate"] == first["logged"]
    assert first["estimate"][0] == pytest.approx(first["brute"], rel=0.2)
    assert "gradient noise scale ~" in result.output
