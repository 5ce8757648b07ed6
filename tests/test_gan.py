"""kdist.gan.GAN: the update sequence, its contracts, saving, and training on several ranks."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import kdist.gan

LATENT = 3


def _models(seed=0, aux=True):
    keras.utils.set_random_seed(seed)
    noise, condition = keras.Input((LATENT,)), keras.Input((1,))
    hidden = keras.layers.Dense(8, "tanh")(keras.layers.Concatenate()([noise, condition]))
    generator = keras.Model([noise, condition], keras.layers.Dense(2)(hidden))
    sample = keras.Input((2,))
    hidden = keras.layers.Dense(8, "tanh")(sample)
    outputs = [keras.layers.Dense(1, "sigmoid", name="fake")(hidden)]
    if aux:
        outputs.append(keras.layers.Dense(1, name="energy")(hidden))
    return generator, keras.Model(sample, outputs if aux else outputs[0])


def _batch(rows=16, steps=3, seed=1):
    rng = np.random.default_rng(seed)
    condition = rng.uniform(0.5, 2.0, (rows, 1)).astype("float32")
    return {"real": (condition * [1.0, -0.5] + 0.1 * rng.normal(size=(rows, 2))).astype(
                "float32"),
            "condition": condition,
            "latent": rng.normal(size=(rows, steps, LATENT)).astype("float32")}


def _bce(target, probability):
    probability = tf.clip_by_value(probability, 1e-7, 1 - 1e-7)
    return -tf.reduce_mean(target * tf.math.log(probability)
                           + (1 - target) * tf.math.log(1 - probability))


def _sgd(variables, loss_fn, lr):
    with tf.GradientTape() as tape:
        loss = loss_fn()
    for variable, grad in zip(variables, tape.gradient(loss, variables)):
        variable.assign_sub(lr * grad)


def test_a_batch_makes_d_steps_then_g_steps_updates_in_that_order():
    lr, smoothing, weight = 0.1, 0.1, 0.5
    batch = _batch(steps=3)
    generator, discriminator = _models()
    gan = kdist.gan.GAN(generator, discriminator, d_steps=2, g_steps=1)
    gan.compile(keras.optimizers.SGD(lr), keras.optimizers.SGD(lr), aux_losses=["mse"],
                aux_loss_weights=[weight], label_smoothing=smoothing)
    # The same sequence written out by hand on a copy of both models.
    ref_g, ref_d = _models()
    real, condition = tf.constant(batch["real"]), tf.constant(batch["condition"])

    def mse(a, b):
        return tf.reduce_mean(tf.square(a - b))

    for step in range(2):
        fake = ref_g([tf.constant(batch["latent"][:, step]), condition])

        def d_loss():
            (p_real, e_real), (p_fake, e_fake) = ref_d(real), ref_d(fake)
            return (_bce(1 - smoothing, p_real) + _bce(0.0, p_fake)
                    + weight * (mse(condition, e_real) + mse(condition, e_fake)))
        _sgd(ref_d.trainable_variables, d_loss, lr)

    def g_loss():
        p_fake, e_fake = ref_d(ref_g([tf.constant(batch["latent"][:, 2]), condition]))
        return _bce(1.0, p_fake) + weight * mse(condition, e_fake)
    _sgd(ref_g.trainable_variables, g_loss, lr)

    logs = gan.train_on_batch(batch, return_dict=True)
    for ours, theirs in ((generator, ref_g), (discriminator, ref_d)):
        for a, b in zip(ours.get_weights(), theirs.get_weights()):
            np.testing.assert_allclose(a, b, atol=2e-6)
    assert int(gan.d_optimizer.iterations) == 2 and int(gan.g_optimizer.iterations) == 1
    assert set(logs) == {"d_loss", "g_loss", "d_energy_loss", "g_energy_loss"}


@pytest.mark.parametrize("d_steps,g_steps", [(1, 1), (1, 2), (3, 1)])
def test_update_counts_follow_the_ratio(d_steps, g_steps):
    gan = kdist.gan.GAN(*_models(aux=False), d_steps=d_steps, g_steps=g_steps, seed=4)
    gan.compile("adam", "adam")
    batch = _batch(rows=40)
    gan.fit(batch["real"], batch["condition"], batch_size=8, epochs=2, verbose=0)
    assert int(gan.d_optimizer.iterations) == 10 * d_steps
    assert int(gan.g_optimizer.iterations) == 10 * g_steps


def test_drawn_noise_is_seeded_and_fresh_for_every_update():
    histories = []
    for _ in range(2):
        gan = kdist.gan.GAN(*_models(aux=False), seed=7)
        gan.compile(keras.optimizers.SGD(0.05), keras.optimizers.SGD(0.05))
        batch = _batch(rows=32)
        histories.append(gan.fit(batch["real"], batch["condition"], batch_size=8, epochs=2,
                                 verbose=0, shuffle=False).history)
    assert histories[0] == histories[1]
    draws = [kdist.gan.batches.normal(4, LATENT, tf.constant([1, 2]), stream)
             for stream in (0, 1)]
    assert not np.allclose(draws[0], draws[1]), "ranks must not share noise"


def test_save_and_load_keep_weights_optimizers_and_settings(tmp_path):
    gan = kdist.gan.GAN(*_models(), d_steps=2, g_steps=1, seed=3)
    gan.compile(keras.optimizers.Adam(1e-3), keras.optimizers.Adam(2e-3), aux_losses=["mse"],
                aux_loss_weights=[0.2], label_smoothing=0.05)
    batch = _batch(rows=32)
    gan.fit(batch["real"], batch["condition"], batch_size=8, verbose=0)
    gan.save(tmp_path / "gan.keras")
    loaded = keras.models.load_model(tmp_path / "gan.keras")
    assert isinstance(loaded, kdist.gan.GAN)
    assert (loaded.d_steps, loaded.g_steps, loaded.latent_dim) == (2, 1, LATENT)
    assert loaded.label_smoothing == 0.05 and loaded.aux_loss_weights == [0.2]
    assert int(loaded.d_optimizer.iterations) == 8 and int(loaded.g_optimizer.iterations) == 4
    for a, b in zip(loaded.d_optimizer.variables, gan.d_optimizer.variables):
        np.testing.assert_array_equal(a, b)
    noise, condition = np.ones((2, LATENT), "float32"), np.ones((2, 1), "float32")
    np.testing.assert_array_equal(loaded([noise, condition]), gan([noise, condition]))
    loaded.fit(batch["real"], batch["condition"], batch_size=8, verbose=0)
    assert int(loaded.d_optimizer.iterations) == 16


def test_generate_and_evaluate():
    gan = kdist.gan.GAN(*_models())
    gan.compile("sgd", "sgd", aux_losses=["mae"])
    assert gan.generate(condition=[1.0, 2.0, 3.0], seed=0).shape == (3, 2)
    np.testing.assert_array_equal(gan.generate(condition=[1.0], seed=5),
                                  gan.generate(condition=[1.0], seed=5))
    batch = _batch(rows=16)
    scores = gan.evaluate(batch["real"], batch["condition"], verbose=0, return_dict=True)
    assert np.isfinite(scores["d_loss"]) and np.isfinite(scores["g_energy_loss"])
    with pytest.raises(ValueError, match="condition="):
        gan.generate(count=3)


def test_bad_settings_raise_clear_errors():
    generator, discriminator = _models()
    with pytest.raises(ValueError, match="d_steps"):
        kdist.gan.GAN(generator, discriminator, d_steps=0)
    with pytest.raises(ValueError, match="different models"):
        kdist.gan.GAN(generator, generator)
    with pytest.raises(TypeError, match="keras.Model"):
        kdist.gan.GAN(generator, "discriminator")
    gan = kdist.gan.GAN(generator, discriminator)
    shared = keras.optimizers.Adam()
    with pytest.raises(ValueError, match="separate optimizer"):
        gan.compile(shared, shared, aux_losses=["mse"])
    with pytest.raises(ValueError, match="auxiliary outputs"):
        gan.compile("adam", "adam")
    with pytest.raises(ValueError, match="label_smoothing"):
        gan.compile("adam", "adam", aux_losses=["mse"], label_smoothing=1.0)
    with pytest.raises(ValueError, match="aux_loss_weights"):
        gan.compile("adam", "adam", aux_losses=["mse"], aux_loss_weights=[1.0, 2.0])
    gan.compile("adam", "adam", aux_losses=["mse"])
    batch = _batch(rows=8)
    with pytest.raises(ValueError, match="keys"):
        gan.fit({"real": batch["real"], "noise": batch["real"]}, verbose=0)
    with pytest.raises(ValueError, match="targets"):
        gan.fit(batch["real"], verbose=0)
    with pytest.raises(ValueError, match="updates per batch"):
        gan.fit(dict(batch, latent=np.zeros((8, 5, LATENT), "float32")), verbose=0)


# Several ranks: the same GAN, the same data and the same noise per sample.
def _assert_ranks_equal_one_process(job, single):
    reports = [job.rank(0), job.rank(1)]
    for part in ("generator", "discriminator"):
        assert reports[0][part] == reports[1][part], "ranks must hold identical weights"
        np.testing.assert_allclose(reports[0][part], single[part], atol=1e-5)
    assert reports[0]["d_iterations"] == single["d_iterations"] == 32
    assert reports[0]["g_iterations"] == single["g_iterations"] == 16
    assert all(moved > 1e-3 for moved in single["moved"])


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["hvd", "mpi"])
def test_two_ranks_train_as_one_process_on_the_global_batch(mpirun, python_run, mode):
    single = python_run("gan_train.py", ["--mode", "single"])
    # Different initial weights per rank: only the broadcast makes them agree.
    job = mpirun("gan_train.py", n=2, args=["--mode", mode, "--seed-per-rank"])
    _assert_ranks_equal_one_process(job, single)
    if mode == "mpi":
        # The strategy's metrics are those of the global batch.
        np.testing.assert_allclose(job.rank(0)["history"]["d_loss"],
                                   single["history"]["d_loss"], atol=1e-5)


@pytest.mark.mpi
def test_parameter_server_exchanges_both_models(mpirun, tmp_path):
    import ps_reference

    job = mpirun("gan_train.py", n=3, args=["--mode", "ps", "--record", tmp_path], timeout=240)
    reports = [job.rank(r) for r in range(3)]
    master = next(r for r in reports if r["is_master"])
    # Generator 5-16-2 and discriminator 2-16-(1, 1): 130 + 82 values in one message.
    assert master["exchanged"] == 212
    # Every message the workers sent (both models' changes after their d and g
    # steps) was added to the centre, replayed with Downpour's rule, and every
    # rank ends with the replayed centre; both models moved.
    ps_reference.check(tmp_path, ps_reference.Rules("downpour"),
                       final_weights=[r["all"] for r in reports])
    assert all(moved > 1e-3 for moved in master["moved"])
    assert len(master["history"]["d_loss"]) == 2 and len(master["history"]["g_loss"]) == 2


def test_mixed_float16_scales_both_losses():
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        gan = kdist.gan.GAN(*_models(), seed=2)
        gan.compile("adam", "adam", aux_losses=["mse"])
        assert all(isinstance(o, keras.optimizers.LossScaleOptimizer) for o in gan.optimizers)
        batch = _batch(rows=32)
        history = gan.fit(batch["real"], batch["condition"], batch_size=8, verbose=0).history
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert np.isfinite(history["d_loss"][0]) and np.isfinite(history["g_loss"][0])
    # A step that overflows float16 is skipped and halves the scale instead.
    for optimizer in gan.optimizers:
        skipped = 4 - int(optimizer.iterations)
        assert 0 <= skipped < 4
        assert float(optimizer.dynamic_scale) == pytest.approx(2.0 ** (15 - skipped))
