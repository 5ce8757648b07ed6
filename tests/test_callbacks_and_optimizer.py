"""Single-process behaviour of the optimizer wrapper, callbacks, precision and checkpoints."""

import os

import keras
import numpy as np
import pytest

import kdist
from kdist.callbacks import checkpoint as checkpoint_lib


def _model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1)])


def test_the_wrapper_delegates_learning_rate_and_iterations():
    opt = kdist.DistributedOptimizer(keras.optimizers.Adam(0.01))
    opt.learning_rate = 0.5
    assert float(opt.inner_optimizer.learning_rate.numpy()) == 0.5
    model = _model()
    model.compile(optimizer=opt, loss="mse")
    model.fit(np.ones((8, 4)), np.ones((8, 1)), batch_size=4, epochs=1, verbose=0)
    assert int(opt.iterations.numpy()) == 2 == int(opt.inner_optimizer.iterations.numpy())


def test_the_wrapper_rejects_what_it_cannot_wrap():
    with pytest.raises(TypeError, match="Keras 3 optimizer"):
        kdist.DistributedOptimizer(object())
    with pytest.raises(ValueError, match="at least 1"):
        kdist.DistributedOptimizer(keras.optimizers.SGD(), backward_passes_per_step=0)
    with pytest.raises(ValueError, match="already averages"):
        kdist.optimizers.AllreduceOptimizer(kdist.DistributedOptimizer(keras.optimizers.SGD()))
    with pytest.raises(ValueError, match="op="):
        kdist.DistributedOptimizer(keras.optimizers.SGD(), op=kdist.Sum)


def test_a_model_with_the_wrapper_saves_and_loads(tmp_path):
    model = _model()
    opt = kdist.DistributedOptimizer(keras.optimizers.Adam(0.01),
                                     compression=kdist.Compression.topk(0.25), num_groups=2)
    model.compile(optimizer=opt, loss="mse")
    model.fit(np.ones((8, 4)), np.ones((8, 1)), epochs=1, verbose=0)
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    assert isinstance(loaded.optimizer, kdist.optimizers.AllreduceOptimizer)
    assert loaded.optimizer.compression.ratio == 0.25 and loaded.optimizer.num_groups == 2
    np.testing.assert_allclose(loaded.predict(np.ones((2, 4)), verbose=0),
                               model.predict(np.ones((2, 4)), verbose=0))


def test_precision_enable_sets_the_policy_and_scales_the_loss():
    try:
        assert kdist.precision.enable("mixed_float16").name == "mixed_float16"
        opt = kdist.DistributedOptimizer(keras.optimizers.SGD(0.1))
        assert isinstance(opt, kdist.precision.LossScaleOptimizer)
        assert isinstance(opt.inner_optimizer, kdist.optimizers.AllreduceOptimizer)
        model = _model()
        model.compile(optimizer=opt, loss="mse")
        assert model.optimizer is opt, "Keras must not wrap it a second time"
        model.fit(np.ones((8, 4)), np.ones((8, 1)), epochs=1, verbose=0)
        scale = float(opt.dynamic_scale.numpy())
        assert float(opt.scale_loss(1.0)) == scale and scale <= 2.0**15
        assert all(np.isfinite(w).all() for w in model.get_weights())
        with pytest.raises(ValueError, match="Unknown precision policy"):
            kdist.precision.enable("float8")
        own = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(), initial_scale=8.0,
                                                  dynamic_growth_steps=10)
        wrapped = kdist.DistributedOptimizer(own)
        assert isinstance(wrapped, kdist.precision.LossScaleOptimizer)
        assert (wrapped.initial_scale, wrapped.dynamic_growth_steps) == (8.0, 10)
    finally:
        kdist.precision.enable("float32")


def test_warmup_ramps_linearly_to_the_target():
    warmup = kdist.callbacks.LearningRateWarmupCallback(initial_lr=0.4, warmup_epochs=4)
    assert warmup.learning_rate_at(0) == pytest.approx(0.4 / kdist.size())
    assert warmup.learning_rate_at(4) == pytest.approx(0.4)
    with pytest.raises(ValueError, match="warmup_epochs"):
        kdist.callbacks.LearningRateWarmupCallback(0.1, warmup_epochs=0)
    with pytest.raises(ValueError, match="end_epoch"):
        kdist.callbacks.LearningRateScheduleCallback(0.1, 0.5, start_epoch=3, end_epoch=2)


def test_schedule_sets_the_rate_each_epoch():
    model = _model()
    model.compile(optimizer=kdist.DistributedOptimizer(keras.optimizers.SGD(1.0)), loss="mse")
    schedule = kdist.callbacks.LearningRateScheduleCallback(
        initial_lr=0.1, multiplier=lambda epoch: 0.5 ** epoch)
    history = model.fit(np.ones((8, 4)), np.ones((8, 1)), epochs=3, verbose=0,
                        callbacks=[schedule])
    assert np.allclose(history.history["learning_rate"], [0.1, 0.05, 0.025])


def test_checkpoints_are_written_whole_and_resume_a_single_process_run(tmp_path):
    x, y = np.random.default_rng(0).normal(size=(16, 4)), np.ones((16, 1))
    # Checkpoints match variables by path; a resumed run is a new process, where
    # Keras gives the layers the same automatic names again.
    keras.backend.clear_session()
    model = _model()
    model.compile(optimizer=kdist.DistributedOptimizer(keras.optimizers.Adam(0.01)),
                  loss="mse")
    model.fit(x, y, epochs=3, verbose=0, shuffle=False,
              callbacks=[kdist.callbacks.Checkpoint(tmp_path, keep=2)])
    assert sorted(os.listdir(tmp_path)) == ["epoch-000002.npz", "epoch-000003.npz"]
    assert kdist.callbacks.latest_checkpoint(tmp_path).endswith("epoch-000003.npz")

    keras.backend.clear_session()
    again = _model()
    again.compile(optimizer=kdist.DistributedOptimizer(keras.optimizers.Adam(0.01)),
                  loss="mse")
    resume = kdist.callbacks.Checkpoint(tmp_path)
    history = again.fit(x, y, epochs=4, verbose=0, shuffle=False, callbacks=[resume])
    assert resume.resumed_from == 3 and len(history.history["loss"]) == 1
    assert int(again.optimizer.iterations.numpy()) == 4 * 1


def test_a_failed_write_leaves_no_partial_checkpoint(tmp_path, monkeypatch):
    model = _model()

    def broken_savez(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint_lib.np, "savez", broken_savez)
    with pytest.raises(OSError, match="disk full"):
        checkpoint_lib.save_state(str(tmp_path / "epoch-000001.npz"), model.variables, 1)
    assert os.listdir(tmp_path) == []


def test_a_checkpoint_from_another_model_is_refused(tmp_path):
    checkpoint_lib.save_state(str(tmp_path / "epoch-000001.npz"), _model().variables, 1)
    other = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    with pytest.raises(ValueError, match="another model"):
        checkpoint_lib.load_state(str(tmp_path / "epoch-000001.npz"), other.variables)
    with pytest.raises(ValueError, match="keep"):
        kdist.callbacks.Checkpoint(tmp_path, keep=0)
