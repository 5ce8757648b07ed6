"""Fixed-point quantization-aware training and its hls4ml firmware (kdist.sparsity)."""

import shutil

import keras
import numpy as np
import pytest

from kdist import sparsity
from kdist.sparsity import fixed
from kdist.sparsity.fixed import FixedType, exact_type, range_type


def _jets(rows=1500, seed=0):
    """16 features, 5 classes: a small stand-in for the jet-tagging trigger task."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 16)).astype("float32")
    y = (x[:, :5] * 2 + x[:, 5:10] ** 2).argmax(1)
    return x, y


def _trained(model, bits, epochs=3, callbacks=(), prune_to=None):
    if prune_to is not None:
        model = sparsity.prune(model, sparsity.ConstantSparsity(prune_to, 0, frequency=5))
    qmodel = sparsity.quantize(model, bits=bits, fixed_point=True)
    qmodel.compile(keras.optimizers.Adam(3e-3),
                   keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = _jets()
    qmodel.fit(x, y, epochs=epochs, batch_size=64, verbose=0, callbacks=list(callbacks))
    return qmodel, x


def _mlp(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((16,)),
                             keras.layers.Dense(24, activation="relu", name="fc1"),
                             keras.layers.Dense(12, activation="relu", name="fc2"),
                             keras.layers.Dense(5, name="logits")])


def _on_grid(values, kind):
    values = np.asarray(values, np.float64)
    codes = values / kind.step
    return (np.all(codes == np.rint(codes)) and values.min() >= kind.smallest
            and values.max() <= kind.largest)


# Grids -----------------------------------------------------------------------------------

def test_fixed_types_hold_exactly_the_values_they_are_made_for():
    rng = np.random.default_rng(1)
    for _ in range(20):
        values = rng.integers(-300, 300, size=50) * 2.0 ** rng.integers(-9, 3)
        kind = exact_type(values)
        assert _on_grid(values, kind)
        narrower = FixedType(kind.width - 1, kind.integer - 1)
        assert not _on_grid(values, narrower) or np.all(values == 0)
    with pytest.raises(ValueError, match="fixed_point=True"):
        exact_type([0.1], max_width=16)


def test_range_types_cover_the_range_with_the_given_bits():
    for low, high, bits in [(0.0, 5.2, 8), (-0.7, 0.4, 6), (-3.0, 3.0, 4), (0.0, 0.3, 4)]:
        kind = range_type(low, high, bits)
        assert kind.width == bits and kind.signed == (low < 0)
        assert kind.largest + kind.step >= max(abs(low), high)
        # One integer bit fewer would not reach the range.
        assert (kind.largest + kind.step) / 2 < max(abs(low), high)


def test_fake_fixed_rounds_half_to_even_and_saturates_like_ap_fixed():
    kind = range_type(-1.5, 2.5, 6)  # fixed<6,3>: step 1/8, -4 .. 3.875
    values = np.array([0.0625, 0.1875, -0.0625, 5.0, -7.0, 1.3, 3.9], np.float32)
    got = keras.ops.convert_to_numpy(fixed.fake_fixed(values, np.float32(-1.5),
                                                      np.float32(2.5), 6))
    np.testing.assert_array_equal(got, kind.cast(values))
    np.testing.assert_array_equal(got, [0.0, 0.25, -0.0, 3.875, -4.0, 1.25, 3.875])


def test_fixed_point_training_keeps_weights_biases_and_outputs_on_fixed_grids():
    qmodel, x = _trained(_mlp(), bits=6, epochs=1)
    exported = sparsity.export_quantized(qmodel)
    for name, entry in exported.items():
        codes, scales = entry["kernel"]
        assert np.abs(codes).max() <= 31
        assert np.all(np.log2(scales) == np.rint(np.log2(scales)))  # powers of two
        assert exact_type(entry["bias"]).width <= 6 + 1
    first = qmodel.layers[0]
    low, high = float(first.output_min), float(first.output_max)
    hidden = keras.Model(qmodel.inputs[0], first.output).predict(x[:64], verbose=0)
    assert _on_grid(hidden, range_type(low, high, 6))
    assert not _on_grid(hidden, range_type(low, high, 5))
    assert qmodel.get_config()["layers"][1]["config"]["fixed_point"] is True


def test_a_fixed_point_model_round_trips_through_keras_files(tmp_path):
    qmodel, x = _trained(_mlp(), bits=4, epochs=1)
    qmodel.save(tmp_path / "q.keras")
    again = keras.models.load_model(tmp_path / "q.keras")
    np.testing.assert_array_equal(qmodel.predict(x[:50], verbose=0),
                                  again.predict(x[:50], verbose=0))
    assert all(layer.fixed_point for layer in again.layers)


# hls4ml ------------------------------------------------------------------------------------

needs_hls4ml = pytest.mark.skipif(
    shutil.which("g++") is None and shutil.which("c++") is None,
    reason="hls4ml's C++ emulation needs a C++ compiler")


@needs_hls4ml
@pytest.mark.parametrize("bits", [8, pytest.param(4, marks=pytest.mark.slow)])
def test_firmware_of_a_pruned_fixed_point_mlp_is_bit_exact(tmp_path, bits):
    pytest.importorskip("hls4ml")
    qmodel, x = _trained(_mlp(), bits=bits, prune_to=0.5,
                         callbacks=[sparsity.UpdatePruning()])
    firmware = sparsity.export_hls4ml(qmodel, tmp_path / "prj", representative_data=x)
    report = sparsity.compare_hls4ml(qmodel, firmware, x)
    assert report == {"max_abs_difference": 0.0, "bit_exact_fraction": 1.0,
                      "outputs": x.shape[0] * 5}
    # The precisions come from the training: weights and outputs are `bits` wide.
    layers = {layer.name: layer for layer in firmware.get_layers()}
    assert layers["fc1_relu"].get_output_variable().type.precision.width == bits
    assert layers["logits"].get_output_variable().type.precision.width == bits
    assert layers["fc1"].get_weights("weight").type.precision.width <= bits + 3
    assert (tmp_path / "prj" / "firmware").is_dir()


@needs_hls4ml
def test_firmware_of_a_conv_net_with_pooling_is_bit_exact(tmp_path):
    pytest.importorskip("hls4ml")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6, 6, 1)),
                              keras.layers.Conv2D(4, 3, activation="relu", name="conv"),
                              keras.layers.MaxPooling2D(2), keras.layers.Flatten(),
                              keras.layers.Dense(2, name="logits")])
    x = np.random.default_rng(0).normal(size=(300, 6, 6, 1)).astype("float32")
    y = (x.mean((1, 2, 3)) > 0).astype("int64")
    qmodel = sparsity.quantize(model, bits=6, fixed_point=True)
    qmodel.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    qmodel.fit(x, y, epochs=2, verbose=0)
    firmware = sparsity.export_hls4ml(qmodel, tmp_path / "prj", representative_data=x)
    report = sparsity.compare_hls4ml(qmodel, firmware, x)
    assert report["bit_exact_fraction"] == 1.0, report


@needs_hls4ml
def test_firmware_export_refuses_what_it_cannot_keep_exact(tmp_path):
    pytest.importorskip("hls4ml")
    float_scales = sparsity.quantize(_mlp(), bits=8)
    with pytest.raises(ValueError, match="fixed_point=True"):
        sparsity.export_hls4ml(float_scales, tmp_path / "a", compile=False)
    normed = keras.Sequential([keras.Input((16,)), keras.layers.Dense(8, name="d"),
                               keras.layers.BatchNormalization(name="bn"),
                               keras.layers.Dense(2, name="out")])
    with pytest.raises(ValueError, match="BatchNormalization layer 'bn'"):
        sparsity.export_hls4ml(sparsity.quantize(normed, fixed_point=True), tmp_path / "b",
                               compile=False)
    softmax = keras.Sequential([keras.Input((16,)),
                                keras.layers.Dense(3, activation="softmax", name="p")])
    with pytest.warns(UserWarning, match="lookup tables"):
        sparsity.export_hls4ml(sparsity.quantize(softmax, fixed_point=True), tmp_path / "c",
                               compile=False)
    with pytest.raises(ValueError, match="fixed_point=True needs a Keras 3 model"):
        tf_keras = pytest.importorskip("tf_keras")
        sparsity.quantize(tf_keras.Sequential([tf_keras.layers.Dense(2, input_shape=(3,))]),
                          fixed_point=True)
