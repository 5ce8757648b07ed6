"""Pruning and quantization-aware training (kdist.sparsity) on one process."""

import keras
import numpy as np
import pytest

from kdist import sparsity


def _model(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((10,)), keras.layers.Dense(32, activation="relu"),
                             keras.layers.Dense(1, activation="sigmoid", name="out")])


def _task(rows=512, seed=0):
    x = np.random.default_rng(seed).normal(size=(rows, 10)).astype("float32")
    return x, (x[:, :1] + 0.5 * x[:, 1:2] > 0).astype("float32")


# Schedules ------------------------------------------------------------------------------

def test_polynomial_decay_follows_the_formula_and_prunes_on_turns_only():
    schedule = sparsity.PolynomialDecay(0.1, 0.8, begin_step=2, end_step=12, power=2,
                                        frequency=3)
    for step in range(16):
        progress = min(1.0, max(0.0, (step - 2) / 10))
        assert schedule.sparsity(step) == pytest.approx(0.8 + (0.1 - 0.8) * (1 - progress) ** 2)
    assert [s for s in range(16) if schedule.should_prune(s)] == [2, 5, 8, 11]
    assert schedule.sparsity_reached() == pytest.approx(schedule.sparsity(11))


def test_constant_sparsity_without_end_prunes_forever():
    schedule = sparsity.ConstantSparsity(0.6, begin_step=5, frequency=10)
    assert [s for s in range(40) if schedule.should_prune(s)] == [5, 15, 25, 35]
    assert [(schedule.should_prune(s), schedule.sparsity(s)) for s in (1000, 1005)] == [
        (False, 0.6), (True, 0.6)]
    bounded = sparsity.ConstantSparsity(0.6, begin_step=5, end_step=15, frequency=10)
    assert not bounded.should_prune(25)


def _tfmot():
    """tensorflow-model-optimization, imported without leaving TF_USE_LEGACY_KERAS set."""
    from importlib.util import find_spec

    if find_spec("tensorflow_model_optimization") is None:
        pytest.skip("needs tensorflow-model-optimization (extra 'tfmot')")
    return sparsity.bridge.tfmot()


def test_importing_tfmot_through_kdist_leaves_tf_keras_alone():
    import os

    _tfmot()
    assert "TF_USE_LEGACY_KERAS" not in os.environ


def test_schedules_match_tensorflow_model_optimization():
    tfmot = _tfmot()
    pairs = [
        (sparsity.PolynomialDecay(0.1, 0.8, 2, 12, power=2, frequency=3),
         tfmot.sparsity.keras.PolynomialDecay(0.1, 0.8, 2, 12, power=2, frequency=3)),
        (sparsity.ConstantSparsity(0.5, 3, end_step=20, frequency=4),
         tfmot.sparsity.keras.ConstantSparsity(0.5, 3, end_step=20, frequency=4)),
    ]
    for ours, theirs in pairs:
        for step in range(30):
            should, value = theirs(step)
            assert ours.should_prune(step) == bool(should), (ours, step)
            assert ours.sparsity(step) == pytest.approx(float(value), abs=1e-6), (ours, step)


@pytest.mark.parametrize("make, message", [
    (lambda: sparsity.PolynomialDecay(0.0, 0.5, begin_step=10, end_step=5), "end before"),
    (lambda: sparsity.ConstantSparsity(0.5, begin_step=10, end_step=3), "end before"),
    (lambda: sparsity.ConstantSparsity(1.0, 0), r"\[0, 1\)"),
    (lambda: sparsity.PolynomialDecay(-0.1, 0.5, 0, 10), r"\[0, 1\)"),
    (lambda: sparsity.PolynomialDecay(0.0, 0.5, -1, 10), "begin_step"),
    (lambda: sparsity.ConstantSparsity(0.5, 0, frequency=0), "frequency"),
    (lambda: sparsity.PolynomialDecay(0.0, 0.5, 0, 10, power=0), "power"),
])
def test_bad_schedules_say_what_is_wrong(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_block_masks_keep_or_drop_whole_blocks():
    values = np.random.default_rng(0).normal(size=(7, 10)).astype(np.float32)
    for pooling, pool in (("AVG", np.mean), ("MAX", np.max)):
        mask = sparsity.block_mask(values, 0.5, (2, 4), pooling)
        blocks = [(r, c) for r in range(0, 7, 2) for c in range(0, 10, 4)]
        kept = {}
        for r, c in blocks:
            block = mask[r:r + 2, c:c + 4]
            assert block.min() == block.max(), (pooling, r, c)  # all or nothing
            kept[(r, c)] = (block.max(), pool(np.abs(values[r:r + 2, c:c + 4])))
        # the kept blocks are the ones with the larger pooled magnitudes
        smallest_kept = min(m for k, m in kept.values() if k)
        largest_dropped = max(m for k, m in kept.values() if not k)
        assert smallest_kept >= largest_dropped
        assert sum(k for k, _ in kept.values()) == 6  # half of 12 blocks
    conv = np.random.default_rng(1).normal(size=(3, 3, 4, 8))
    np.testing.assert_array_equal(sparsity.block_mask(conv, 0.5, (2, 2)),
                                  sparsity.magnitude_mask(conv, 0.5))


@pytest.mark.parametrize("shape", [(16, 6), (3, 3, 8, 5), (5, 10, 3), (9,)])
def test_n_of_m_masks_zero_the_smallest_of_each_input_channel_group(shape):
    values = np.random.default_rng(0).normal(size=shape).astype(np.float32)
    mask = sparsity.n_of_m_mask(values, 2, 4)
    axis = -2 if len(shape) > 1 else -1
    grouped, kept = np.moveaxis(np.abs(values), axis, -1), np.moveaxis(mask, axis, -1)
    channels = grouped.shape[-1]
    for start in range(0, channels, 4):
        group, keep = grouped[..., start:start + 4], kept[..., start:start + 4]
        zeros = max(0, 2 - (4 - group.shape[-1]))  # padding counts towards the zeros
        assert np.all((keep == 0).sum(axis=-1) == zeros)
        if zeros:
            assert np.all(np.where(keep == 0, group, -np.inf).max(axis=-1)
                          <= np.where(keep == 1, group, np.inf).min(axis=-1))


def test_n_of_m_masks_match_tensorflow_model_optimization():
    import importlib

    import tensorflow as tf

    _tfmot()
    utils = importlib.import_module(
        "tensorflow_model_optimization.python.core.sparsity.keras.pruning_utils")
    for shape in ((12, 6), (3, 3, 8, 5)):
        values = np.random.default_rng(2).normal(size=shape).astype(np.float32)
        theirs = utils.m_by_n_sparsity_mask_prepare(
            utils.generate_m_by_n_mask(utils.weights_rearrange(tf.constant(values)), (2, 4)),
            tf.TensorShape(shape))
        np.testing.assert_array_equal(sparsity.n_of_m_mask(values, 2, 4), np.asarray(theirs))


def test_structured_pruning_trains_and_keeps_its_pattern():
    x, y = _task()
    for pattern, check in (
            (dict(sparsity_m_by_n=(2, 4)),
             lambda k: np.all((k.reshape(-1, 4, k.shape[1]) == 0).sum(axis=1) >= 2)),
            (dict(block_size=(2, 4)),
             lambda k: np.all([k[r:r + 2, c:c + 4].min() == k[r:r + 2, c:c + 4].max() == 0
                               or np.all(k[r:r + 2, c:c + 4] != 0)
                               for r in range(0, k.shape[0], 2)
                               for c in range(0, k.shape[1], 4)]))):
        model = keras.Sequential([keras.Input((12,)), keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dense(1, activation="sigmoid", name="out")])
        pruned = sparsity.prune(model, sparsity.ConstantSparsity(0.5, 0, frequency=4),
                                skip=["out"], **pattern)
        pruned.compile("adam", "binary_crossentropy")
        x12 = np.concatenate([x, x[:, :2]], axis=1)
        pruned.fit(x12, y, batch_size=32, epochs=1, verbose=0,
                   callbacks=[sparsity.UpdatePruning()])
        kernel = sparsity.strip(pruned).layers[0].get_weights()[0]
        assert np.mean(kernel == 0) == pytest.approx(0.5), pattern
        assert check(kernel), pattern
        config = pruned.layers[0].get_config()
        assert sparsity.PruneLowMagnitude.from_config(config).get_config() == config


@pytest.mark.parametrize("pattern, message", [
    (dict(block_size=(0, 2)), "block_size"),
    (dict(block_size=3), "block_size"),
    (dict(block_pooling_type="MEAN"), "block_pooling_type"),
    (dict(sparsity_m_by_n=(4, 4)), "0 < m < n"),
    (dict(sparsity_m_by_n=(2, 4), block_size=(2, 2)), "not both"),
])
def test_bad_patterns_say_what_is_wrong(pattern, message):
    with pytest.raises(ValueError, match=message):
        sparsity.prune(_model(), sparsity.ConstantSparsity(0.5, 0), **pattern)


def test_magnitude_mask_keeps_the_largest_weights():
    values = np.array([0.3, -0.1, 2.0, -5.0, 0.05, 0.7, 0.0, 1.5], dtype=np.float32)
    mask = sparsity.magnitude_mask(values, 0.75)
    assert mask.tolist() == [0, 0, 1, 1, 0, 0, 0, 0]
    assert sparsity.magnitude_mask(values, 0.0).sum() == 8
    assert sparsity.magnitude_mask(values, 0.99).tolist() == [0, 0, 0, 1, 0, 0, 0, 0]


# Pruning --------------------------------------------------------------------------------

@pytest.mark.parametrize("layer, shape", [
    (lambda: keras.layers.Dense(24), (10,)),
    (lambda: keras.layers.Conv1D(8, 3), (12, 3)),
    (lambda: keras.layers.Conv2D(8, 3), (8, 8, 2)),
    (lambda: keras.layers.Conv3D(4, 2), (5, 5, 5, 1)),
    (lambda: keras.layers.DepthwiseConv2D(3, depth_multiplier=4), (8, 8, 3)),
    (lambda: keras.layers.SeparableConv2D(8, 3), (8, 8, 3)),
    (lambda: keras.layers.Embedding(20, 6), (5,)),
])
def test_each_layer_kind_reaches_the_schedule_sparsity(layer, shape):
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input(shape), layer(), keras.layers.Flatten(),
                              keras.layers.Dense(1, name="head")])
    schedule = sparsity.PolynomialDecay(0.0, 0.7, begin_step=0, end_step=8, frequency=2)
    pruned = sparsity.prune(model, schedule, skip=["head"])
    assert [type(l).__name__ for l in pruned.layers][0] == "PruneLowMagnitude"
    pruned.compile(keras.optimizers.Adam(1e-2), "mse")
    x = np.random.default_rng(0).normal(size=(64,) + shape).astype("float32")
    if isinstance(pruned.layers[0].base_layer, keras.layers.Embedding):
        x = np.random.default_rng(0).integers(0, 20, size=(64,) + shape)
    history = pruned.fit(x, x.reshape(64, -1)[:, :1], batch_size=8, epochs=2, verbose=0,
                         callbacks=[sparsity.UpdatePruning()])
    name = pruned.layers[0].base_layer.name
    reached = sparsity.sparsity_of(pruned)[name]
    kernel_size = int(np.prod(pruned.layers[0].kernel.shape))
    assert reached == pytest.approx(0.7, abs=1.0 / kernel_size + 1e-9)
    assert history.history[f"sparsity/{name}"][-1] == reached
    assert "head" not in sparsity.sparsity_of(pruned)
    mask = keras.ops.convert_to_numpy(pruned.layers[0].mask)
    effective = keras.ops.convert_to_numpy(pruned.layers[0].effective_kernel())
    assert np.all(effective[mask == 0] == 0) and np.mean(mask == 0) == reached


def test_pruned_weights_stay_zero_between_mask_updates():
    x, y = _task()
    pruned = sparsity.prune(_model(), sparsity.ConstantSparsity(0.5, 0, frequency=1000))
    pruned.compile(keras.optimizers.Adam(1e-2), "binary_crossentropy")
    pruned.fit(x, y, batch_size=32, epochs=2, verbose=0, callbacks=[sparsity.UpdatePruning()])
    wrapper = pruned.layers[0]
    mask = keras.ops.convert_to_numpy(wrapper.mask)
    # One mask update at step 0; 31 optimizer steps later the layer still computes with zeros.
    assert mask.mean() == pytest.approx(0.5, abs=0.01)
    effective = keras.ops.convert_to_numpy(wrapper.effective_kernel())
    assert np.all(effective[mask == 0] == 0)


def test_stripped_model_predicts_exactly_what_the_pruned_model_did():
    x, y = _task()
    pruned = sparsity.prune(_model(), sparsity.PolynomialDecay(0.2, 0.9, 0, 20, frequency=5))
    pruned.compile("adam", "binary_crossentropy")
    pruned.fit(x, y, batch_size=32, epochs=2, verbose=0, callbacks=[sparsity.UpdatePruning()])
    plain = sparsity.strip(pruned)
    assert [type(l).__name__ for l in plain.layers] == ["Dense", "Dense"]
    assert [l.name for l in plain.layers] == [pruned.layers[0].base_layer.name, "out"]
    np.testing.assert_array_equal(plain.predict(x, verbose=0), pruned.predict(x, verbose=0))
    assert np.mean(plain.layers[0].get_weights()[0] == 0) == pytest.approx(0.9, abs=0.01)


def test_prune_copies_the_weights_and_a_dense_schedule_changes_nothing():
    x, y = _task()
    model = _model()
    pruned = sparsity.prune(model, sparsity.ConstantSparsity(0.0, 0))
    np.testing.assert_array_equal(pruned.predict(x, verbose=0), model.predict(x, verbose=0))
    reference = _model()
    for m in (pruned, reference):
        m.compile(keras.optimizers.SGD(0.1), "binary_crossentropy")
    pruned.fit(x, y, batch_size=32, epochs=1, verbose=0, shuffle=False,
               callbacks=[sparsity.UpdatePruning()])
    reference.fit(x, y, batch_size=32, epochs=1, verbose=0, shuffle=False)
    np.testing.assert_allclose(pruned.predict(x, verbose=0), reference.predict(x, verbose=0),
                               atol=1e-6)


def test_functional_models_with_nested_models_are_pruned_throughout():
    inner = keras.Sequential([keras.Input((6,)), keras.layers.Dense(6, name="inner_dense")],
                             name="block")
    inputs = keras.Input((6,))
    outputs = keras.layers.Dense(2, name="top")(inner(inputs))
    model = keras.Model(inputs, outputs)
    pruned = sparsity.prune(model, sparsity.ConstantSparsity(0.5, 0))
    assert sorted(w.base_layer.name for w in sparsity.pruned_layers(pruned)) == [
        "inner_dense", "top"]


def test_a_wrapped_layer_works_inside_a_subclassed_model():
    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.hidden = sparsity.prune(keras.layers.Dense(16, activation="relu"),
                                         sparsity.ConstantSparsity(0.75, 0, frequency=1))
            self.out = keras.layers.Dense(1)

        def call(self, x):
            return self.out(self.hidden(x))

    x, y = _task(rows=64)
    net = Net()
    net.compile("adam", "mse")
    net.fit(x, y, epochs=1, verbose=0, callbacks=[sparsity.UpdatePruning()])
    assert list(sparsity.sparsity_of(net).values()) == [pytest.approx(0.75, abs=0.01)]
    with pytest.raises(TypeError, match="subclassed"):
        sparsity.prune(Net(), sparsity.ConstantSparsity(0.5, 0))


def test_pruned_model_saves_and_loads_with_its_masks(tmp_path):
    x, y = _task()
    pruned = sparsity.prune(_model(), sparsity.PolynomialDecay(0.0, 0.6, 0, 10, frequency=2))
    pruned.compile("adam", "binary_crossentropy")
    pruned.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[sparsity.UpdatePruning()])
    path = tmp_path / "pruned.keras"
    pruned.save(path)
    loaded = keras.models.load_model(path)
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), pruned.predict(x, verbose=0))
    assert loaded.layers[0].schedule.get_config() == pruned.layers[0].schedule.get_config()
    assert sparsity.sparsity_of(loaded) == sparsity.sparsity_of(pruned)


def test_resumed_training_continues_the_schedule_from_the_optimizer_step(tmp_path):
    x, y = _task()
    schedule = sparsity.PolynomialDecay(0.0, 0.8, begin_step=0, end_step=32, frequency=4)
    pruned = sparsity.prune(_model(), schedule)
    pruned.compile("adam", "binary_crossentropy")
    pruned.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[sparsity.UpdatePruning()])
    (first,) = sparsity.sparsity_of(pruned)[pruned.layers[0].base_layer.name],
    pruned.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[sparsity.UpdatePruning()])
    assert first == pytest.approx(schedule.sparsity(12), abs=0.01)
    assert list(sparsity.sparsity_of(pruned).values())[0] == pytest.approx(0.8, abs=0.01)


def test_the_schedule_goes_on_after_quantizing_with_a_new_optimizer():
    x, y = _task()
    schedule = sparsity.PolynomialDecay(0.0, 0.8, begin_step=0, end_step=40, frequency=5)
    pruned = sparsity.prune(_model(), schedule)
    pruned.compile("adam", "binary_crossentropy")
    pruned.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[sparsity.UpdatePruning()])
    assert int(pruned.layers[0].pruning_step.numpy()) == 16
    quantized = sparsity.quantize(pruned)
    quantized.compile("adam", "binary_crossentropy")  # its optimizer starts at step 0
    quantized.fit(x, y, batch_size=32, epochs=2, verbose=0, callbacks=[sparsity.UpdatePruning()])
    (hidden, _), name = sparsity.pruned_layers(quantized), pruned.layers[0].base_layer.name
    assert int(hidden.pruning_step.numpy()) == 48
    # Steps 16-47 include the last turn, 40; restarted at 0, the last turn would be 30.
    assert sparsity.sparsity_of(quantized)[name] == pytest.approx(schedule.sparsity(40))
    assert schedule.sparsity(30) < schedule.sparsity(40) - 0.01


def test_a_pruned_model_saved_before_layers_counted_steps_still_loads(tmp_path, monkeypatch):
    from kdist.sparsity.pruning import PruneLowMagnitude

    def mask_only(self, targets):  # what build_state made before pruning_step existed
        self.mask = self.add_weight(name="mask", shape=targets[0].shape, initializer="ones",
                                    trainable=False, dtype="float32", autocast=False)
        self.masks = [self.mask]

    with monkeypatch.context() as patch:
        patch.setattr(PruneLowMagnitude, "build_state", mask_only)
        old = sparsity.prune(_model(), sparsity.ConstantSparsity(0.5, 0))
        old.layers[0].update_mask(0.5)
        old.save(tmp_path / "old.keras")
    loaded = keras.models.load_model(tmp_path / "old.keras")
    np.testing.assert_array_equal(loaded.layers[0].mask.numpy(), old.layers[0].mask.numpy())
    assert int(loaded.layers[0].pruning_step.numpy()) == 0


def test_pruning_bad_input_raises_clear_errors():
    schedule = sparsity.ConstantSparsity(0.5, 0)
    nothing = keras.Sequential([keras.Input((4,)), keras.layers.Flatten(),
                                keras.layers.Activation("relu")])
    with pytest.raises(ValueError, match="Nothing to prune"):
        sparsity.prune(nothing, schedule)
    with pytest.raises(ValueError, match="Nothing to prune"):
        sparsity.prune(_model(), schedule, skip=[keras.layers.Dense])
    with pytest.raises(TypeError, match="schedule"):
        sparsity.prune(_model(), 0.5)
    with pytest.raises(TypeError, match="skip"):
        sparsity.prune(_model(), schedule, skip=[3])
    with pytest.raises(ValueError, match="no kernel"):
        sparsity.prune(keras.layers.Flatten(), schedule)
    plain = _model()
    plain.compile("sgd", "mse")
    with pytest.raises(ValueError, match="no layer wrapped"):
        plain.fit(*_task(rows=8), verbose=0, callbacks=[sparsity.UpdatePruning()])


# Quantization ---------------------------------------------------------------------------

@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("per_channel", [True, False])
def test_a_b_bit_kernel_has_at_most_2_to_the_b_values_per_channel(bits, per_channel):
    x, y = _task()
    qmodel = sparsity.quantize(_model(), bits=bits, per_channel=per_channel)
    qmodel.compile("adam", "binary_crossentropy")
    qmodel.fit(x, y, batch_size=64, epochs=1, verbose=0)
    wrapper = qmodel.layers[0]
    effective = keras.ops.convert_to_numpy(wrapper.effective_kernel())
    raw = keras.ops.convert_to_numpy(wrapper.kernel)
    assert not np.array_equal(effective, raw)
    for channel in range(effective.shape[-1]):
        assert len(np.unique(effective[:, channel])) <= 2 ** bits
    if not per_channel:
        assert len(np.unique(effective)) <= 2 ** bits
    codes, scales = sparsity.export_quantized(qmodel)[wrapper.base_layer.name]["kernel"]
    assert np.abs(codes).max() <= 2 ** (bits - 1) - 1
    np.testing.assert_array_equal(codes * scales, effective)


def test_quantize_array_is_symmetric_per_channel():
    values = np.array([[1.0, -0.2], [-0.5, 0.1], [0.25, 0.0]], dtype=np.float32)
    codes, scales = sparsity.quantize_array(values, bits=3)
    np.testing.assert_allclose(scales, [1.0 / 3, 0.2 / 3])
    assert codes.dtype == np.int8 and codes[:, 0].tolist() == [3, -2, 1]
    assert codes[:, 1].tolist() == [-3, 2, 0]
    assert sparsity.quantize_array(values, bits=12)[0].dtype == np.int16
    assert sparsity.quantize_array(values, bits=np.int64(8))[0].dtype == np.int8
    for bits, error in ((17, "from 2 to 16"), (1, "at least 2"), (4.5, "whole number")):
        with pytest.raises(ValueError, match=error):
            sparsity.quantize_array(values, bits=bits)


def test_fake_quantization_passes_the_gradient_straight_through():
    import tensorflow as tf

    variable = tf.Variable(np.random.default_rng(0).normal(size=(5, 3)).astype("float32"))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(sparsity.fake_quantize(variable, 4) * tf.range(3.0))
    np.testing.assert_array_equal(tape.gradient(loss, variable), np.tile([0.0, 1.0, 2.0],
                                                                         (5, 1)))


def test_quantization_aware_training_learns_and_keeps_activations_on_the_grid():
    x, y = _task(rows=1024)
    float_model, qmodel = _model(), sparsity.quantize(_model(), bits=8)
    for m in (float_model, qmodel):
        m.compile(keras.optimizers.Adam(1e-2), "binary_crossentropy", metrics=["accuracy"])
    base = float_model.fit(x, y, batch_size=32, epochs=3, verbose=0).history["accuracy"][-1]
    quant = qmodel.fit(x, y, batch_size=32, epochs=3, verbose=0).history["accuracy"][-1]
    assert quant > 0.85 and abs(quant - base) < 0.05
    # The hidden ReLU layer's outputs take at most 2**8 values, spaced evenly.
    hidden = keras.Model(qmodel.inputs, qmodel.layers[0].output)
    values = np.unique(hidden.predict(x, verbose=0))
    assert len(values) <= 256
    low, high = sparsity.export_quantized(qmodel)[qmodel.layers[0].base_layer.name][
        "output_range"]
    step = (high - low) / 255
    assert np.allclose(np.diff(values) / step, np.round(np.diff(values) / step), atol=1e-2)
    # The sigmoid head is quantised before its activation, as integer engines do.
    assert sparsity.export_quantized(qmodel)["out"]["activation_after_range"] == "sigmoid"


def test_pruning_and_quantization_combine():
    x, y = _task()
    pruned = sparsity.prune(_model(), sparsity.ConstantSparsity(0.75, 0, frequency=4))
    both = sparsity.quantize(pruned, bits=4, activations=False)
    both.compile("adam", "binary_crossentropy")
    both.fit(x, y, batch_size=32, epochs=2, verbose=0, callbacks=[sparsity.UpdatePruning()])
    wrapper = both.layers[0]
    effective = keras.ops.convert_to_numpy(wrapper.effective_kernel())
    assert np.mean(effective == 0) >= 0.75
    for channel in range(effective.shape[-1]):
        assert len(np.unique(effective[:, channel])) <= 16
    plain = sparsity.strip(both)
    np.testing.assert_array_equal(plain.predict(x, verbose=0), both.predict(x, verbose=0))


def test_quantizing_a_stripped_pruned_model_keeps_its_zeros():
    x, y = _task()
    pruned = sparsity.prune(_model(), sparsity.ConstantSparsity(0.8, 0, frequency=1000))
    pruned.compile("adam", "binary_crossentropy")
    pruned.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[sparsity.UpdatePruning()])
    qmodel = sparsity.quantize(sparsity.strip(pruned), bits=8)
    qmodel.compile(keras.optimizers.Adam(1e-2), "binary_crossentropy")
    qmodel.fit(x, y, batch_size=32, epochs=2, verbose=0)
    codes, _ = sparsity.export_quantized(qmodel)[qmodel.layers[0].base_layer.name]["kernel"]
    assert np.mean(codes == 0) >= 0.8


def test_quantized_model_saves_loads_and_exports(tmp_path):
    x, y = _task()
    qmodel = sparsity.quantize(_model(), bits=6)
    qmodel.compile("adam", "binary_crossentropy")
    qmodel.fit(x, y, batch_size=32, epochs=1, verbose=0)
    qmodel.save(tmp_path / "q.keras")
    loaded = keras.models.load_model(tmp_path / "q.keras")
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), qmodel.predict(x, verbose=0))
    exported = sparsity.export_quantized(loaded, path=tmp_path / "q.npz")
    with np.load(tmp_path / "q.npz") as stored:
        name = loaded.layers[0].base_layer.name
        np.testing.assert_array_equal(stored[f"{name}/codes"], exported[name]["kernel"][0])
        assert int(stored["out/bits"]) == 6
    plain = sparsity.strip(loaded)
    assert plain.layers[1].get_config()["activation"] == "sigmoid"


def test_quantization_bad_input_raises_clear_errors():
    with pytest.raises(ValueError, match="bits"):
        sparsity.quantize(_model(), bits=1)
    with pytest.raises(ValueError, match="bits"):
        sparsity.quantize(_model(), bits=17)
    with pytest.raises(ValueError, match="Nothing to quantize"):
        sparsity.quantize(keras.Sequential([keras.Input((3,)), keras.layers.ReLU()]))
    with pytest.raises(ValueError, match="no layer wrapped"):
        sparsity.export_quantized(_model())


# The tfmot bridge ----------------------------------------------------------------------

def test_tf_keras_models_are_handed_to_tensorflow_model_optimization():
    _tfmot()
    tf_keras = pytest.importorskip("tf_keras")
    tf_keras.utils.set_random_seed(0)
    model = tf_keras.Sequential([tf_keras.layers.Input((10,)),
                                 tf_keras.layers.Dense(16, activation="relu"),
                                 tf_keras.layers.Dense(1, activation="sigmoid")])
    pruned = sparsity.prune(model, sparsity.ConstantSparsity(0.5, 0, frequency=2))
    assert type(pruned.layers[0]).__module__.startswith("tensorflow_model_optimization")
    assert type(pruned.layers[0]).__name__ == "PruneLowMagnitude"
    pruned.compile("adam", "binary_crossentropy")
    x, y = _task(rows=64)
    pruned.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[sparsity.UpdatePruning()])
    plain = sparsity.strip(pruned)
    kernel = plain.layers[0].get_weights()[0]
    assert np.mean(kernel == 0) == pytest.approx(0.5, abs=0.02)
    qmodel = sparsity.quantize(plain)
    assert any("Quantize" in type(layer).__name__ for layer in qmodel.layers)
    with pytest.raises(ValueError, match="8 bits"):
        sparsity.quantize(plain, bits=4)


# Several ranks -------------------------------------------------------------------------

def _assert_workers_trained_with_the_masters_masks(reports):
    """The final broadcast makes every rank's masks equal; during training
    only the master's masks, sent with the weights, can."""
    final = {name: "".join(str(v) for v in mask) for name, mask in reports[0]["masks"].items()}
    for rank in (1, 2):
        steps = reports[rank]["worker_steps"]
        assert len(steps) == 16, f"rank {rank} recorded {len(steps)} steps of epoch 2"
        # The master holds the raw kernel at zero under its mask.
        for step in steps:
            assert all(layer["hidden"] == 0.0 for layer in step.values()), step
        # Each exchange is one master update. Before step 9 of its second epoch a
        # worker has made 16 + 1 + 8 = 25 exchanges, so its last reply left the
        # master after update 24, the schedule's last: from there on it holds
        # the final masks (earlier, a worker ahead of the other may not yet).
        for step in steps[8:]:
            assert {name: layer["mask"] for name, layer in step.items()} == final


@pytest.mark.mpi
@pytest.mark.parametrize("mode, n", [("hvd", 2), ("mpi", 2), ("ps", 3)])
def test_masks_are_identical_on_every_rank(mpirun, mode, n):
    job = mpirun("sparsity_train.py", n=n, args=[mode], timeout=240)
    reports = [job.rank(r) for r in range(n)]
    first = reports[0]
    for other in reports[1:]:
        assert other["masks"] == first["masks"]
        assert other["kernels"] == first["kernels"]
    for name, mask in first["masks"].items():
        assert 1 - np.mean(mask) == pytest.approx(first["expected"], abs=0.01), name
        kernel = np.array(first["kernels"][name])
        assert np.all(kernel[np.array(mask) == 0] == 0)
    assert all(r["strip_equal"] for r in reports)
    master = first["history"]
    assert master["sparsity/dense"][-1] == pytest.approx(first["expected"], abs=0.01)
    if mode == "ps":
        # The master counts its own updates (2 workers x 16 steps per epoch): the
        # schedule (end_step=24) is over after the first epoch.
        assert master["sparsity/dense"][0] == pytest.approx(first["expected"], abs=0.01)
        _assert_workers_trained_with_the_masters_masks(reports)
    else:
        assert master["sparsity/dense"][0] < first["expected"] - 0.1


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["hvd", "mpi"])
def test_quantizer_ranges_agree_on_every_rank(mpirun, mode):
    job = mpirun("sparsity_train.py", n=2, args=[mode, "--quantize", "--sync-ranges"],
                 timeout=240)
    first, second = job.rank(0), job.rank(1)
    assert len(first["ranges"]) == 2 and all(high > low for low, high in first["ranges"])
    assert second["ranges"] == first["ranges"]
    assert second["kernels"] == first["kernels"]


@pytest.mark.mpi
def test_the_parameter_server_master_prunes_a_quantised_model(mpirun):
    job = mpirun("sparsity_train.py", n=3, args=["ps", "--quantize"], timeout=240)
    reports = [job.rank(r) for r in range(3)]
    for other in reports[1:]:
        assert other["masks"] == reports[0]["masks"]
    _assert_workers_trained_with_the_masters_masks(reports)
    kernel = np.array(reports[0]["kernels"]["dense"]).reshape(12, 32)
    assert np.mean(kernel == 0) >= reports[0]["expected"] - 0.01
    for channel in range(kernel.shape[1]):
        assert len(np.unique(kernel[:, channel])) <= 16


# TFLite export -------------------------------------------------------------------------

def test_a_quantized_model_exports_to_a_tflite_model_that_is_int8_end_to_end(tmp_path):
    x, y = _task()
    model = _model()
    model.compile(keras.optimizers.Adam(1e-2), "binary_crossentropy")
    model.fit(x, y, epochs=3, verbose=0)
    qat = sparsity.quantize(sparsity.strip(model))
    qat.compile(keras.optimizers.Adam(1e-3), "binary_crossentropy")
    qat.fit(x, y, epochs=1, verbose=0)
    path = tmp_path / "model.tflite"
    flatbuffer = sparsity.export_tflite(qat, path, representative_data=x[:200])
    assert path.read_bytes() == flatbuffer
    assert [np.dtype(d) for d in sparsity.tflite_dtypes(flatbuffer)] == [np.int8, np.int8]
    ours, theirs = sparsity.run_tflite(flatbuffer, x[:100]), qat.predict(x[:100], verbose=0)
    # An int8 sigmoid output has steps of 1/256.
    assert np.abs(ours - theirs).max() < 0.05
    assert np.mean((ours > 0.5) == (theirs > 0.5)) >= 0.95
    dynamic = sparsity.export_tflite(qat, int8=False)
    assert [np.dtype(d) for d in sparsity.tflite_dtypes(dynamic)] == [np.float32, np.float32]
    with pytest.raises(ValueError, match="representative_data"):
        sparsity.export_tflite(qat)


# Keras's own int8 layers -------------------------------------------------------------------

def test_keras_int8_layers_hold_exactly_the_codes_quantization_aware_training_reached(tmp_path):
    x, y = _task()
    pruned = sparsity.prune(_model(), sparsity.ConstantSparsity(0.6, 0, frequency=4))
    qat = sparsity.quantize(pruned)
    qat.compile(keras.optimizers.Adam(1e-2), "binary_crossentropy", metrics=["accuracy"])
    qat.fit(x, y, epochs=3, verbose=0, callbacks=[sparsity.UpdatePruning()])
    int8 = sparsity.keras_int8(qat)
    codes = sparsity.export_quantized(qat)
    for layer in int8.layers:
        kernel = keras.ops.convert_to_numpy(layer._kernel)
        assert kernel.dtype == np.int8
        np.testing.assert_array_equal(kernel, codes[layer.name]["kernel"][0])
    assert np.mean(keras.ops.convert_to_numpy(int8.layers[0]._kernel) == 0) >= 0.6
    ours, theirs = int8.predict(x, verbose=0), qat.predict(x, verbose=0)
    assert np.mean((ours > 0.5) == (theirs > 0.5)) >= 0.97
    int8.save(tmp_path / "int8.keras")
    again = keras.models.load_model(tmp_path / "int8.keras")
    np.testing.assert_array_equal(again.predict(x[:20], verbose=0), int8.predict(x[:20],
                                                                              verbose=0))


def test_keras_int8_warns_about_other_grids_and_refuses_models_without_int8_layers():
    with pytest.warns(UserWarning, match="another grid"):
        sparsity.keras_int8(sparsity.quantize(_model(), bits=4))
    plain = sparsity.keras_int8(_model())  # a float model: Keras's post-training int8
    assert plain.layers[0]._kernel.dtype == "int8"
    convs = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Conv2D(2, 3)])
    with pytest.raises(ValueError, match="Dense, EinsumDense and Embedding"):
        sparsity.keras_int8(convs)
    with pytest.raises(TypeError, match="Keras 3 model"):
        sparsity.keras_int8(keras.layers.Dense(2))


@pytest.mark.parametrize("kind", ["LSTM", "GRU", "SimpleRNN", "Bidirectional"])
def test_recurrent_layers_have_their_input_and_recurrent_kernels_pruned(kind, tmp_path):
    recurrent = (keras.layers.Bidirectional(keras.layers.LSTM(6), name="rnn")
                 if kind == "Bidirectional" else getattr(keras.layers, kind)(6, name="rnn"))
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((5, 3)), recurrent, keras.layers.Dense(1, name="out")])
    x = np.random.default_rng(0).normal(size=(64, 5, 3)).astype("float32")
    y = x[:, -1, :1]
    pruned = sparsity.prune(model, sparsity.PolynomialDecay(0.0, 0.75, 0, 8, frequency=2),
                            skip=["out"])
    wrapper = pruned.layers[0]
    assert isinstance(wrapper, sparsity.PruneLowMagnitude)
    pruned.compile(keras.optimizers.Adam(1e-2), "mse")
    pruned.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[sparsity.UpdatePruning()])
    kernels = 4 if kind == "Bidirectional" else 2
    assert len(wrapper.targets) == len(wrapper.masks) == kernels
    assert {v.path.rsplit("/", 1)[-1] for v in wrapper.targets} == {"kernel",
                                                                   "recurrent_kernel"}
    for index in range(kernels):
        effective = keras.ops.convert_to_numpy(wrapper.effective_kernel(False, index))
        assert np.mean(effective == 0) == pytest.approx(0.75, abs=0.05)  # 18 weights at least
    assert sparsity.sparsity_of(pruned)["rnn"] == pytest.approx(0.75, abs=0.05)
    # Reloaded, and stripped: the zeros stay, and the predictions with them.
    pruned.save(tmp_path / "rnn.keras")
    again = keras.models.load_model(tmp_path / "rnn.keras")
    plain = sparsity.strip(pruned)
    for other in (again, plain):
        np.testing.assert_allclose(other.predict(x, verbose=0), pruned.predict(x, verbose=0),
                                   atol=1e-6)
    stripped = [w for w in plain.layers[0].weights if w.path.endswith("kernel")]
    assert all(np.mean(keras.ops.convert_to_numpy(w) == 0) > 0.7 for w in stripped)


def test_quantize_leaves_recurrent_layers_in_float_and_says_so():
    model = keras.Sequential([keras.Input((5, 3)), keras.layers.LSTM(4, name="lstm"),
                              keras.layers.Dense(2, name="out")])
    with pytest.warns(UserWarning, match=r"layers \['lstm'\]"):
        quantized = sparsity.quantize(model)
    assert [type(layer).__name__ for layer in quantized.layers] == ["LSTM", "QuantizeAware"]
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sparsity.quantize(model, skip=["lstm"])
    assert not [w for w in caught if "recurrent" in str(w.message)]
    with pytest.raises(ValueError, match="one kernel per layer"):
        sparsity.QuantizeAware(keras.layers.LSTM(4))(np.ones((1, 5, 3), "float32"))


def test_a_pruning_wrapper_takes_tfmots_arguments_and_reads_step_minus_1_untrained():
    dense = keras.layers.Dense(3)
    with pytest.raises(ValueError, match="block_pooling_type"):
        sparsity.PruneLowMagnitude(dense, block_pooling_type="MIN")
    wrapper = sparsity.PruneLowMagnitude(dense, block_pooling_type="MAX")  # tfmot's default
    assert wrapper.pruning_schedule.get_config() == \
        sparsity.ConstantSparsity(0.5, begin_step=0).get_config()
    schedule = sparsity.ConstantSparsity(0.8, begin_step=0)
    wrapper = sparsity.PruneLowMagnitude(dense, pruning_schedule=schedule)
    assert wrapper.schedule is schedule
    with pytest.raises(TypeError, match="once"):
        sparsity.PruneLowMagnitude(dense, schedule, pruning_schedule=schedule)
    model = keras.Sequential([keras.Input((4,)), wrapper])
    model(np.ones((2, 4), "float32"))  # inference is no training step
    assert int(wrapper.pruning_step.numpy()) == -1


def test_a_marked_layer_is_called_with_what_its_mark_is_called_with():
    class TrainingOnly(keras.layers.Layer):
        seen = None

        def call(self, training=None):  # takes no inputs
            self.seen = training

    layer = TrainingOnly()
    mark = sparsity.QuantizeAnnotate(layer)
    mark.call(training=True)
    assert layer.seen is True
    mark.call(training=False)
    assert layer.seen is False
