"""Single-process behaviour of the optimizer wrapper, callbacks, precision and checkpoints."""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

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
    with pytest.raises(ValueError, match="op=kdist.Average or op=kdist.Sum; got op='max'"):
        kdist.DistributedOptimizer(keras.optimizers.SGD(), op=kdist.Max)


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


def test_optimizer_state_from_other_variables_is_refused_and_nothing_is_assigned():
    model = _model()
    opt = kdist.DistributedOptimizer(keras.optimizers.Adam(0.01))
    model.compile(optimizer=opt, loss="mse")
    model.fit(np.ones((8, 4)), np.ones((8, 1)), epochs=1, verbose=0)
    state = [np.array(v) for v in opt.variables]
    with pytest.raises(ValueError, match="saved from an optimizer built for other variables"):
        opt.set_weights(state[:-1])
    wrong = [np.zeros((v.shape[0] + 1,) + tuple(v.shape[1:]), "float32") if v.shape else v
             for v in state]
    with pytest.raises(ValueError, match="has shape .* but the value given has shape"):
        opt.set_weights(wrong)
    # All or nothing: the refused states left every variable as it was.
    assert all(np.array_equal(v, s) for v, s in zip(opt.variables, state))
    opt.set_weights([s + 1 if s.dtype.kind == "f" else s for s in state])
    assert np.array_equal(opt.variables[-1], state[-1] + 1)


def test_variables_with_open_shapes_take_values_of_any_fitting_shape():
    from kdist._variables import assign_all

    open_rows = tf.Variable(np.zeros((2, 3)), shape=tf.TensorShape([None, 3]))
    open_rank = tf.Variable(np.zeros(2), shape=tf.TensorShape(None))
    assign_all(([open_rows, open_rank], [np.ones((5, 3)), np.ones((2, 2))], "The state"))
    assert open_rows.numpy().shape == (5, 3) and open_rank.numpy().shape == (2, 2)
    with pytest.raises(ValueError, match=r"has shape \(None, 3\) but .* \(5, 4\)"):
        assign_all(([open_rows, open_rank], [np.ones((5, 4)), 1.0], "The state"))
    assert open_rows.numpy().shape == (5, 3) and float(open_rank.numpy()[0, 0]) == 1.0


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


# -- Horovod's gradient protocol ---------------------------------------------------------------


def test_compute_gradients_takes_a_loss_function_or_a_tensor_and_its_tape():
    x = tf.Variable(2.0)
    opt = kdist.DistributedOptimizer(keras.optimizers.SGD(0.5))
    (grad, var), = opt._compute_gradients(lambda: 3.0 * x, var_list=[x])
    assert var is x and float(grad) == 3.0
    with tf.GradientTape() as tape:
        loss = x * x
    (grad, _), = opt.compute_gradients(loss, [x], tape=tape)
    assert float(grad) == 4.0
    opt.apply_gradients([(grad, x)], experimental_aggregate_gradients=False)
    assert float(x.numpy()) == 0.0 and int(opt.iterations.numpy()) == 1
    opt.minimize(lambda: 3.0 * x, var_list=lambda: [x])
    assert float(x.numpy()) == -1.5 and int(opt.iterations.numpy()) == 2
    with pytest.raises(ValueError, match="tape"):
        opt._compute_gradients(x * 1.0, [x])
    frozen = keras.Variable(1.0, trainable=False)  # a Keras variable the tape must watch
    (grad, _), = kdist.DistributedOptimizer(keras.optimizers.SGD())._compute_gradients(
        lambda: 3.0 * frozen, [frozen])
    assert float(grad) == 3.0


def _gathered_loss(x, y):
    # d/dx = 1; d/dy = [-1, 0], as tf.IndexedSlices.
    return lambda: x - tf.gather(y, [0])


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "tf_function"])
@pytest.mark.parametrize("average", [False, True], ids=["summed", "averaged"])
def test_accumulation_applies_every_n_passes_and_counts_every_pass(traced, average):
    passes = 3
    opt = kdist.DistributedOptimizer(keras.optimizers.SGD(1.0), backward_passes_per_step=passes,
                                     average_aggregated_gradients=average)
    x, y = tf.Variable([0.0]), tf.Variable([1.0, 2.0])

    def step():
        opt.apply_gradients(opt._compute_gradients(_gathered_loss(x, y), var_list=[x, y]))

    step = tf.function(step) if traced else step
    for i in range(7):
        step()
        moved = (i + 1) // passes * (1.0 if average else passes)
        np.testing.assert_allclose(x.numpy(), [-moved])
        np.testing.assert_allclose(y.numpy(), [1.0 + moved, 2.0])
        assert int(opt.iterations.numpy()) == i + 1
        assert int(opt._agg_helper.counter.numpy()) == (i + 1) % passes


def test_an_infinite_gradient_does_not_poison_the_next_cycle():
    for protocol in ("horovod", "keras"):
        opt = kdist.DistributedOptimizer(keras.optimizers.SGD(1.0), backward_passes_per_step=2)
        x = tf.Variable(0.0)
        first = tf.Variable(True)

        def loss():
            return tf.cond(first, lambda: x * float("inf"), lambda: x)

        for cycle in range(2):
            for _ in range(2):
                if protocol == "horovod":
                    grads_and_vars = opt._compute_gradients(loss, [x])
                    opt.apply_gradients(grads_and_vars)
                else:
                    with tf.GradientTape() as tape:
                        value = loss()
                    opt.apply([tape.gradient(value, x)], [x])
                first.assign(False)
            accumulator = opt._agg_helper.accumulators[0]
            assert float(accumulator.numpy()) == 0.0, "reset by assigning zeros, not by 0 * inf"
        assert np.isinf(x.numpy())  # the first cycle's update was infinite...
        if protocol == "horovod":
            assert np.isfinite(grads_and_vars[0][0].numpy())  # ...the second cycle's is not


def test_accumulation_through_fit_equals_one_step_on_both_batches():
    data = np.random.default_rng(0).normal(size=(8, 4)).astype("float32")
    target = data[:, :1] * 2.0
    accumulated = _model()
    opt = kdist.DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=2,
                                     average_aggregated_gradients=True)
    accumulated.compile(optimizer=opt, loss="mse")
    start = accumulated.get_weights()
    accumulated.train_on_batch(data[:4], target[:4])
    assert all(np.array_equal(a, b) for a, b in zip(start, accumulated.get_weights()))
    accumulated.train_on_batch(data[4:], target[4:])
    plain = _model()
    plain.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    plain.train_on_batch(data, target)
    for a, b in zip(accumulated.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    accumulated.train_on_batch(data[:4], target[:4])
    assert int(opt.iterations.numpy()) == 3 and int(opt._agg_helper.counter.numpy()) == 1


def test_optimizer_arguments_are_checked():
    sgd = keras.optimizers.SGD
    with pytest.raises(ValueError, match="whole number; got 2.7"):
        kdist.DistributedOptimizer(sgd(), backward_passes_per_step=2.7)
    opt = kdist.DistributedOptimizer(sgd(), backward_passes_per_step=np.int64(2),
                                     num_groups=np.int32(2), device_dense="/gpu:0",
                                     device_sparse="/cpu:0")
    assert type(opt.backward_passes_per_step) is int and opt.backward_passes_per_step == 2
    assert opt.num_groups == 2
    assert kdist.DistributedOptimizer(sgd(), groups=np.int64(3)).num_groups == 3
    for factor in (0, -2.0):
        with pytest.raises(ValueError, match="gradient_predivide_factor"):
            kdist.DistributedOptimizer(sgd(), gradient_predivide_factor=factor)
    with pytest.raises(ValueError, match="needs op=kdist.Average"):
        kdist.DistributedOptimizer(sgd(), gradient_predivide_factor=2.0, op=kdist.Sum)
    with pytest.raises(ValueError, match="Adasum is not available.*op=kdist.Average"):
        kdist.DistributedOptimizer(sgd(), op=kdist.Adasum)
    assert kdist.DistributedOptimizer(sgd(), op=kdist.Sum).op == kdist.Sum
    with pytest.raises(ValueError, match="groups must be a whole number, at least 1"):
        kdist.DistributedOptimizer(sgd(), groups=0)
    v = tf.Variable(1.0)
    with pytest.raises(ValueError, match="more than one group"):
        kdist.DistributedOptimizer(sgd(), groups=[[v], [v]])
    with pytest.raises(TypeError, match="list of lists"):
        kdist.DistributedOptimizer(sgd(), groups=[v])
    with pytest.raises(TypeError, match="Keras layers"):
        kdist.PartialDistributedOptimizer(sgd(), local_layers=[v])


def test_tf_keras_optimizers_are_refused_with_the_keras3_name():
    tf_keras = pytest.importorskip("tf_keras")
    for legacy in (tf_keras.optimizers.Adam(), tf_keras.optimizers.legacy.Adam()):
        with pytest.raises(TypeError, match=r"Use keras\.optimizers\.Adam\(\.\.\.\) from Keras 3"):
            kdist.DistributedOptimizer(legacy)


def test_optimizer_config_round_trips_every_argument():
    model = _model()
    first, second = model.layers
    opt = kdist.PartialDistributedOptimizer(
        keras.optimizers.Adam(0.01), name="dist", compression=kdist.Compression.fp16,
        sparse_as_dense=True, gradient_predivide_factor=2.0, backward_passes_per_step=3,
        average_aggregated_gradients=True, groups=[[first.kernel, second.kernel]],
        local_layers=[second], scale_local_gradients=False)
    config = opt.get_config()
    assert config["groups"] == [[first.kernel.path, second.kernel.path]]
    assert config["local_variables"] == sorted([second.kernel.path, second.bias.path])
    assert (config["op"], config["gradient_predivide_factor"], config["sparse_as_dense"],
            config["backward_passes_per_step"], config["scale_local_gradients"]) == (
        "average", 2.0, True, 3, False)
    assert opt.from_config(config).get_config() == config
    assert type(opt).from_config(config).get_config() == config
    summing = kdist.DistributedOptimizer(keras.optimizers.SGD(), op=kdist.Sum, groups=2)
    again = type(summing).from_config(summing.get_config())
    assert (again.op, again.num_groups) == (kdist.Sum, 2)


def test_local_variables_and_groups_given_by_path_apply_after_loading(tmp_path):
    model = _model()
    opt = kdist.PartialDistributedOptimizer(keras.optimizers.SGD(0.1),
                                            local_layers=model.layers[1],
                                            groups=[[model.layers[0].kernel]])
    model.compile(optimizer=opt, loss="mse")
    model.save(tmp_path / "partial.keras")
    loaded = keras.models.load_model(tmp_path / "partial.keras").optimizer
    ids, paths = loaded.local_variable_keys()
    assert paths == {model.layers[1].kernel.path, model.layers[1].bias.path}
    assert loaded._gradient_reduction._group_positions(model.trainable_weights) == ((0,),)


# -- callbacks ---------------------------------------------------------------------------------


def test_broadcast_callback_checks_its_arguments():
    callback = kdist.callbacks.BroadcastGlobalVariablesCallback(root_rank=np.int64(0))
    assert type(callback.root_rank) is int and callback.root_rank == 0
    for bad in (kdist.size(), -1):
        with pytest.raises(ValueError, match=f"root_rank={bad}"):
            kdist.callbacks.BroadcastGlobalVariablesCallback(root_rank=bad)
    with pytest.raises(ValueError, match="whole number"):
        kdist.callbacks.BroadcastGlobalVariablesCallback(root_rank=0.5)
    with pytest.raises(TypeError, match="local_variables must be variables"):
        kdist.callbacks.BroadcastGlobalVariablesCallback(local_variables=["dense/kernel"])
    v = tf.Variable(1.0)
    single = kdist.callbacks.BroadcastGlobalVariablesCallback(local_variables=v)
    assert single._local_variables == [v]


class _RecordRate(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.rates = []

    def on_train_batch_begin(self, batch, logs=None):
        self.rates.append(float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate)))


def _rates(callbacks, epochs, steps=4, monkeypatch=None, size=None):
    if size is not None:
        monkeypatch.setattr(kdist.callbacks.learning_rate.processes, "size", lambda: size)
    model = _model()
    model.compile(optimizer=kdist.DistributedOptimizer(keras.optimizers.SGD(1.0)), loss="mse")
    record = _RecordRate()
    model.fit(np.ones((steps, 4)), np.ones((steps, 1)), batch_size=1, epochs=epochs, verbose=0,
              shuffle=False, callbacks=callbacks + [record])
    return np.array(record.rates)


def test_a_fractional_warmup_ends_exactly_at_the_target(monkeypatch):
    warmup = kdist.callbacks.LearningRateWarmupCallback(initial_lr=0.4, warmup_epochs=2.5)
    rates = _rates([warmup], epochs=4, monkeypatch=monkeypatch, size=4)
    # Batch b of epoch e trains with the ramp's value at e + (b + 1) / 4: the tenth
    # batch, the last of the warm-up, ends it at 2.5 epochs.
    expected = [0.1 * (1 + 3 * (k / 4) / 2.5) for k in range(1, 11)]
    np.testing.assert_allclose(rates[:10], expected, rtol=1e-6)
    assert rates[9] == np.float32(0.4)
    assert np.all(rates[10:] == np.float32(0.4))


def test_schedules_with_fractional_bounds_hand_over_mid_epoch():
    first = kdist.callbacks.LearningRateScheduleCallback(1.0, 1.0, start_epoch=0, end_epoch=1.5)
    second = kdist.callbacks.LearningRateScheduleCallback(1.0, 0.1, start_epoch=1.5)
    rates = _rates([first, second], epochs=3)
    np.testing.assert_allclose(rates, [1.0] * 6 + [0.1] * 6, rtol=1e-6)
    smooth = kdist.callbacks.LearningRateScheduleCallback(1.0, lambda epoch: epoch / 10,
                                                          start_epoch=0.5, end_epoch=1.25,
                                                          staircase=False)
    rates = _rates([smooth], epochs=2)
    # Governed from batch 2 of epoch 0 to batch 0 of epoch 1; the rate then stays.
    np.testing.assert_allclose(rates, [1.0, 1.0, 0.05, 0.075, 0.1, 0.1, 0.1, 0.1], rtol=1e-6)


def test_learning_rate_callbacks_reject_bad_arguments():
    schedule = kdist.callbacks.LearningRateScheduleCallback
    warmup = kdist.callbacks.LearningRateWarmupCallback
    with pytest.raises(ValueError, match="initial_lr must be a positive number; got 0"):
        schedule(0, 0.5)
    with pytest.raises(TypeError, match="initial_lr"):
        schedule(None, 0.5)
    with pytest.raises(TypeError, match="multiplier must be a number or a function"):
        schedule(0.1, "fast")
    with pytest.raises(ValueError, match="start_epoch must be 0 or more"):
        schedule(0.1, 0.5, start_epoch=-1)
    with pytest.raises(ValueError, match="end_epoch"):
        schedule(0.1, 0.5, start_epoch=2.5, end_epoch=2.5)
    with pytest.raises(ValueError, match="steps_per_epoch must be a whole number"):
        schedule(0.1, 0.5, steps_per_epoch=2.5)
    with pytest.raises(TypeError, match="warmup_epochs"):
        warmup(0.1, warmup_epochs="5")
    with pytest.raises(ValueError, match="warmup_epochs must be a positive number; got 0"):
        warmup(0.1, warmup_epochs=0)


# -- SyncBatchNormalization --------------------------------------------------------------------


def test_sync_batch_norm_is_batch_norm_on_one_process_and_saves(tmp_path):
    x = np.random.default_rng(1).normal(size=(16, 3)).astype("float32") * 2 + 1
    sync = kdist.SyncBatchNormalization(momentum=0.5)
    plain = keras.layers.BatchNormalization(momentum=0.5)
    for training in (True, False):
        np.testing.assert_allclose(sync(x, training=training), plain(x, training=training),
                                   rtol=1e-6, atol=1e-6)
    model = keras.Sequential([keras.Input((3,)), kdist.SyncBatchNormalization(epsilon=0.01)])
    model.save(tmp_path / "bn.keras")
    loaded = keras.models.load_model(tmp_path / "bn.keras").layers[0]
    assert type(loaded) is kdist.SyncBatchNormalization and loaded.epsilon == 0.01
    assert "synchronized" not in loaded.get_config()
    with pytest.raises(ValueError, match="fused=True"):
        kdist.SyncBatchNormalization(fused=True)
    with pytest.raises(ValueError, match="always synchronizes"):
        kdist.SyncBatchNormalization(synchronized=True)


def test_tensor_reducer_scales_in_a_world_of_one_as_allreduce_does():
    reducer = kdist.comm.TensorReducer(prescale_factor=0.5, postscale_factor=3.0)
    scaled, missing = reducer([tf.constant([2.0]), None])
    assert scaled.numpy().tolist() == [3.0] and missing is None
    assert float(kdist.allreduce(tf.constant([2.0]), prescale_factor=0.5,
                                 postscale_factor=3.0)[0]) == 3.0
    with pytest.raises(ValueError, match="more than one group"):
        kdist.comm.TensorReducer(groups=[[0, 1], [1]])


TENSORBOARD_SCRIPT = """
import glob, os, sys, time
import keras, numpy as np, tensorflow as tf
import kdist
from workers.common import report

kdist.init()
log_dir = sys.argv[1]


class Straggle(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if kdist.rank() == 1:
            time.sleep(0.05)


model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
model.compile(kdist.DistributedOptimizer(keras.optimizers.SGD(0.01)), "mse")
board = kdist.callbacks.TensorBoard(log_dir)
model.fit(np.ones((64, 4)), np.ones((64, 1)), batch_size=8, epochs=2, verbose=0,
          callbacks=[Straggle(), board, kdist.callbacks.BroadcastGlobalVariablesCallback(0)])
kdist.barrier()
scalars = {}
for path in glob.glob(os.path.join(log_dir, "train", "events.*")):
    for event in tf.compat.v1.train.summary_iterator(path):
        for value in event.summary.value:
            if value.tag.startswith(("step_time/", "epoch_")):
                scalars.setdefault(value.tag, []).append(float(tf.make_ndarray(value.tensor)))
report({"files": len(glob.glob(os.path.join(log_dir, "**", "events.*"), recursive=True)),
        "scalars": scalars, "mine": board.last_step_times})
"""


@pytest.mark.mpi
def test_tensorboard_is_written_once_with_every_ranks_step_time(mpirun, tmp_path):
    job = mpirun(TENSORBOARD_SCRIPT, n=2, args=[tmp_path / "logs"], timeout=180)
    report = job.results[0]
    assert report["files"] == 1  # rank 0's train writer only
    scalars = report["scalars"]
    assert len(scalars["step_time/rank_0"]) == len(scalars["step_time/rank_1"]) == 2
    assert "epoch_loss" in scalars
    # Rank 1 sleeps 50 ms after each step; allreduce makes rank 0 wait for it in the next.
    assert min(scalars["step_time/rank_1"]) > 0.04
    assert all(ratio >= 1.0 for ratio in scalars["step_time/slowest_over_fastest"])
    assert job.results[1]["mine"] == report["mine"]
