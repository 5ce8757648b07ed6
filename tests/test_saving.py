"""Saving and loading: kdist's classes load after a plain `import kdist`, with their state.

The import-order tests run fresh Python processes, since what is imported
first is the point; the rest run in this process.
"""

import json
import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest

import kdist
from kdist.callbacks import checkpoint as checkpoint_lib
from kdist.coordination.model_state import model_state

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

X = np.random.default_rng(0).normal(size=(16, 3)).astype("float32")
Y = X @ np.array([[1.0, -1.0], [0.5, 2.0], [-1.5, 0.0]], "float32")


def _dense(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="relu"),
                             keras.layers.Dense(2)])


def _fit(model, epochs, **kwargs):
    return model.fit(X, Y, batch_size=4, epochs=epochs, verbose=0, shuffle=False, **kwargs)


def _chain(optimizer):
    """Class names from the outer optimizer to the plain one."""
    names = []
    while optimizer is not None:
        names.append(type(optimizer).__name__)
        optimizer = getattr(optimizer, "inner_optimizer", None)
    return names


@pytest.fixture
def float32_policy():
    yield
    keras.config.set_dtype_policy("float32")


# What a fresh process gets from `import kdist` and a Keras import in either order.

_LOAD_IN_A_FRESH_PROCESS = textwrap.dedent("""
    import json, sys
    order, directory = sys.argv[1], sys.argv[2]
    seen = {}
    if order == "kdist, then keras":
        import kdist
        seen = {"keras": "keras" in sys.modules, "tensorflow": "tensorflow" in sys.modules}
        import keras
    elif order == "keras, then kdist":
        import keras
        import kdist
    else:  # TensorFlow imports Keras while it starts
        import kdist
        import tensorflow
        import keras
    import numpy as np

    expected = json.load(open(f"{directory}/expected.json"))
    x = np.load(f"{directory}/x.npy")
    loaded = {}
    for name in expected:
        model = keras.models.load_model(f"{directory}/{name}")
        optimizers = [model.d_optimizer, model.g_optimizer] if hasattr(
            model, "d_optimizer") else [model.optimizer]
        chains = []
        for optimizer in optimizers:
            chain = []
            while optimizer is not None:
                chain.append(type(optimizer).__module__ + "." + type(optimizer).__name__)
                optimizer = getattr(optimizer, "inner_optimizer", None)
            chains.append(chain)
        loaded[name] = {
            "chains": chains,
            "iterations": [int(o.iterations) for o in optimizers],
            "layers": [type(layer).__name__ for layer in model.layers],
            "prediction": (None if hasattr(model, "d_optimizer") else
                           np.asarray(model.predict(x, verbose=0), "float64").tolist())}
    print("RESULT" + json.dumps({"seen": seen, "loaded": loaded}))
""")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """kdist models saved in .keras and .h5, with what loading them must give."""
    directory = tmp_path_factory.mktemp("saved")
    np.save(directory / "x.npy", X)
    expected = {}

    def save(model, name, formats=("keras", "h5")):
        for fmt in formats:
            model.save(directory / f"{name}.{fmt}")
            optimizers = [model.d_optimizer, model.g_optimizer] if isinstance(
                model, kdist.gan.GAN) else [model.optimizer]
            expected[f"{name}.{fmt}"] = {
                "chains": [_chain(o) for o in optimizers],
                "iterations": [int(o.iterations) for o in optimizers],
                "layers": [type(layer).__name__ for layer in model.layers],
                "prediction": None if isinstance(model, kdist.gan.GAN) else
                np.asarray(model.predict(X, verbose=0), "float64").tolist()}

    model = _dense()
    model.compile(kdist.DistributedOptimizer(keras.optimizers.Adam(0.01),
                                             compression=kdist.Compression.fp16),
                  keras.losses.MeanSquaredError())
    _fit(model, 2)
    save(model, "distributed")

    try:
        kdist.precision.enable("mixed_float16")
        model = _dense()
        model.compile(kdist.DistributedOptimizer(keras.optimizers.SGD(0.01)),
                      keras.losses.MeanSquaredError())
        _fit(model, 2)
        save(model, "mixed")
    finally:
        kdist.precision.enable("float32")

    sparse = kdist.sparsity.quantize(kdist.sparsity.prune(
        _dense(), kdist.sparsity.ConstantSparsity(0.5, begin_step=0, frequency=2)), bits=4)
    sparse.compile(kdist.DistributedOptimizer(keras.optimizers.Adam(0.01)),
                   keras.losses.MeanSquaredError())
    _fit(sparse, 2, callbacks=[kdist.sparsity.UpdatePruning()])
    save(sparse, "pruned_quantized")

    # tfmot's layout: an input QuantizeLayer, layers without weights under configs, a
    # fixed output range through FixedRangeConfig.
    import kdist.tfmot as tfmot

    keras.utils.set_random_seed(0)
    inputs = keras.Input((3,))
    outputs = keras.layers.ReLU()(keras.layers.Dense(2)(keras.layers.Dense(4)(inputs)))
    qat = tfmot.quantization.keras.fix_input_output_range(
        tfmot.quantization.keras.quantize_model(keras.Model(inputs, outputs)),
        input_min=-4.0, input_max=4.0, output_min=0.0, output_max=8.0)
    qat.compile(kdist.DistributedOptimizer(keras.optimizers.Adam(0.01)),
                keras.losses.MeanSquaredError())
    _fit(qat, 2)
    save(qat, "tfmot_quantized", formats=("keras",))

    gan = _gan()
    gan.compile(d_optimizer=kdist.DistributedOptimizer(keras.optimizers.Adam(1e-3)),
                g_optimizer=kdist.DistributedOptimizer(keras.optimizers.Adam(1e-3)))
    gan.fit(X[:, :2], batch_size=8, epochs=1, verbose=0)
    save(gan, "gan", formats=("keras",))

    (directory / "expected.json").write_text(json.dumps(expected))
    return directory, expected


def _gan():
    keras.utils.set_random_seed(0)
    generator = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    discriminator = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, "sigmoid")])
    return kdist.gan.GAN(generator, discriminator, d_steps=2, g_steps=1, seed=1)


@pytest.mark.parametrize("order", ["kdist, then keras", "keras, then kdist",
                                   "kdist, then tensorflow"])
def test_saved_kdist_models_load_after_a_plain_import_kdist(saved, order):
    directory, expected = saved
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3",
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", _LOAD_IN_A_FRESH_PROCESS, order,
                           str(directory)], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.split("RESULT", 1)[1])
    if order == "kdist, then keras":
        assert result["seen"] == {"keras": False, "tensorflow": False}, \
            "import kdist alone must not import Keras or TensorFlow"
    assert sorted(result["loaded"]) == sorted(expected)
    for name, want in expected.items():
        got = result["loaded"][name]
        assert [[c.rsplit(".", 1)[1] for c in chain] for chain in got["chains"]] == \
            want["chains"], name
        assert all(chain[0].startswith("kdist.") for chain in got["chains"]), name
        assert got["iterations"] == want["iterations"], name
        assert got["layers"] == want["layers"], name
        if want["prediction"] is not None:
            np.testing.assert_allclose(got["prediction"], want["prediction"], rtol=1e-6,
                                       atol=1e-6, err_msg=name)


# The optimizer's state (step count, slots, loss scale) survives both formats.

# Accumulation covers the plain wrapper too, and adds variables that `build` makes.
@pytest.mark.parametrize("setting", ["accumulating", "mixed_float16"])
def test_optimizer_state_round_trips_and_training_resumes_exactly(tmp_path, setting,
                                                                  float32_policy):
    if setting == "mixed_float16":
        kdist.precision.enable("mixed_float16")
    model = _dense()
    passes = 2 if setting == "accumulating" else 1
    model.compile(kdist.DistributedOptimizer(keras.optimizers.Adam(0.01),
                                             backward_passes_per_step=passes),
                  keras.losses.MeanSquaredError())
    _fit(model, 2)
    steps = int(model.optimizer.iterations)
    assert steps > 0
    for fmt in ("keras", "h5"):
        model.save(tmp_path / f"model.{fmt}")
    _fit(model, 1)
    for fmt in ("keras", "h5"):
        loaded = keras.models.load_model(tmp_path / f"model.{fmt}")
        assert _chain(loaded.optimizer) == _chain(model.optimizer), fmt
        assert int(loaded.optimizer.iterations) == steps, fmt
        _fit(loaded, 1)
        assert int(loaded.optimizer.iterations) == int(model.optimizer.iterations), fmt
        # Fresh Adam moments (or a fresh loss scale) would take other steps.
        for mine, theirs in zip(loaded.optimizer.variables, model.optimizer.variables):
            np.testing.assert_allclose(mine, theirs, rtol=1e-6, err_msg=f"{fmt} {mine.path}")
        for mine, theirs in zip(loaded.get_weights(), model.get_weights()):
            np.testing.assert_allclose(mine, theirs, rtol=1e-6, atol=1e-7, err_msg=fmt)


def test_a_gan_refuses_the_h5_format_and_says_what_to_use(tmp_path):
    gan = _gan()
    gan.compile(d_optimizer="adam", g_optimizer="adam")
    with pytest.raises(ValueError, match=r"\.keras"):
        gan.save(tmp_path / "gan.h5")
    assert not (tmp_path / "gan.h5").exists()


def test_a_plain_optimizer_under_kdist_loss_scaling_warns_in_h5_and_load_model_restores_it(
        tmp_path, float32_policy):
    model = _dense()
    model.compile(kdist.precision.LossScaleOptimizer(keras.optimizers.SGD(0.01, momentum=0.9)),
                  keras.losses.MeanSquaredError())
    _fit(model, 1)
    model.save(tmp_path / "scaled.h5")
    with pytest.warns(UserWarning, match="kdist.load_model"):
        keras.models.load_model(tmp_path / "scaled.h5")
    loaded = kdist.load_model(tmp_path / "scaled.h5")
    assert _chain(loaded.optimizer) == ["LossScaleOptimizer", "AllreduceOptimizer", "SGD"]
    for mine, theirs in zip(loaded.optimizer.inner_optimizer.inner_optimizer.variables,
                            model.optimizer.inner_optimizer.variables):
        np.testing.assert_array_equal(mine, theirs)


# kdist.load_model: Horovod's hvd.load_model.

class ScaledSGD(keras.optimizers.SGD):
    """An optimizer class Keras does not know unless it is named at load time."""


def test_load_model_wraps_a_plain_optimizer_and_keeps_its_state(tmp_path, float32_policy):
    # Under mixed_float16 Keras adds a loss scale, whose state must carry over too; the
    # plain case without one is in the tests below (a custom optimizer, a GAN).
    keras.config.set_dtype_policy("mixed_float16")
    model = _dense()
    model.compile(keras.optimizers.Adam(0.01), keras.losses.MeanSquaredError(),
                  metrics=[keras.metrics.MeanAbsoluteError()])
    _fit(model, 2)
    steps = int(model.optimizer.iterations)
    for fmt in ("keras", "h5"):
        model.save(tmp_path / f"plain.{fmt}")
    _fit(model, 1)
    for fmt in ("keras", "h5"):
        loaded = kdist.load_model(tmp_path / f"plain.{fmt}",
                                  compression=kdist.Compression.fp16)
        assert _chain(loaded.optimizer) == ["LossScaleOptimizer", "AllreduceOptimizer", "Adam"]
        assert isinstance(loaded.optimizer, kdist.precision.LossScaleOptimizer), fmt
        assert loaded.optimizer.inner_optimizer.compression.name == "fp16"
        assert int(loaded.optimizer.iterations) == steps, fmt
        history = _fit(loaded, 1)
        assert "mean_absolute_error" in history.history, "compiled as it was saved"
        assert float(loaded.optimizer.dynamic_scale) == float(model.optimizer.dynamic_scale)
        for mine, theirs in zip(loaded.get_weights(), model.get_weights()):
            np.testing.assert_allclose(mine, theirs, rtol=1e-6, atol=1e-7, err_msg=fmt)


def test_load_model_keeps_a_saved_distributed_optimizer_and_knows_custom_ones(tmp_path):
    model = _dense()
    model.compile(kdist.DistributedOptimizer(keras.optimizers.Adam(0.01),
                                             compression=kdist.Compression.topk(0.5)),
                  keras.losses.MeanSquaredError())
    _fit(model, 1)
    model.save(tmp_path / "distributed.keras")
    loaded = kdist.load_model(tmp_path / "distributed.keras", compression=kdist.Compression.fp16)
    assert _chain(loaded.optimizer) == ["AllreduceOptimizer", "Adam"]
    assert loaded.optimizer.compression.name == "topk", "a saved DistributedOptimizer is kept"

    model = _dense()
    model.compile(ScaledSGD(0.1, momentum=0.9), keras.losses.MeanSquaredError())
    _fit(model, 1)
    model.save(tmp_path / "custom.h5")
    with pytest.raises(TypeError, match="optimizer classes"):
        kdist.load_model(tmp_path / "custom.h5", custom_optimizers=["ScaledSGD"])
    loaded = kdist.load_model(tmp_path / "custom.h5", custom_optimizers=[ScaledSGD])
    assert _chain(loaded.optimizer) == ["AllreduceOptimizer", "ScaledSGD"]
    assert int(loaded.optimizer.iterations) == 4
    for mine, theirs in zip(loaded.optimizer.inner_optimizer.variables,
                            model.optimizer.variables):
        np.testing.assert_array_equal(mine, theirs)


def test_load_model_wraps_both_optimizers_of_a_gan(tmp_path):
    gan = _gan()
    gan.compile(d_optimizer=keras.optimizers.Adam(1e-3), g_optimizer=keras.optimizers.SGD(0.1))
    gan.fit(X[:, :2], batch_size=8, epochs=1, verbose=0)
    gan.save(tmp_path / "gan.keras")
    loaded = kdist.load_model(tmp_path / "gan.keras")
    assert _chain(loaded.d_optimizer) == ["AllreduceOptimizer", "Adam"]
    assert _chain(loaded.g_optimizer) == ["AllreduceOptimizer", "SGD"]
    assert (int(loaded.d_optimizer.iterations), int(loaded.g_optimizer.iterations)) == (4, 2)
    for mine, theirs in zip(loaded.d_optimizer.inner_optimizer.variables,
                            gan.d_optimizer.variables):
        np.testing.assert_array_equal(mine, theirs)


# Checkpoints match values to variables by path.

class _Two(keras.Model):
    """Two named layers, tracked (and so listed) in the order given."""

    def __init__(self, order, **kwargs):
        super().__init__(name="two", **kwargs)
        for name in order:
            setattr(self, name, keras.layers.Dense(2, name=name))

    def call(self, x):
        return self.b(self.a(x))


def _two(order, width=3):
    keras.backend.clear_session()  # the names a resumed run gets in its new process
    keras.utils.set_random_seed(0)
    model = _Two(order)
    model(np.ones((1, width), "float32"))
    model.compile(kdist.DistributedOptimizer(keras.optimizers.Adam(0.01)),
                  keras.losses.MeanSquaredError())
    return model


def test_a_model_listing_its_variables_in_another_order_resumes(tmp_path):
    straight = _two("ab")
    _fit(straight, 3)

    first = _two("ab")
    _fit(first, 2, callbacks=[kdist.callbacks.Checkpoint(tmp_path)])
    again = _two("ba")
    names = [v.path for v in model_state(again)]
    assert names != [v.path for v in model_state(first)] and sorted(names) == sorted(
        v.path for v in model_state(first)), "the same variables, listed in another order"
    resume = kdist.callbacks.Checkpoint(tmp_path)
    _fit(again, 3, callbacks=[resume])
    assert resume.resumed_from == 2
    assert int(again.optimizer.iterations) == int(straight.optimizer.iterations)
    for name in "ab":
        for mine, theirs in zip(getattr(again, name).get_weights(),
                                getattr(straight, name).get_weights()):
            np.testing.assert_allclose(mine, theirs, rtol=1e-6)


def test_a_checkpoint_from_another_model_names_what_differs(tmp_path):
    path = str(tmp_path / "epoch-000001.npz")
    checkpoint_lib.save_state(path, model_state(_two("ab")), 1)

    keras.backend.clear_session()
    other = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="a"),
                              keras.layers.Dense(2, name="c")], name="two")
    with pytest.raises(ValueError) as refused:
        checkpoint_lib.load_state(path, other.variables)
    missing, unexpected = str(refused.value).split("; ")
    assert "no value for 'two/c/kernel', 'two/c/bias' of this model" in missing
    assert "'two/b/kernel', 'two/b/bias'" in unexpected and "'adam/iteration'" in unexpected
    assert "two/a/" not in str(refused.value), "variables found by path are not reported"

    wider = model_state(_two("ab", width=5))  # a's kernel is (5, 2) here, (3, 2) there
    before = [np.array(v) for v in wider]
    with pytest.raises(ValueError, match=r"'two/a/kernel' is \(3, 2\) there and \(5, 2\) here"):
        checkpoint_lib.load_state(path, wider)
    for variable, value in zip(wider, before):
        np.testing.assert_array_equal(variable, value, err_msg="nothing assigned on refusal")


def test_a_model_built_again_in_one_process_is_told_why_it_does_not_match(tmp_path):
    path = str(tmp_path / "epoch-000001.npz")
    checkpoint_lib.save_state(path, _dense().variables, 1)
    again = _dense()  # same process, no clear_session: dense_2, dense_3, ...
    with pytest.raises(ValueError, match="clear_session"):
        checkpoint_lib.load_state(path, again.variables)


def test_variables_sharing_a_path_are_matched_in_their_order(tmp_path):
    path = str(tmp_path / "epoch-000001.npz")

    def variables(values):
        # Two variables with one path, as two optimizers given one name give.
        return [keras.Variable(value, name=name) for name, value in values]

    saved = variables([("step", 1), ("scale", [0.5, 0.25]), ("step", 2)])
    checkpoint_lib.save_state(path, saved, 7)
    restored = variables([("scale", [0.0, 0.0]), ("step", 0), ("step", 0)])
    assert checkpoint_lib.load_state(path, restored) == 7
    assert [np.asarray(v).tolist() for v in restored] == [[0.5, 0.25], 1, 2]

    with pytest.raises(ValueError, match="no value for 'step'"):
        checkpoint_lib.load_state(path, variables([("step", 0), ("step", 0), ("step", 0),
                                                   ("scale", [0.0, 0.0])]))
