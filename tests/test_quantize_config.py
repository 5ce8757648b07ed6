"""Quantisation chosen per layer: QuantizeConfig, quantizers, QuantizeWithConfig.

The flows are those of tfmot's "experiment with quantization" guide
(custom configs, custom layers, other bit widths, custom quantizers),
on Keras 3 layers through `kdist.tfmot`.
"""

import keras
import numpy as np
import pytest

import kdist
import kdist.tfmot as tfmot
from kdist.sparsity import (AllValuesQuantizer, LastValueQuantizer, MovingAverageQuantizer,
                            QuantizeConfig)

qk = tfmot.quantization.keras


class KernelOnly(QuantizeConfig):
    """A Dense kernel through a given quantizer; activations left in float."""

    def __init__(self, bits=4):
        self.bits = bits

    def get_weights_and_quantizers(self, layer):
        return [(layer.kernel, LastValueQuantizer(self.bits, False, True, False))]

    def get_activations_and_quantizers(self, layer):
        return []

    def set_quantize_activations(self, layer, quantize_activations):
        pass

    def get_output_quantizers(self, layer):
        return []

    def get_config(self):
        return {"bits": self.bits}


class DenseAsTfmot(KernelOnly):
    """tfmot's default for Dense: 8-bit kernel, output after the activation."""

    def __init__(self, bits=8):
        super().__init__(bits)

    def get_activations_and_quantizers(self, layer):
        return [(layer.activation, MovingAverageQuantizer(8, False, False, False))]

    def set_quantize_weights(self, layer, quantize_weights):
        # As tfmot's guide writes it; a Keras 3 Dense's kernel cannot be set, so this
        # raises if it is ever called.
        layer.kernel = quantize_weights[0]

    def set_quantize_activations(self, layer, quantize_activations):
        layer.activation = quantize_activations[0]


class Clip(qk.quantizers.Quantizer):
    def __call__(self, inputs, training, weights, **kwargs):
        return keras.ops.clip(inputs, -0.1, 0.1)


class ClipKernel(KernelOnly):
    def get_weights_and_quantizers(self, layer):
        return [(layer.kernel, Clip())]


class ScaledDense(keras.layers.Dense):
    """A user's layer: tfmot knows it only through a QuantizeConfig."""


def _data(rows=256, seed=0):
    x = np.random.default_rng(seed).normal(size=(rows, 10)).astype("float32")
    return x, (x[:, 0] + 0.5 * x[:, 1] > 0).astype("int64")


def _annotated(config, first=keras.layers.Dense, activation="relu", seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((10,)),
        qk.quantize_annotate_layer(first(16, activation=activation, name="hidden"), config),
        keras.layers.Dense(2, name="head")])


def _fit(model, epochs=3):
    model.compile(keras.optimizers.Adam(0.01),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    x, y = _data()
    model.fit(x, y, batch_size=32, epochs=epochs, verbose=0)
    return model


def _kernel_seen(model, name):
    """The kernel layer `name` computes with, read off its outputs (bias and activation
    removed): row i of the kernel is the layer's answer to the i-th unit vector."""
    layer = model.get_layer(name)
    probe = keras.Sequential([keras.Input((10,)), layer])
    eye = np.eye(10, dtype="float32")
    return probe.predict(eye, verbose=0) - probe.predict(np.zeros_like(eye), verbose=0)


def test_a_config_chooses_the_bit_width_of_a_kernel():
    annotated = _annotated(KernelOnly(bits=4), activation=None)
    with qk.quantize_scope({"KernelOnly": KernelOnly}):
        model = _fit(qk.quantize_apply(annotated))
    wrapper = model.get_layer("quant_hidden")
    assert isinstance(wrapper, kdist.sparsity.QuantizeWithConfig)
    assert isinstance(wrapper, qk.QuantizeWrapper)
    seen = _kernel_seen(model, "quant_hidden")
    kernel = keras.ops.convert_to_numpy(wrapper.layer.kernel)
    assert len(np.unique(np.round(seen, 6))) <= 16  # 4 bits
    step = (kernel.max() - kernel.min()) / 15
    assert np.max(np.abs(seen - kernel)) <= step  # near the float kernel
    assert not np.allclose(seen, kernel)  # and not the float kernel itself
    # The head was not annotated: it stays a plain Dense.
    assert type(model.get_layer("head")) is keras.layers.Dense


def test_a_tfmot_style_dense_config_trains_and_tracks_its_output_range():
    with qk.quantize_scope({"DenseAsTfmot": DenseAsTfmot}):
        model = qk.quantize_apply(_annotated(DenseAsTfmot()))
    wrapper = model.get_layer("quant_hidden")
    before = {v.name: float(v.numpy()) for v in wrapper.non_trainable_weights
              if v.name.startswith("post_activation")}
    assert before == {"post_activation_min": -6.0, "post_activation_max": 6.0}
    history = _fit(model).history.history
    assert history["accuracy"][-1] > 0.75  # chance is 0.5
    after = {v.name: float(v.numpy()) for v in wrapper.non_trainable_weights
             if v.name.startswith("post_activation")}
    # A moving average with decay 0.999 from [-6, 6] towards a ReLU's [0, max]: the lower
    # end rises towards 0 after 24 steps, but slowly.
    assert -6.0 < after["post_activation_min"] < -5.5
    # The kernel's own range follows the last batch's weights.
    kernel = keras.ops.convert_to_numpy(wrapper.layer.kernel)
    ranges = {v.name: v.numpy() for v in wrapper.non_trainable_weights}
    assert ranges["kernel_max"] == pytest.approx(np.abs(kernel).max(), rel=0.02)


def test_custom_layers_need_a_config_as_in_tfmot():
    def annotated_custom():
        return qk.quantize_annotate_model(keras.Sequential([
            keras.Input((10,)), ScaledDense(4, name="mine")]))

    # Unknown to Keras, the layer is refused first for that: the model cannot be copied.
    with pytest.raises(ValueError, match="not known to Keras, so the model cannot be copied"):
        qk.quantize_apply(annotated_custom())
    with qk.quantize_scope({"ScaledDense": ScaledDense}):
        with pytest.raises(RuntimeError, match="QuantizeConfig"):
            qk.quantize_apply(annotated_custom())
        with pytest.raises(RuntimeError, match="is not supported"):
            qk.quantize_model(keras.Sequential([keras.Input((10,)), ScaledDense(4)]))
    annotated = _annotated(DenseAsTfmot(), first=ScaledDense)
    with qk.quantize_scope({"DenseAsTfmot": DenseAsTfmot, "ScaledDense": ScaledDense}):
        model = qk.quantize_apply(qk.quantize_annotate_model(annotated))
    assert isinstance(model.get_layer("quant_hidden").layer, ScaledDense)
    # The head was annotated without a config: kdist's own scheme quantises it.
    assert isinstance(model.get_layer("quant_head"), kdist.sparsity.QuantizeAware)
    assert _fit(model, epochs=2).history.history["loss"][-1] < 0.5


def test_a_custom_quantizer_is_applied_to_the_weights():
    with qk.quantize_scope({"ClipKernel": ClipKernel, "Clip": Clip}):
        model = _fit(qk.quantize_apply(_annotated(ClipKernel(), activation=None)), epochs=1)
    seen = _kernel_seen(model, "quant_hidden")
    kernel = keras.ops.convert_to_numpy(model.get_layer("quant_hidden").layer.kernel)
    np.testing.assert_allclose(seen, np.clip(kernel, -0.1, 0.1), atol=1e-5)
    assert np.abs(kernel).max() > 0.1  # the float kernel itself is not clipped


def test_a_model_with_configs_saves_and_loads_in_the_scope(tmp_path):
    scope = {"DenseAsTfmot": DenseAsTfmot}
    with qk.quantize_scope(scope):
        model = _fit(qk.quantize_apply(_annotated(DenseAsTfmot())), epochs=1)
    x, _ = _data(32, seed=1)
    expected = model.predict(x, verbose=0)
    path = tmp_path / "qat.keras"
    model.save(path)
    with qk.quantize_scope(scope):
        loaded = keras.models.load_model(path)
    np.testing.assert_allclose(loaded.predict(x, verbose=0), expected, rtol=1e-5, atol=1e-6)
    # Saved with its plain activation; the loaded layer quantises it again.
    saved = loaded.get_layer("quant_hidden").get_config()
    assert saved["layer"]["config"]["activation"] == "relu"
    assert type(loaded.get_layer("quant_hidden").layer.activation).__name__ == (
        "QuantizeAwareActivation")


def test_quantize_model_layers_answer_to_tfmot_wrapper_names_and_prefixes():
    keras.utils.set_random_seed(0)
    plain = keras.Sequential([keras.Input((10,)), keras.layers.Dense(4, name="d")])
    model = qk.quantize_model(plain)
    assert model.layers[0].name == "quantize_layer"  # the input's quantizer
    assert isinstance(model.layers[1], qk.QuantizeWrapper)
    assert isinstance(model.layers[1], qk.QuantizeWrapperV2)
    assert not isinstance(keras.layers.Dense(2), qk.QuantizeWrapper)
    assert model.layers[1].name == "quant_d"
    assert qk.quantize_model(plain, quantized_layer_name_prefix="q8_").layers[1].name == "q8_d"
    annotated = qk.quantize_annotate_model(plain)
    assert qk.quantize_apply(annotated, quantized_layer_name_prefix=None).layers[1].name == "d"
    assert kdist.sparsity.quantize(plain).layers[0].name == "quantized_d"


def test_configs_that_name_what_is_not_there_are_refused():
    class Foreign(KernelOnly):
        def get_weights_and_quantizers(self, layer):
            return [(keras.Variable(np.zeros((10, 16), "float32")),
                     LastValueQuantizer(8, False, True, False))]

    with pytest.raises(ValueError, match="must name variables of"):
        kdist.sparsity.QuantizeWithConfig(keras.layers.Dense(16), Foreign()).build((None, 10))

    class OddActivation(DenseAsTfmot):
        def get_activations_and_quantizers(self, layer):
            return [(lambda x: x * 2, MovingAverageQuantizer(8, False, False, False))]

    with pytest.raises(ValueError, match="cannot be quantised by name"):
        kdist.sparsity.QuantizeWithConfig(keras.layers.Dense(16), OddActivation()).build(
            (None, 10))
    with pytest.raises(TypeError, match="must be a QuantizeConfig"):
        kdist.sparsity.QuantizeWithConfig(keras.layers.Dense(4), object())
    with pytest.raises(TypeError, match="kdist.sparsity.QuantizeConfig"):
        kdist.sparsity.quantize_annotate_layer(keras.layers.Dense(4), quantize_config="8bit")
    with pytest.raises(ValueError, match="QuantizeConfig instance"):  # tfmot's type
        qk.quantize_annotate_layer(keras.layers.Dense(4), quantize_config=object())
    with pytest.raises(ValueError, match="cannot be None"):
        kdist.sparsity.QuantizeWithConfig(keras.layers.Dense(4), None)
    with pytest.raises(TypeError, match="abstract"):
        QuantizeConfig()


@pytest.mark.parametrize("bits", [1, 17, 2.5])
def test_quantizers_refuse_bit_widths_they_cannot_hold(bits):
    with pytest.raises((ValueError, TypeError), match="num_bits"):
        LastValueQuantizer(bits, False, False, False)


def _ranges(quantizer, batches, shape=(4,)):
    holder = keras.layers.Layer()
    variables = quantizer.build(shape, "t", holder)
    for batch in batches:
        quantizer(keras.ops.convert_to_tensor(np.asarray(batch, "float32")), True, variables)
    return (keras.ops.convert_to_numpy(variables["min_var"]),
            keras.ops.convert_to_numpy(variables["max_var"]))


def test_the_three_quantizers_move_their_ranges_as_documented():
    batches = [[-1.0, 0.5, 2.0, 1.0], [0.5, 0.25, 1.0, 0.75]]
    # Last value: the last batch's range, widened to hold zero.
    low, high = _ranges(LastValueQuantizer(8, False, False, False), batches)
    assert (low, high) == (0.0, 1.0)
    # All values: the widest range since [0, 0].
    low, high = _ranges(AllValuesQuantizer(8, False, False, False), batches)
    assert (low, high) == (-1.0, 2.0)
    # Moving average: 0.1 % of the way from [-6, 6] per batch.
    low, high = _ranges(MovingAverageQuantizer(8, False, False, False), batches[:1])
    assert low == pytest.approx(-6 * 0.999 - 0.001) and high == pytest.approx(6 * 0.999 + 0.002)
    # Symmetric: centred on zero, one extra step below it unless narrow.
    low, high = _ranges(LastValueQuantizer(8, False, True, False), batches[:1])
    assert high == 2.0 and low == pytest.approx(-2.0 * 256 / 254)
    low, high = _ranges(LastValueQuantizer(8, False, True, True), batches[:1])
    assert (low, high) == (-2.0, 2.0)
    # Per axis: one range per entry of the last axis.
    low, high = _ranges(LastValueQuantizer(8, True, False, False),
                        [[[1.0, -2.0], [3.0, 4.0]]], shape=(2, 2))
    assert low.tolist() == [0.0, -2.0] and high.tolist() == [3.0, 4.0]


def test_quantizers_round_to_their_grid_and_compare_by_config():
    quantizer = LastValueQuantizer(3, False, False, False)
    holder = keras.layers.Layer()
    variables = quantizer.build((5,), "t", holder)
    values = np.array([0.0, 0.3, 1.0, 2.2, 7.0], "float32")
    quantized = keras.ops.convert_to_numpy(quantizer(values, True, variables))
    # 3 bits over [0, 7]: steps of 1.
    assert quantized.tolist() == [0.0, 0.0, 1.0, 2.0, 7.0]
    assert quantizer == LastValueQuantizer(3, False, False, False)
    assert quantizer != LastValueQuantizer(4, False, False, False)
    assert quantizer != MovingAverageQuantizer(3, False, False, False)
    restored = keras.saving.deserialize_keras_object(
        keras.saving.serialize_keras_object(quantizer))
    assert restored == quantizer


def test_marked_layers_without_weights_beside_configured_ones():
    annotated = qk.quantize_annotate_model(keras.Sequential([
        keras.Input((10,)),
        qk.quantize_annotate_layer(keras.layers.Dense(8, name="hidden"), DenseAsTfmot()),
        keras.layers.Flatten(name="flat")]))
    with qk.quantize_scope({"DenseAsTfmot": DenseAsTfmot}):
        model = qk.quantize_apply(annotated)
        own = kdist.sparsity.quantize_apply(annotated)
    # Through kdist.tfmot, as in tfmot: wrapped, with nothing to quantise.
    assert [type(layer).__name__ for layer in model.layers] == [
        "QuantizeLayer", "QuantizeWithConfig", "QuantizeWithConfig"]
    assert model.layers[2].weights == []
    # kdist's own quantize_apply leaves it in float.
    assert [type(layer).__name__ for layer in own.layers] == ["QuantizeWithConfig", "Flatten"]


def _conv_model(seed=0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((8, 8, 3))
    x = keras.layers.Conv2D(4, 3, padding="same", name="conv")(inputs)
    x = keras.layers.ReLU(name="relu")(x)
    kept = keras.layers.MaxPooling2D(name="max")(x)
    averaged = keras.layers.AveragePooling2D(2, name="mean")(x)
    x = keras.layers.Add(name="add")([kept, averaged])
    x = keras.layers.Flatten(name="flat")(x)
    x = keras.layers.Dropout(0.1, name="drop")(x)
    outputs = keras.layers.Dense(2, name="head")(x)
    return keras.Model(inputs, outputs)


def test_quantize_model_treats_layers_without_weights_as_tfmot_does():
    model = qk.quantize_model(_conv_model())
    kinds = {layer.name: type(layer).__name__ for layer in model.layers[1:]}
    assert kinds == {"quantize_layer": "QuantizeLayer", "quant_conv": "QuantizeAware", "quant_relu": "QuantizeWithConfig",
                     "quant_max": "QuantizeWithConfig", "quant_mean": "QuantizeWithConfig",
                     "quant_add": "QuantizeWithConfig", "quant_flat": "QuantizeWithConfig",
                     "quant_drop": "QuantizeWithConfig", "quant_head": "QuantizeAware"}
    assert all(isinstance(layer, qk.QuantizeWrapper) for layer in model.layers[2:])

    def output_ranges(name):
        return sorted(v.name for v in model.get_layer(name).non_trainable_weights)

    # Values computed anew are requantised; values only moved or picked are not.
    for name in ("quant_relu", "quant_mean", "quant_add"):
        assert output_ranges(name) == ["output_max", "output_min"]
    for name in ("quant_max", "quant_flat", "quant_drop"):
        assert output_ranges(name) == []
    x = np.random.default_rng(0).random((64, 8, 8, 3)).astype("float32")
    y = (x.mean(axis=(1, 2, 3)) > 0.5).astype("int64")
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    relu = {v.name: float(v.numpy()) for v in model.get_layer("quant_relu").non_trainable_weights}
    assert -6.0 < relu["output_min"] and relu["output_max"] < 6.0  # moved towards [0, max]
    # The ReLU's output lies on its 8-bit grid at inference.
    probe = keras.Model(model.inputs, model.get_layer("quant_relu").output)
    values = probe.predict(x[:4], verbose=0)
    low, high = relu["output_min"], relu["output_max"]
    assert len(np.unique(values)) <= 256 and values.min() >= low - 1e-6
    plain = kdist.sparsity.strip(model)
    assert [type(layer).__name__ for layer in plain.layers[1:]] == [
        "QuantizeLayer", "Conv2D", "ReLU", "MaxPooling2D", "AveragePooling2D", "Add", "Flatten", "Dropout",
        "Dense"]


def test_a_model_of_weightless_layers_alone_is_quantised():
    model = qk.quantize_model(keras.Sequential([keras.Input((4,)), keras.layers.ReLU()]))
    assert [type(layer).__name__ for layer in model.layers] == [
        "QuantizeLayer", "QuantizeWithConfig"]


def test_strip_gives_configured_layers_their_quantised_weights_and_plain_activations():
    with qk.quantize_scope({"DenseAsTfmot": DenseAsTfmot}):
        model = _fit(qk.quantize_apply(_annotated(DenseAsTfmot(bits=3))), epochs=1)
    plain = kdist.sparsity.strip(model)
    hidden = plain.get_layer("hidden")
    assert type(hidden) is keras.layers.Dense and hidden.activation.__name__ == "relu"
    kernel = keras.ops.convert_to_numpy(hidden.kernel)
    assert len(np.unique(kernel)) <= 8  # 3 bits
    x, _ = _data(16, seed=2)
    # Without activation quantisation the two differ only by the output's rounding.
    np.testing.assert_allclose(plain.predict(x, verbose=0), model.predict(x, verbose=0),
                               atol=0.1)


def test_inputs_are_quantised_and_their_ranges_can_be_fixed_or_removed():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((10,), name="pixels")
    hidden = keras.layers.Dense(16, activation="relu", name="hidden")(inputs)
    outputs = keras.layers.Dense(2, activation="softmax", name="probabilities")(hidden)
    model = qk.quantize_model(keras.Model(inputs, outputs))
    reader = model.get_layer("quantize_layer")
    assert isinstance(reader, kdist.sparsity.QuantizeLayer)
    assert isinstance(reader.quantizer, AllValuesQuantizer)
    x = np.random.default_rng(0).random((64, 10)).astype("float32") * 4 - 1
    y = (x[:, 0] > x[:, 1]).astype("int64")
    model.compile("adam", "sparse_categorical_crossentropy")
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    seen = {v.name: float(v.numpy()) for v in reader.weights}
    assert seen["quantize_layer_min"] == pytest.approx(x.min(), abs=1e-6)
    assert seen["quantize_layer_max"] == pytest.approx(x.max(), abs=1e-6)

    fixed = qk.fix_input_output_range(model, num_bits=4, input_min=0.0, input_max=15.0,
                                      output_min=0.0, output_max=1.0)
    grid = fixed.get_layer("quantize_layer")
    assert grid.quantizer == qk.quantizers.FixedQuantizer(4, 0.0, 15.0, False)
    head = fixed.get_layer("quant_probabilities")
    assert head.output_range == (0.0, 1.0)
    # Weights are carried over; inputs now land on the integers 0..15.
    np.testing.assert_array_equal(head.get_weights()[0],
                                  model.get_layer("quant_probabilities").get_weights()[0])
    probe = keras.Model(fixed.inputs, grid.output)
    np.testing.assert_array_equal(probe.predict(np.array([[-3.0, 0.4, 2.6, 7.5, 20.0] * 2]),
                                                verbose=0),
                                  [[0.0, 0.0, 3.0, 8.0, 15.0] * 2])
    fixed.compile("adam", "sparse_categorical_crossentropy")
    fixed.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert head.output_range == (0.0, 1.0) and float(head.output_max.numpy()) == 1.0

    free = qk.remove_input_range(fixed)
    assert free.get_layer("quantize_layer").quantizer is None
    probe = keras.Model(free.inputs, free.get_layer("quantize_layer").output)
    np.testing.assert_allclose(probe.predict(x[:2], verbose=0), x[:2])


def test_a_fixed_output_range_takes_its_own_bits_and_narrow_range():
    # tfmot's fix_input_output_range quantises outputs with a FixedQuantizer of its own
    # arguments: 4 bits narrow over [-7, 7] is the 15 integers -7..7 (wide: steps of 14/15).
    model = qk.quantize_model(keras.Sequential([keras.Input((3,)), keras.layers.Dense(4)]))
    fixed = qk.fix_input_output_range(model, num_bits=4, input_min=-7.0, input_max=7.0,
                                      output_min=-7.0, output_max=7.0, narrow_range=True)
    head = fixed.layers[-1]
    assert (head.output_bits, head.output_narrow_range) == (4, True)
    out = fixed.predict(np.random.default_rng(1).normal(size=(32, 3)) * 5, verbose=0)
    np.testing.assert_allclose(out, np.round(out), atol=1e-5)
    assert out.min() >= -7.0 and out.max() <= 7.0
    again = type(head).from_config(head.get_config())
    assert (again.output_bits, again.output_narrow_range) == (4, True)


def test_a_configured_output_layer_gets_the_fixed_range_through_its_config():
    with qk.quantize_scope({"DenseAsTfmot": DenseAsTfmot}):
        model = qk.quantize_apply(qk.quantize_annotate_model(keras.Sequential([
            keras.Input((10,)), keras.layers.Dense(8, name="hidden"),
            qk.quantize_annotate_layer(keras.layers.Dense(2, activation="relu", name="out"),
                                       DenseAsTfmot())])))
        fixed = qk.fix_input_output_range(model, output_min=0.0, output_max=4.0)
    config = fixed.get_layer("quant_out").quantize_config
    assert config.fixed == qk.quantizers.FixedQuantizer(8, 0.0, 4.0, False)
    assert config.get_activations_and_quantizers(fixed.get_layer("quant_out").layer)[0][1] == (
        config.fixed)
    # Its ReLU's output never leaves [0, 4], whatever the inputs.
    big = np.full((2, 10), 100.0, "float32")
    assert fixed.predict(big, verbose=0).max() <= 4.0


def test_range_edits_need_a_quantised_model_and_a_real_range():
    plain = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    with pytest.raises(ValueError, match="should be already quantized"):
        qk.fix_input_output_range(plain)
    with pytest.raises(ValueError, match="should be already quantized"):
        qk.remove_input_range(plain)
    with pytest.raises(ValueError, match="init_min < init_max"):
        qk.fix_input_output_range(qk.quantize_model(plain), input_min=1.0, input_max=1.0)
    with pytest.raises(ValueError, match="Quantizer or None"):
        kdist.sparsity.QuantizeLayer("8bit")


class Nothing(QuantizeConfig):
    """Answers None where a list is expected, as tfmot's own test configs do."""

    def get_weights_and_quantizers(self, layer):
        return []

    def get_activations_and_quantizers(self, layer):
        return []

    def set_quantize_activations(self, layer, quantize_activations):
        pass

    def get_output_quantizers(self, layer):
        pass

    def get_config(self):
        return {}


def test_a_config_that_quantises_nothing_leaves_the_layer_as_it_was():
    keras.utils.set_random_seed(0)
    plain = keras.Sequential([keras.Input((10,)), keras.layers.Dense(3, name="d")])
    annotated = keras.Sequential([keras.Input((10,)), qk.quantize_annotate_layer(
        keras.layers.Dense(3, name="d"), Nothing())])
    annotated.set_weights(plain.get_weights())
    with qk.quantize_scope({"Nothing": Nothing}):
        model = qk.remove_input_range(qk.quantize_apply(annotated))
    x, _ = _data(8)
    assert isinstance(model.get_layer("quant_d").quantize_config, Nothing)
    np.testing.assert_allclose(model.predict(x, verbose=0), plain.predict(x, verbose=0),
                               rtol=1e-6)
    # Its weights are copies: training the quantised model leaves the annotated one alone.
    assert model.get_layer("quant_d").layer.kernel is not annotated.layers[0].layer.kernel


def test_inputs_are_quantised_only_where_a_quantised_layer_reads_them():
    def functional(annotate_first):
        inputs = keras.Input((10,))
        first = keras.layers.Dense(8, name="first")
        x = (qk.quantize_annotate_layer(first) if annotate_first else first)(inputs)
        outputs = qk.quantize_annotate_layer(keras.layers.Dense(2, name="last"))(x)
        return keras.Model(inputs, outputs)

    def kinds(model):
        return [type(layer).__name__ for layer in model.layers]

    # A float layer read by a quantised one quantises its output only (QuantizeWithConfig
    # with an OutputOnlyConfig), and reads its own input in float.
    assert kinds(qk.quantize_apply(functional(False))) == [
        "InputLayer", "QuantizeWithConfig", "QuantizeAware"]
    assert kinds(qk.quantize_apply(functional(True))) == [
        "InputLayer", "QuantizeLayer", "QuantizeAware", "QuantizeAware"]
    sequential = keras.Sequential([keras.Input((10,)), keras.layers.Dense(8),
                                   qk.quantize_annotate_layer(keras.layers.Dense(2))])
    assert kinds(qk.quantize_apply(sequential)) == ["QuantizeWithConfig", "QuantizeAware"]
    with pytest.raises(ValueError, match="should be already quantized"):
        qk.fix_input_output_range(qk.quantize_apply(sequential))
    # Asked for explicitly, every input is quantised.
    assert kinds(kdist.sparsity.quantize_inputs(qk.quantize_apply(sequential)))[0] == (
        "QuantizeLayer")


def test_a_wrapper_made_under_tfmot_name_saves_and_loads(tmp_path):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((10,)),
                              qk.QuantizeWrapper(keras.layers.Dense(3, name="d"), KernelOnly())])
    x, _ = _data(4)
    expected = model.predict(x, verbose=0)
    model.save(tmp_path / "wrapped.keras")
    with qk.quantize_scope({"KernelOnly": KernelOnly}):
        loaded = keras.models.load_model(tmp_path / "wrapped.keras")
    assert isinstance(loaded.layers[0], qk.QuantizeWrapper)
    np.testing.assert_allclose(loaded.predict(x, verbose=0), expected, rtol=1e-6)


class AttentionKernels(KernelOnly):
    """MultiHeadAttention's four kernels at 4 bits: tfmot's way to quantise a layer it
    does not know, here a layer called on two inputs."""

    def get_weights_and_quantizers(self, layer):
        return [(dense.kernel, LastValueQuantizer(self.bits, False, True, False))
                for dense in (layer.query_dense, layer.key_dense, layer.value_dense,
                              layer.output_dense)]


def test_attention_annotated_with_a_config_is_quantised_on_its_two_inputs():
    tokens, memory = keras.Input((6, 8)), keras.Input((4, 8))
    attended = qk.quantize_annotate_layer(keras.layers.MultiHeadAttention(2, 4, name="att"),
                                          AttentionKernels())(tokens, memory)
    model = keras.Model([tokens, memory], keras.layers.GlobalAveragePooling1D()(attended))
    with qk.quantize_scope({"AttentionKernels": AttentionKernels}):
        quantized = qk.quantize_apply(model)
    rng = np.random.default_rng(0)
    x = [rng.normal(size=(8, 6, 8)).astype("float32"),
         rng.normal(size=(8, 4, 8)).astype("float32")]
    expected = quantized.predict(x, verbose=0)
    plain = kdist.sparsity.strip(quantized)
    attention = plain.get_layer("att")
    for dense in (attention.query_dense, attention.key_dense, attention.value_dense,
                  attention.output_dense):
        assert len(np.unique(keras.ops.convert_to_numpy(dense.kernel))) <= 16, dense.name
    # The value input reached the layer: the stripped float model agrees on both inputs.
    np.testing.assert_allclose(plain.predict(x, verbose=0), expected, atol=1e-5)
    assert not np.allclose(model.predict(x, verbose=0), expected, atol=1e-3)


def test_the_default_registry_quantises_layers_as_tfmot_s_default_scheme():
    registry = qk.default_8bit.Default8BitQuantizeRegistry()
    assert isinstance(registry, kdist.sparsity.QuantizeRegistry)
    kernel = np.array([[-1.0, 0.0], [0.0, 1.0]], dtype="float32")
    dense = keras.layers.Dense(2, kernel_initializer=keras.initializers.Constant(kernel))
    model = keras.Sequential([keras.Input((2,)),
                              qk.QuantizeWrapper(dense, registry.get_quantize_config(dense))])
    # Kernel and output over the starting range [-6, 6]: 1 -> 0.992 (narrow) -> 0.988.
    np.testing.assert_allclose(model.predict(np.ones((1, 2)), verbose=0),
                               [[-0.9882353, 0.9882353]], atol=1e-6)
    conv = keras.layers.Conv2D(3, 2)
    config = registry.get_quantize_config(conv)
    assert config.get_config() == {"weight": "kernel", "per_axis": True, "bits": 8}
    images = np.random.default_rng(0).random((2, 4, 5, 1)).astype("float32")
    quantized = keras.Sequential([keras.Input((4, 5, 1)), qk.QuantizeWrapper(conv, config)])
    plain = keras.Sequential([keras.Input((4, 5, 1)), keras.layers.Conv2D(3, 2)])
    kernel, bias = conv.get_weights()
    fake = keras.quantizers.fake_quant_with_min_max_vars
    plain.set_weights([keras.ops.convert_to_numpy(fake(kernel, -6.0, 6.0, 8, narrow_range=True)),
                       bias])
    np.testing.assert_allclose(quantized.predict(images, verbose=0),
                               fake(plain.predict(images, verbose=0), -6.0, 6.0, 8), atol=1e-6)
    relu = keras.layers.ReLU()
    outputs = keras.Sequential([keras.Input((4,)),
                                qk.QuantizeWrapper(relu, registry.get_quantize_config(relu))])
    x = np.array([[-1.0, 0.1, 2.0, 7.0]], dtype="float32")
    # ReLU's output on the 8-bit grid of [-6, 6]: 7 saturates at the top of the range.
    np.testing.assert_allclose(outputs.predict(x, verbose=0), np.clip(x, 0.0, 6.0),
                               atol=12 / 255 / 2 + 1e-6)
    assert registry.supports(dense) and not registry.supports(keras.layers.LSTM(2))
    with pytest.raises(ValueError, match="No default quantisation for .*LSTM"):
        registry.get_quantize_config(keras.layers.LSTM(2))
