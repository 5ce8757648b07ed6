"""kdist.tfmot: tensorflow-model-optimization's Keras API over kdist.sparsity.

Each flow is the one tfmot's pruning and quantization guides teach, written
against `import kdist.tfmot as tfmot` on a Keras 3 model.
"""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import kdist
import kdist.tfmot as tfmot

prune_low_magnitude = tfmot.sparsity.keras.prune_low_magnitude


def _data(rows=256, seed=0):
    x = np.random.default_rng(seed).normal(size=(rows, 10)).astype("float32")
    return x, (x[:, 0] + 0.5 * x[:, 1] > 0).astype("int64")


def _model(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((10,)), keras.layers.Dense(32, activation="relu"),
                             keras.layers.Dense(2)])


def _compile(model):
    model.compile(keras.optimizers.Adam(0.01),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def _kernel_sparsity(model):
    return {w.path: float(np.mean(keras.ops.convert_to_numpy(w) == 0))
            for w in model.weights if w.path.endswith("kernel")}


def test_the_pruning_guide_runs_with_the_import_changed(tmp_path):
    x, y = _data()
    batch_size, epochs = 32, 2
    end_step = np.ceil(len(x) / batch_size).astype(np.int32) * epochs
    schedule = tfmot.sparsity.keras.PolynomialDecay(
        initial_sparsity=0.50, final_sparsity=0.80, begin_step=0, end_step=end_step,
        frequency=4)
    model_for_pruning = _compile(prune_low_magnitude(_model(), pruning_schedule=schedule))
    callbacks = [tfmot.sparsity.keras.UpdatePruningStep(),
                 tfmot.sparsity.keras.PruningSummaries(log_dir=str(tmp_path / "logs"))]
    model_for_pruning.fit(x, y, batch_size=batch_size, epochs=epochs, callbacks=callbacks,
                          verbose=0)
    model_for_export = tfmot.sparsity.keras.strip_pruning(model_for_pruning)
    assert all(type(layer) is keras.layers.Dense for layer in model_for_export.layers)
    reached = schedule.sparsity(int(end_step) - int(end_step) % 4)
    for value in _kernel_sparsity(model_for_export).values():
        assert value == pytest.approx(reached, abs=0.02)
    np.testing.assert_allclose(model_for_export.predict(x, verbose=0),
                               model_for_pruning.predict(x, verbose=0), atol=1e-6)
    converter = tf.lite.TFLiteConverter.from_keras_model(model_for_export)
    converter.optimizations = [tf.lite.Optimize.DEFAULT]
    assert len(converter.convert()) > 0
    events = list((tmp_path / "logs" / "train").iterdir())
    tags = {value.tag for event in tf.compat.v1.train.summary_iterator(str(events[0]))
            for value in event.summary.value}
    expected = {f"sparsity/{name}" for name in kdist.sparsity.sparsity_of(model_for_pruning)}
    assert len(expected) == 2 and expected <= tags


def test_layers_are_pruned_where_the_guide_chooses_them():
    base = _model()

    def apply_pruning_to_dense(layer):
        if isinstance(layer, keras.layers.Dense) and layer.units == 32:
            return prune_low_magnitude(layer)
        return layer

    cloned = keras.models.clone_model(base, clone_function=apply_pruning_to_dense)
    assert [type(layer).__name__ for layer in cloned.layers] == ["PruneLowMagnitude", "Dense"]
    # Named as tfmot names its wrappers.
    assert cloned.layers[0].name == f"prune_low_magnitude_{base.layers[0].name}"

    inputs = keras.Input((10,))
    # tfmot's default schedule first prunes at step 100; this one at every step.
    every_step = tfmot.sparsity.keras.ConstantSparsity(0.5, 0, frequency=1)
    hidden = prune_low_magnitude(keras.layers.Dense(16), pruning_schedule=every_step)(inputs)
    functional = keras.Model(inputs, keras.layers.Dense(2)(hidden))
    _compile(functional).fit(*_data(64), epochs=1, verbose=0,
                             callbacks=[tfmot.sparsity.keras.UpdatePruningStep()])
    assert list(kdist.sparsity.sparsity_of(functional).values()) == [0.5]


def test_the_guides_block_and_2_by_4_pruning():
    x, y = _data()
    every_step = tfmot.sparsity.keras.ConstantSparsity(0.5, 0, frequency=1)
    blocks = _compile(prune_low_magnitude(_model(), block_size=[1, 16],
                                          pruning_schedule=every_step))
    blocks.fit(x, y, epochs=1, verbose=0, callbacks=[tfmot.sparsity.keras.UpdatePruningStep()])
    kernel = tfmot.sparsity.keras.strip_pruning(blocks).layers[0].get_weights()[0]
    rows = (kernel.reshape(10, 2, 16) == 0).all(axis=2) | (kernel.reshape(10, 2, 16) != 0).all(
        axis=2)
    assert rows.all() and np.mean(kernel == 0) == pytest.approx(0.5)

    # The 2:4 guide wraps layers that carry input_shape= in a Sequential list.
    with pytest.warns(UserWarning, match="input_shape"):
        first = keras.layers.Dense(4, input_shape=(8,))
    two_of_four = _compile(keras.Sequential([
        prune_low_magnitude(first, sparsity_m_by_n=(2, 4)), keras.layers.Dense(2)]))
    assert two_of_four.built
    two_of_four.fit(x[:, :8], y, epochs=1, verbose=0,
                    callbacks=[tfmot.sparsity.keras.UpdatePruningStep()])
    kernel = tfmot.sparsity.keras.strip_pruning(two_of_four).layers[0].get_weights()[0]
    assert np.all((kernel.reshape(2, 4, 4) == 0).sum(axis=1) == 2)


def test_a_custom_prunable_layer_prunes_the_weight_it_names():
    class MyDenseLayer(keras.layers.Dense, tfmot.sparsity.keras.PrunableLayer):
        def get_prunable_weights(self):
            return [self.kernel]

    every_step = tfmot.sparsity.keras.ConstantSparsity(0.5, 0, frequency=1)
    model = keras.Sequential([keras.Input((10,)),
                              prune_low_magnitude(MyDenseLayer(20), pruning_schedule=every_step),
                              keras.layers.Dense(2)])
    _compile(model).fit(*_data(64), epochs=1, verbose=0,
                        callbacks=[tfmot.sparsity.keras.UpdatePruningStep()])
    assert float(np.mean(model.layers[0].effective_kernel().numpy() == 0)) == 0.5

    class TwoWeights(keras.layers.Dense, tfmot.sparsity.keras.PrunableLayer):
        def get_prunable_weights(self):
            return [self.kernel, self.bias]

    both = keras.Sequential([keras.Input((10,)), prune_low_magnitude(
        TwoWeights(4, bias_initializer="random_normal"), pruning_schedule=every_step)])
    _compile(both).fit(*_data(64), epochs=1, verbose=0,
                       callbacks=[tfmot.sparsity.keras.UpdatePruningStep()])
    stripped = tfmot.sparsity.keras.strip_pruning(both).layers[0]
    assert [float(np.mean(w == 0)) for w in stripped.get_weights()] == [0.5, 0.5]


def test_a_custom_training_loop_drives_the_step_callback():
    x, y = _data(64)
    model = prune_low_magnitude(_model(), pruning_schedule=tfmot.sparsity.keras.ConstantSparsity(
        0.75, begin_step=0, frequency=1))
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    optimizer = keras.optimizers.Adam()
    model.optimizer = optimizer
    step_callback = tfmot.sparsity.keras.UpdatePruningStep()
    step_callback.set_model(model)
    step_callback.on_train_begin()
    for start in range(0, 64, 16):
        step_callback.on_train_batch_begin(batch=-1)
        with tf.GradientTape() as tape:
            value = loss(y[start:start + 16], model(x[start:start + 16], training=True))
        grads = tape.gradient(value, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
    step_callback.on_epoch_end(batch=-1)
    for value in _kernel_sparsity(tfmot.sparsity.keras.strip_pruning(model)).values():
        assert value == pytest.approx(0.75, abs=0.02)


def test_saved_pruned_and_quantized_models_load_in_their_scopes(tmp_path):
    pruned = prune_low_magnitude(_model())
    _compile(pruned).fit(*_data(64), epochs=1, verbose=0,
                         callbacks=[tfmot.sparsity.keras.UpdatePruningStep()])
    pruned.save(tmp_path / "pruned.keras")
    with tfmot.sparsity.keras.prune_scope():
        loaded = keras.models.load_model(tmp_path / "pruned.keras")
    np.testing.assert_array_equal(loaded.layers[0].mask.numpy(), pruned.layers[0].mask.numpy())

    quantized = _compile(tfmot.quantization.keras.quantize_model(_model()))
    quantized.fit(*_data(64), epochs=1, verbose=0)
    quantized.save(tmp_path / "quantized.keras")
    with tfmot.quantization.keras.quantize_scope():
        reloaded = keras.models.load_model(tmp_path / "quantized.keras")
    x = _data(16, seed=1)[0]
    np.testing.assert_allclose(reloaded.predict(x, verbose=0), quantized.predict(x, verbose=0),
                               atol=1e-6)


def test_the_quantization_guide_runs_with_the_import_changed():
    x, y = _data()
    base = _compile(_model())
    base.fit(x, y, epochs=10, verbose=0)
    _, float_accuracy = base.evaluate(x, y, verbose=0)
    q_aware_model = _compile(tfmot.quantization.keras.quantize_model(base))
    q_aware_model.fit(x, y, batch_size=64, epochs=2, verbose=0)
    _, accuracy = q_aware_model.evaluate(x, y, verbose=0)
    assert float_accuracy > 0.9 and accuracy > float_accuracy - 0.05
    converter = tf.lite.TFLiteConverter.from_keras_model(q_aware_model)
    converter.optimizations = [tf.lite.Optimize.DEFAULT]
    interpreter = tf.lite.Interpreter(model_content=converter.convert())
    interpreter.allocate_tensors()
    # tfmot's recipe gives int8 kernels (TFLite stores them as out x in).
    kernels = {tuple(int(n) for n in detail["shape"]): detail["dtype"]
               for detail in interpreter.get_tensor_details()}
    assert kernels[(32, 10)] == np.int8 and kernels[(2, 32)] == np.int8
    given, taken = interpreter.get_input_details()[0], interpreter.get_output_details()[0]
    interpreter.set_tensor(given["index"], x[:1])
    interpreter.invoke()
    np.testing.assert_allclose(interpreter.get_tensor(taken["index"]),
                               q_aware_model.predict(x[:1], verbose=0), atol=0.05)


def test_annotated_layers_alone_are_quantized():
    base = _model()

    def apply_quantization_to_dense(layer):
        if isinstance(layer, keras.layers.Dense) and layer.units == 32:
            return tfmot.quantization.keras.quantize_annotate_layer(layer)
        return layer

    annotated = keras.models.clone_model(base, clone_function=apply_quantization_to_dense)
    quantized = tfmot.quantization.keras.quantize_apply(annotated)
    # As in tfmot, the input is quantised too, by a QuantizeLayer before the first layer.
    assert [type(layer).__name__ for layer in quantized.layers] == [
        "QuantizeLayer", "QuantizeAware", "Dense"]
    x = _data(16)[0]
    np.testing.assert_array_equal(quantized.layers[2].get_weights()[0],
                                  base.layers[1].get_weights()[0])
    whole = tfmot.quantization.keras.quantize_apply(
        tfmot.quantization.keras.quantize_annotate_model(base))
    assert [type(layer).__name__ for layer in whole.layers] == [
        "QuantizeLayer", "QuantizeAware", "QuantizeAware"]
    assert whole.predict(x, verbose=0).shape == (16, 2)


def test_pruning_then_quantizing_keeps_the_zeros():
    x, y = _data()
    pruned = _compile(prune_low_magnitude(_model(), tfmot.sparsity.keras.ConstantSparsity(
        0.8, begin_step=0, frequency=1)))
    pruned.fit(x, y, epochs=1, verbose=0, callbacks=[tfmot.sparsity.keras.UpdatePruningStep()])
    stripped = tfmot.sparsity.keras.strip_pruning(pruned)
    qat = _compile(tfmot.quantization.keras.quantize_model(stripped))
    qat.fit(x, y, epochs=1, verbose=0)
    for plain, layer in zip(stripped.layers, qat.layers[1:]):  # after the QuantizeLayer
        zeros = plain.kernel.numpy() == 0
        assert zeros.mean() == pytest.approx(0.8, abs=0.01)
        assert np.all(keras.ops.convert_to_numpy(layer.effective_kernel())[zeros] == 0)


def test_the_pruning_preserving_qat_guide_keeps_the_zeros_in_the_kernels():
    x, y = _data()
    pruned = _compile(prune_low_magnitude(_model(), tfmot.sparsity.keras.ConstantSparsity(
        0.5, begin_step=0, frequency=4)))
    pruned.fit(x, y, epochs=2, verbose=0, callbacks=[tfmot.sparsity.keras.UpdatePruningStep()])
    stripped = tfmot.sparsity.keras.strip_pruning(pruned)
    annotated = tfmot.quantization.keras.quantize_annotate_model(stripped)
    scheme = tfmot.experimental.combine.Default8BitPrunePreserveQuantizeScheme()
    pqat = _compile(tfmot.quantization.keras.quantize_apply(annotated, scheme))
    pqat.fit(x, y, epochs=2, verbose=0)
    # The guide prints the sparsity of the weights named kernel: the trained ones
    # themselves keep their zeros, not only the quantised copies.
    assert list(_kernel_sparsity(stripped).values()) == pytest.approx([0.5, 0.5], abs=0.02)
    assert list(_kernel_sparsity(pqat).values()) == list(_kernel_sparsity(stripped).values())
    same = tfmot.quantization.keras.quantize_apply(
        annotated, tfmot.quantization.keras.default_8bit.Default8BitQuantizeScheme())
    assert [type(layer).__name__ for layer in same.layers] == [
        type(layer).__name__ for layer in pqat.layers]
    with pytest.raises(ValueError, match="per_channel=False"):
        tfmot.quantization.keras.default_8bit.Default8BitQuantizeScheme(disable_per_axis=True)
    with pytest.raises(ValueError, match="does not offer the scheme DefaultNBitQuantizeScheme"):
        tfmot.quantization.keras.quantize_apply(annotated, type(
            "DefaultNBitQuantizeScheme", (), {})())


def test_schedules_answer_with_tensors_as_tfmot_does():
    schedule = tfmot.sparsity.keras.PolynomialDecay(0.2, 0.8, 100, 110, power=3, frequency=2)
    answers = [schedule(tf.Variable(step)) for step in (99, 100, 102, 105, 110, 111)]
    assert [bool(should) for should, _ in answers] == [False, True, True, False, True, False]
    np.testing.assert_allclose([float(value) for _, value in answers],
                               [0.2, 0.2, 0.4928, 0.725, 0.8, 0.8], atol=1e-6)
    in_graph = tf.function(lambda step: schedule(step))(tf.constant(102))
    assert bool(in_graph[0]) and float(in_graph[1]) == pytest.approx(0.4928)
    config = schedule.get_config()
    assert config["class_name"] == "PolynomialDecay"
    again = keras.utils.deserialize_keras_object(
        config, custom_objects={"PolynomialDecay": tfmot.sparsity.keras.PolynomialDecay})
    assert again.__dict__ == schedule.__dict__
    assert tfmot.sparsity.keras.PolynomialDecay(0.2, 0.8, 10, 10).sparsity(10) == \
        pytest.approx(0.8)


def test_a_subclassed_schedule_written_for_tfmot_drives_pruning():
    class EveryOtherStep(tfmot.sparsity.keras.PruningSchedule):
        def __call__(self, step):
            return tf.equal(step % 2, 0), tf.constant(0.25)

        def get_config(self):
            return {}

    model = _compile(prune_low_magnitude(_model(), pruning_schedule=EveryOtherStep()))
    model.fit(*_data(64), epochs=1, verbose=0,
              callbacks=[tfmot.sparsity.keras.UpdatePruningStep()])
    for value in _kernel_sparsity(tfmot.sparsity.keras.strip_pruning(model)).values():
        assert value == pytest.approx(0.25, abs=0.02)


def test_layer_arguments_go_to_the_wrapper_of_a_single_layer():
    # As in tfmot, a pruned first layer can carry the model's input shape and its own name.
    with pytest.warns(UserWarning, match="input_shape"):  # Keras 3's own advice
        first = prune_low_magnitude(keras.layers.Dense(4), input_shape=(10,), name="first",
                                    pruning_schedule=tfmot.sparsity.keras.ConstantSparsity(
                                        0.5, begin_step=0, frequency=1))
    model = _compile(keras.Sequential([first, keras.layers.Dense(2)]))
    assert model.input_shape == (None, 10) and model.layers[0].name == "first"
    model.fit(*_data(64), epochs=1, verbose=0,
              callbacks=[tfmot.sparsity.keras.UpdatePruningStep()])
    plain = tfmot.sparsity.keras.strip_pruning(model)
    assert _kernel_sparsity(plain)[plain.layers[0].kernel.path] == pytest.approx(0.5)
    with pytest.raises(TypeError, match="single layer"):
        prune_low_magnitude(_model(), input_shape=(10,))
    with pytest.raises(TypeError, match="single layer"):
        prune_low_magnitude([keras.layers.Dense(2)], name="pruned")
    with pytest.raises(ValueError, match="got an object of type str"):
        prune_low_magnitude("dense")


def test_update_pruning_step_leaves_a_model_without_pruned_layers_alone():
    # tfmot's callback does nothing then; kdist's own one says the model was not pruned.
    model = _compile(_model())
    before = [w.copy() for w in model.get_weights()]
    model.fit(*_data(64), epochs=1, verbose=0,
              callbacks=[tfmot.sparsity.keras.UpdatePruningStep()])
    assert any(not np.array_equal(a, b) for a, b in zip(before, model.get_weights()))
    assert all(value == 0.0 for value in _kernel_sparsity(model).values())
    with pytest.raises(ValueError, match="no layer wrapped"):
        _compile(_model()).fit(*_data(64), epochs=1, verbose=0,
                               callbacks=[kdist.sparsity.UpdatePruning()])


def _pruned_after(batches, schedule, callback, seed=0):
    """Kernel sparsity of a pruned Dense after `batches` single-row training steps,
    taken in two fits (all but the last, then the last) as a resumed run would."""
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((10,)), keras.layers.Dense(8)])
    model = _compile(prune_low_magnitude(model, pruning_schedule=schedule))
    x, y = _data(batches, seed)
    seen = []
    for rows in (slice(0, batches - 1), slice(batches - 1, batches)):
        model.fit(x[rows], y[rows], batch_size=1, epochs=1, verbose=0,
                  callbacks=[callback()])
        seen.append(max(kdist.sparsity.sparsity_of(model).values()))
    return seen


def test_schedules_count_the_first_batch_as_step_1_as_tfmot_does():
    every_100 = tfmot.sparsity.keras.ConstantSparsity(0.5, 0, frequency=100)
    # tfmot's pruning step is 1 on the first batch: step 100 is the 100th batch.
    assert _pruned_after(100, every_100, tfmot.sparsity.keras.UpdatePruningStep) == [0.0, 0.5]
    # kdist's own callback counts from 0, so its first batch is already a turn.
    assert _pruned_after(2, every_100, kdist.sparsity.UpdatePruning) == [0.5, 0.5]
    from_step_1 = tfmot.sparsity.keras.PolynomialDecay(0.25, 0.75, begin_step=1, end_step=3,
                                                       frequency=1)
    # Cubic decay from 0.25 at step 1 to 0.75 at step 3: 0.6875 at step 2.
    assert _pruned_after(2, from_step_1, tfmot.sparsity.keras.UpdatePruningStep) == \
        pytest.approx([0.25, 0.6875])
    assert _pruned_after(2, from_step_1, kdist.sparsity.UpdatePruning) == \
        pytest.approx([0.0, 0.25])


class _Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(2)

    def call(self, inputs):
        return self.dense(inputs)


def _nested():
    return keras.Sequential([keras.Input((10,)), _model(), keras.layers.Dense(1)])


_QUANTIZE = tfmot.quantization.keras
_REFUSED = {  # what tfmot refuses with ValueError, and the words kdist's message uses
    "quantize_model(None)": (lambda: _QUANTIZE.quantize_model(None), "cannot be None"),
    "quantize_model(layer)": (lambda: _QUANTIZE.quantize_model(keras.layers.Dense(2)),
                              "only be a Keras model"),
    "quantize_model(subclassed)": (lambda: _QUANTIZE.quantize_model(_Subclassed()),
                                   "subclassed"),
    "quantize_model(nested)": (lambda: _QUANTIZE.quantize_model(_nested()), "inside another"),
    "quantize_model(unbuilt)": (lambda: _QUANTIZE.quantize_model(keras.Sequential(
        [keras.layers.Dense(2)])), "built model"),
    "quantize_annotate_model(layer)": (
        lambda: _QUANTIZE.quantize_annotate_model(keras.layers.Dense(2)), "only be a Keras model"),
    "quantize_annotate_model(nested)": (
        lambda: _QUANTIZE.quantize_annotate_model(_nested()), "inside another"),
    "quantize_annotate_layer(model)": (
        lambda: _QUANTIZE.quantize_annotate_layer(_model()), "only be a Keras layer"),
    "quantize_apply(None)": (lambda: _QUANTIZE.quantize_apply(None), "cannot be None"),
    "quantize_apply(subclassed)": (lambda: _QUANTIZE.quantize_apply(_Subclassed()),
                                   "subclassed"),
    "quantize_apply(unbuilt)": (lambda: _QUANTIZE.quantize_apply(keras.Sequential(
        [_QUANTIZE.quantize_annotate_layer(keras.layers.Dense(2))])), "built model"),
    "prune_low_magnitude(None)": (lambda: prune_low_magnitude(None),
                                  "a layer or a list of layers; got an object of type "
                                  "NoneType"),
    "prune_low_magnitude(subclassed)": (lambda: prune_low_magnitude(_Subclassed()),
                                        "got an object of type _Subclassed"),
    "strip_pruning(layer)": (lambda: tfmot.sparsity.keras.strip_pruning(
        keras.layers.Dense(2)), "only be a Keras model"),
}


@pytest.mark.parametrize("case", sorted(_REFUSED))
def test_what_tfmot_refuses_raises_its_value_error(case):
    call, words = _REFUSED[case]
    with pytest.raises(ValueError, match=words):
        call()


def test_layers_tfmot_does_not_list_are_refused_as_tfmot_refuses_them():
    class Subclassed(keras.layers.Dense):
        pass

    with pytest.raises(ValueError, match="Subclassed is not one of the Keras layers tfmot"):
        prune_low_magnitude(Subclassed(2))
    model = keras.Sequential([keras.Input((10,)), Subclassed(4), keras.layers.Dense(2)])
    with pytest.raises(ValueError, match="PrunableLayer"):
        prune_low_magnitude(model)
    with pytest.raises(ValueError, match="tfmot does not prune ConvLSTM layers"):
        prune_low_magnitude([keras.layers.ConvLSTM2D(2, 3)])
    # kdist's own API prunes every layer with a kernel.
    pruned = kdist.sparsity.prune(model, kdist.sparsity.ConstantSparsity(0.5, 0))
    assert len(kdist.sparsity.pruned_layers(pruned)) == 2


def test_what_tfmot_refuses_kdist_sparsity_still_does():
    # The checks belong to the tfmot import paths: kdist's own functions quantise the
    # layers of an inner model and prune models nested or not.
    quantized = kdist.sparsity.quantize(_nested())
    assert len(kdist.sparsity.wrapping.wrappers_in(quantized, kdist.sparsity.QuantizeAware)) == 3
    pruned = prune_low_magnitude(_nested())
    assert len(kdist.sparsity.pruned_layers(pruned)) == 3


def test_wrappers_answer_to_tfmots_attribute_names():
    schedule = tfmot.sparsity.keras.ConstantSparsity(0.5, begin_step=0)
    pruned = prune_low_magnitude(keras.layers.Dense(2), pruning_schedule=schedule)
    assert pruned.pruning_schedule is schedule
    annotated = tfmot.quantization.keras.quantize_annotate_layer(keras.layers.Dense(2))
    assert annotated.quantize_config is None
    # tfmot code that looks for its quantisation wrapper finds kdist's.
    quantized = tfmot.quantization.keras.quantize_model(_model())
    wrapped = [layer for layer in quantized.layers
               if isinstance(layer, tfmot.quantization.keras.QuantizeWrapperV2)]
    assert len(wrapped) == 2 and all(isinstance(layer.layer, keras.layers.Dense)
                                     for layer in wrapped)
    assert tfmot.quantization.keras.QuantizeWrapper is tfmot.quantization.keras.QuantizeWrapperV2


def test_what_kdist_does_not_offer_is_refused_with_a_reason():
    with pytest.raises(ValueError, match="pruning_policy"):
        prune_low_magnitude(_model(), pruning_policy=object())
    with pytest.raises(ValueError, match="sparsity_m_by_n"):
        prune_low_magnitude(_model(), sparsity_m_by_n=(4, 2))
    with pytest.raises(ValueError, match="scheme"):
        tfmot.quantization.keras.quantize_apply(_model(), scheme=object())
    with pytest.raises(ValueError, match="no marked layer"):
        tfmot.quantization.keras.quantize_apply(_model())
    with pytest.raises(TypeError, match="PruningSchedule"):
        prune_low_magnitude(_model(), pruning_schedule=0.5)
    with pytest.raises(ValueError, match="log_dir"):
        tfmot.sparsity.keras.PruningSummaries(log_dir="")


def test_pruning_summaries_without_tensorboard_says_what_to_install(monkeypatch, tmp_path):
    from kdist.sparsity import callbacks

    monkeypatch.setattr(callbacks, "_tensorboard_installed", lambda: False)
    with pytest.raises(ImportError, match="pip install tensorboard"):
        tfmot.sparsity.keras.PruningSummaries(log_dir=str(tmp_path))


def test_submodules_import_like_tfmot_s():
    from kdist.tfmot.quantization.keras import quantize_model
    from kdist.tfmot.sparsity.keras import PolynomialDecay, prune_low_magnitude as plm

    assert plm is prune_low_magnitude and quantize_model is \
        tfmot.quantization.keras.quantize_model
    assert PolynomialDecay is kdist.sparsity.PolynomialDecay
    assert os.path.basename(tfmot.__file__) == "tfmot.py"


def test_tf_keras_scripts_get_tensorflow_model_optimization_itself(tmp_path):
    from importlib.util import find_spec

    if find_spec("tensorflow_model_optimization") is None:
        pytest.skip("needs tensorflow-model-optimization (extra 'tfmot')")
    tf_keras = pytest.importorskip("tf_keras")
    tf_keras.utils.set_random_seed(0)
    model = tf_keras.Sequential([tf_keras.layers.Input((10,)),
                                 tf_keras.layers.Dense(16, activation="relu"),
                                 tf_keras.layers.Dense(2)])
    pruned = prune_low_magnitude(model, pruning_schedule=tfmot.sparsity.keras.ConstantSparsity(
        0.5, begin_step=0, frequency=2), block_size=(1, 1))
    assert type(pruned.layers[0]).__module__.startswith("tensorflow_model_optimization")
    pruned.compile("adam", tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    pruned.fit(*_data(64), batch_size=16, epochs=1, verbose=0,
               callbacks=[tfmot.sparsity.keras.UpdatePruningStep(),
                          tfmot.sparsity.keras.PruningSummaries(log_dir=str(tmp_path))])
    assert list((tmp_path / "metrics").iterdir())  # where tfmot's callback writes
    plain = tfmot.sparsity.keras.strip_pruning(pruned)
    assert np.mean(plain.layers[0].get_weights()[0] == 0) == pytest.approx(0.5, abs=0.02)
    annotated = tfmot.quantization.keras.quantize_annotate_model(plain)
    with tfmot.quantization.keras.quantize_scope():
        quantized = tfmot.quantization.keras.quantize_apply(annotated)
    assert any(type(layer).__name__ == "QuantizeWrapperV2" for layer in quantized.layers)
    # kdist's name for the pruning-preserving scheme hands tfmot its own scheme.
    preserved = tfmot.quantization.keras.quantize_apply(
        annotated, tfmot.experimental.combine.Default8BitPrunePreserveQuantizeScheme())
    weights_quantizer = preserved.layers[1].quantize_config.weight_quantizer
    assert type(weights_quantizer).__name__ == "PrunePreserveDefault8BitWeightsQuantizer"
    # What kdist does not offer comes from tfmot, for tf_keras models.
    clustering = tfmot.clustering.keras.cluster_weights
    assert clustering.__module__.startswith("tensorflow_model_optimization")


def test_training_without_the_step_callback_fails_as_in_tfmot(tmp_path):
    x, y = _data(64)
    pruned = _compile(prune_low_magnitude(_model(), tfmot.sparsity.keras.ConstantSparsity(
        0.5, 0, frequency=1)))
    # Without the callback the masks would never move: tfmot refuses to train.
    with pytest.raises(tf.errors.InvalidArgumentError, match="UpdatePruningStep"):
        pruned.fit(x, y, epochs=1, verbose=0)
    pruned.fit(x, y, epochs=1, verbose=0, callbacks=[tfmot.sparsity.keras.UpdatePruningStep()])
    assert _kernel_sparsity(pruned)
    assert min(_kernel_sparsity(pruned).values()) == pytest.approx(0.5, abs=0.02)
    # Inference needs no callback, and the requirement survives saving.
    assert pruned.predict(x, verbose=0).shape == (64, 2)
    path = str(tmp_path / "pruned.keras")
    pruned.save(path)
    with tfmot.sparsity.keras.prune_scope():
        loaded = _compile(keras.models.load_model(path))
    with pytest.raises(tf.errors.InvalidArgumentError, match="UpdatePruningStep"):
        loaded.fit(x, y, epochs=1, verbose=0)
    # kdist's own prune() leaves the choice to the caller (a parameter-server worker's
    # masks come from its server).
    own = _compile(kdist.sparsity.prune(_model(), kdist.sparsity.ConstantSparsity(0.5, 0)))
    own.fit(x, y, epochs=1, verbose=0)


def _attention_model(seed=0):
    keras.utils.set_random_seed(seed)
    tokens = keras.Input((6, 8))
    memory = keras.Input((4, 8))
    attended = keras.layers.MultiHeadAttention(2, 4, name="attention")(tokens, memory)
    mixed = keras.layers.EinsumDense("abc,cd->abd", output_shape=(6, 5), name="mix")(attended)
    logits = keras.layers.Dense(2, name="logits")(keras.layers.Flatten()(mixed))
    return keras.Model([tokens, memory], logits)


def test_attention_and_einsum_layers_are_pruned_as_tfmot_prunes_them(tmp_path):
    # tfmot prunes MultiHeadAttention's query, key, value and output kernels, and keeps
    # the call's second input (the value) going to the layer, not to `training`.
    rng = np.random.default_rng(0)
    x = [rng.normal(size=(64, 6, 8)).astype("float32"),
         rng.normal(size=(64, 4, 8)).astype("float32")]
    y = (x[0][:, 0, 0] > x[1][:, 0, 0]).astype("int64")
    schedule = tfmot.sparsity.keras.ConstantSparsity(0.75, begin_step=0, frequency=1)
    model = _compile(prune_low_magnitude(_attention_model(), pruning_schedule=schedule))
    assert len(model.get_layer("prune_low_magnitude_attention").masks) == 4
    model.fit(x, y, epochs=1, batch_size=32, verbose=0,
              callbacks=[tfmot.sparsity.keras.UpdatePruningStep()])
    expected = model.predict(x, verbose=0)
    path = str(tmp_path / "attention.keras")
    model.save(path)
    with tfmot.sparsity.keras.prune_scope():
        loaded = keras.models.load_model(path)
    np.testing.assert_allclose(loaded.predict(x, verbose=0), expected, atol=1e-6)
    plain = tfmot.sparsity.keras.strip_pruning(model)
    assert isinstance(plain.get_layer("attention"), keras.layers.MultiHeadAttention)
    np.testing.assert_allclose(plain.predict(x, verbose=0), expected, atol=1e-6)
    attention = plain.get_layer("attention")
    for dense in (attention.query_dense, attention.key_dense, attention.value_dense,
                  attention.output_dense, plain.get_layer("mix")):
        zeros = np.mean(keras.ops.convert_to_numpy(dense.kernel) == 0)
        assert zeros == pytest.approx(0.75, abs=0.02), dense.name


def test_attention_is_quantized_only_with_a_config_as_in_tfmot():
    model = _attention_model()
    with pytest.raises(RuntimeError, match="keeps attention in float"):
        tfmot.quantization.keras.quantize_model(model)
    with pytest.warns(UserWarning, match=r"leaves the layers \['attention'\]"):
        quantized = kdist.sparsity.quantize(model)
    assert isinstance(quantized.get_layer("attention"), keras.layers.MultiHeadAttention)
    unbuilt = keras.layers.MultiHeadAttention(2, 4)
    wrapper = prune_low_magnitude(unbuilt, pruning_schedule=tfmot.sparsity.keras.ConstantSparsity(
        0.5, begin_step=0))
    with pytest.raises(ValueError, match="built first"):
        wrapper(keras.Input((6, 8)), keras.Input((4, 8)))
    # A wrapped layer is called as the layer is, inputs by keyword included.
    built = model.get_layer("attention")
    wrapper = prune_low_magnitude(built)
    tokens, memory = keras.Input((6, 8)), keras.Input((4, 8))
    np.testing.assert_allclose(
        keras.Model([tokens, memory], wrapper(query=tokens, value=memory)).predict(
            [np.ones((1, 6, 8)), np.ones((1, 4, 8))], verbose=0),
        keras.Model([tokens, memory], built(query=tokens, value=memory)).predict(
            [np.ones((1, 6, 8)), np.ones((1, 4, 8))], verbose=0), atol=1e-6)


def test_every_layer_of_a_model_is_wrapped_as_tfmot_wraps_them(tmp_path):
    # tfmot wraps layers with nothing to prune too (they keep computing as before), and
    # gives each wrapped Keras layer `get_prunable_weights`.
    keras.utils.set_random_seed(0)
    images = keras.Input((8, 8, 1), name="images")
    x = keras.layers.MaxPooling2D()(keras.layers.Conv2D(4, 3, name="conv")(images))
    x = keras.layers.Dropout(0.2)(keras.layers.BatchNormalization()(x))
    x = keras.layers.Flatten()(x)
    logits = keras.layers.Add()([keras.layers.Dense(2)(x), keras.layers.Dense(2)(x)])
    model = keras.Model(images, logits)
    schedule = tfmot.sparsity.keras.ConstantSparsity(0.5, begin_step=0, frequency=1)
    pruned = _compile(prune_low_magnitude(model, pruning_schedule=schedule))
    wrapped = [layer for layer in pruned.layers if not isinstance(layer, keras.layers.InputLayer)]
    assert len(wrapped) == 8 and all(isinstance(layer, kdist.sparsity.PruneLowMagnitude)
                                     for layer in wrapped)
    dropout = [layer for layer in wrapped if isinstance(layer.layer, keras.layers.Dropout)][0]
    assert dropout.layer.get_prunable_weights() == [] and dropout.masks == []
    conv = pruned.get_layer("prune_low_magnitude_conv")
    assert conv.layer.get_prunable_weights() == [conv.layer.kernel]
    x = np.random.default_rng(0).normal(size=(32, 8, 8, 1)).astype("float32")
    y = np.arange(32) % 2
    pruned.fit(x, y, epochs=1, verbose=0, callbacks=[tfmot.sparsity.keras.UpdatePruningStep()])
    expected = pruned.predict(x, verbose=0)
    assert set(kdist.sparsity.sparsity_of(pruned)) == {"conv", "dense", "dense_1"} or len(
        kdist.sparsity.sparsity_of(pruned)) == 3
    path = str(tmp_path / "every_layer.keras")
    pruned.save(path)
    np.testing.assert_allclose(keras.models.load_model(path).predict(x, verbose=0), expected,
                               atol=1e-6)
    plain = tfmot.sparsity.keras.strip_pruning(pruned)
    assert [type(layer).__name__ for layer in plain.layers] == [
        type(layer).__name__ for layer in model.layers]
    np.testing.assert_allclose(plain.predict(x, verbose=0), expected, atol=1e-5)
    # One layer with nothing to prune is wrapped on its own, or in a list, too.
    assert isinstance(prune_low_magnitude(keras.layers.Dropout(0.5)),
                      kdist.sparsity.PruneLowMagnitude)
    assert len(prune_low_magnitude([keras.layers.MaxPooling2D(), keras.layers.Dense(2)])) == 2


def test_a_model_holding_a_layer_tfmot_refuses_is_refused_before_it_is_copied():
    class Block(keras.layers.Layer):  # a custom layer whose config cannot rebuild it
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(3)

        def call(self, inputs):
            return self.dense(inputs)

    inputs = keras.Input((4,))
    model = keras.Model(inputs, Block()(inputs))
    with pytest.raises(ValueError, match="Block is not one of the Keras layers tfmot prunes"):
        prune_low_magnitude(model)
    # A copy that leaves such a layer alone shares it, as tfmot's copies do, and says so.
    with pytest.warns(UserWarning, match="shares it"):
        plain = tfmot.sparsity.keras.strip_pruning(model)
    assert plain.layers[1] is model.layers[1]
    x = np.ones((2, 4), dtype="float32")
    np.testing.assert_allclose(plain.predict(x, verbose=0), model.predict(x, verbose=0))


def test_copies_keep_the_input_names_and_structure_of_the_model():
    pixels = keras.Input((10,), name="pixels")
    model = _compile(keras.Model(pixels, keras.layers.Dense(2)(keras.layers.Dense(4)(pixels))))
    schedule = tfmot.sparsity.keras.ConstantSparsity(0.5, begin_step=0)
    copies = {"quantize_model": tfmot.quantization.keras.quantize_model(model),
              "quantize_annotate_model": tfmot.quantization.keras.quantize_annotate_model(model),
              "prune_low_magnitude": prune_low_magnitude(model, pruning_schedule=schedule)}
    copies["strip_pruning"] = tfmot.sparsity.keras.strip_pruning(copies["prune_low_magnitude"])
    for name, copy in copies.items():
        assert copy.layers[0].name == "pixels", name
        assert not isinstance(copy.input, list), name  # one input stays one tensor
    for name in ("quantize_model", "quantize_annotate_model", "prune_low_magnitude"):
        assert not copies[name].compiled, name  # as tfmot's: compile the copy afresh
    sequential = _compile(_model())
    assert not prune_low_magnitude(sequential, pruning_schedule=schedule).compiled
    inputs = {"a": keras.Input((3,), name="a"), "b": keras.Input((3,), name="b")}
    joined = keras.layers.Concatenate()([inputs["a"], inputs["b"]])
    by_name = keras.Model(inputs, keras.layers.Dense(2)(joined))
    quantized = tfmot.quantization.keras.quantize_model(by_name)
    assert isinstance(quantized.input, dict) and sorted(quantized.input) == ["a", "b"]


def _tflite_tensors(model):
    converter = tf.lite.TFLiteConverter.from_keras_model(model)
    converter.optimizations = [tf.lite.Optimize.DEFAULT]
    interpreter = tf.lite.Interpreter(model_content=converter.convert())
    return interpreter.get_tensor_details()


def test_an_untrained_or_fixed_range_qat_model_converts_to_int8_as_tfmot_s():
    # Output ranges start at [-6, 6] as tfmot's do, so a model converted before any
    # training is quantised; a fixed range leaves no range variables in the step.
    model = _model()
    quantized = tfmot.quantization.keras.quantize_model(model)
    int8 = {tuple(int(n) for n in t["shape"]): t for t in _tflite_tensors(quantized)
            if t["dtype"] == np.int8}
    assert (32, 10) in int8 and (2, 32) in int8  # the kernels
    assert int8[(1, 2)]["quantization_parameters"]["scales"][0] == pytest.approx(12 / 255)
    fixed = tfmot.quantization.keras.fix_input_output_range(quantized, input_min=0.0,
                                                            input_max=1.0, output_min=0.0,
                                                            output_max=1.0)
    tensors = _tflite_tensors(fixed)
    assert not any(t["dtype"] == np.bool_ or "range_seen" in t["name"] for t in tensors)
    scales = sorted(float(t["quantization_parameters"]["scales"][0]) for t in tensors
                    if t["dtype"] == np.int8 and len(t["quantization_parameters"]["scales"]) == 1)
    assert scales.count(pytest.approx(1 / 255)) >= 2  # the input and the output


def test_annotating_a_model_leaves_lambda_layers_and_refuses_a_model_as_a_layer():
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4),
                              keras.layers.Lambda(lambda x: x + 1.0)])
    with pytest.warns(UserWarning, match="Lambda layers"):
        annotated = tfmot.quantization.keras.quantize_annotate_model(model)
    assert isinstance(annotated.layers[1], keras.layers.Lambda)
    x = np.random.default_rng(0).normal(size=(3, 5)).astype("float32")
    np.testing.assert_allclose(annotated.predict(x, verbose=0), model.predict(x, verbose=0))
    with pytest.raises(ValueError, match="quantize_annotate_model"):
        kdist.sparsity.QuantizeAnnotate(model)


def test_a_pruned_model_wraps_the_models_own_layers_and_keeps_pruned_ones():
    # As tfmot's: the new model is built around the given layers, not copies of them.
    pruned_layer = prune_low_magnitude(keras.layers.Dense(3))
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), pruned_layer])
    pruned = prune_low_magnitude(model)
    assert pruned.layers[0].layer is model.layers[0]
    assert pruned.layers[1] is pruned_layer
    assert prune_low_magnitude([pruned_layer])[0] is pruned_layer


def _annotated_after_a_float_layer():
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(3, activation="relu", name="float")(inputs)
    outputs = tfmot.quantization.keras.quantize_annotate_layer(
        keras.layers.Dense(2, name="marked"))(hidden)
    return keras.Model(inputs, outputs)


def test_a_float_layer_feeding_a_marked_one_has_its_output_quantized_as_in_tfmot():
    quantized = tfmot.quantization.keras.quantize_apply(_annotated_after_a_float_layer())
    names = [layer.name for layer in quantized.layers]
    assert "quantize_layer" not in names  # the input goes to a float layer
    feeder = quantized.get_layer("quant_float")
    assert isinstance(feeder, tfmot.quantization.keras.QuantizeWrapper)
    config = feeder.quantize_config
    assert config.get_weights_and_quantizers(feeder.layer) == []  # weights stay float
    assert isinstance(config.get_config()["quantize_config"],
                      kdist.sparsity.KernelQuantizeConfig)
    assert len(config.get_activations_and_quantizers(feeder.layer)) == 1  # its relu output
    copy = keras.Model.from_config(quantized.get_config())
    assert type(copy.get_layer("quant_float").quantize_config) is type(config)


def test_quantized_and_annotated_copies_of_a_compiled_model_are_not_compiled():
    # As in tfmot, the copy is trained with an optimizer of its own once compiled. Keras 3
    # gives an uncompiled model no `optimizer` at all (tfmot's: None), and its legacy .h5
    # writer fails on a None one.
    keras_model = _compile(_model())
    quantize = tfmot.quantization.keras
    annotated = quantize.quantize_annotate_model(keras_model)
    assert not annotated.compiled and getattr(annotated, "optimizer", None) is None
    annotated = _compile(annotated)
    for copy in (quantize.quantize_apply(annotated), quantize.quantize_model(keras_model)):
        assert not copy.compiled and getattr(copy, "optimizer", None) is None


class _CustomDense(keras.layers.Dense):
    pass


def test_a_custom_layer_without_a_config_is_refused_as_tfmot_refuses_it():
    quantize = tfmot.quantization.keras
    model = keras.Sequential([keras.Input((2,)),
                              quantize.quantize_annotate_layer(_CustomDense(3))])
    # Not known to Keras: the model cannot be copied (tfmot raises ValueError too).
    with pytest.raises(ValueError, match="not known to Keras.*quantize_scope"):
        quantize.quantize_apply(model)
    # Known to Keras, but still without a QuantizeConfig.
    with quantize.quantize_scope({"_CustomDense": _CustomDense}):
        with pytest.raises(RuntimeError, match="QuantizeConfig"):
            quantize.quantize_apply(model)


def test_tfmot_functions_called_in_a_tf1_graph_say_keras_3_runs_eagerly():
    with tf.Graph().as_default():
        with pytest.raises(RuntimeError, match="built and copied eagerly"):
            tfmot.quantization.keras.quantize_apply(_model())
