"""Tensor-parallel layers: split over 2 ranks (and 2 pairs of 4) they compute what the
unsplit Keras layers compute, forward and backward; in a world of one they are those layers."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import kdist
from kdist.comm.communicator import Communicator
from kdist.tensor_parallel import (
    ColumnParallelDense,
    ColumnParallelEinsumDense,
    RowParallelDense,
    RowParallelEinsumDense,
    TensorParallelMultiHeadAttention,
)


def _failures(report):
    """Every comparison in a rank's report that is off, with where it is."""
    bad = []

    def walk(node, where):
        if isinstance(node, dict) and "ok" in node:
            if not node["ok"]:
                bad.append(f"{where}: {node['gap']}")
        elif isinstance(node, dict):
            for key, value in node.items():
                walk(value, f"{where}/{key}")
        elif isinstance(node, list):
            for index, value in enumerate(node):
                walk(value, f"{where}[{index}]")

    walk(report, "")
    return bad


def _check_cases(report, expected_cases, trained):
    assert sorted(report["cases"]) == sorted(expected_cases)
    for name, case in report["cases"].items():
        layer_weights, reference_weights = case["counts"]
        assert layer_weights == reference_weights, name
        assert len(case["weights"]) == layer_weights and case["full_weights"], name
    mlp = report["mlp"]
    assert mlp["loss_fell"]
    assert sorted(mlp["weights"]) == sorted(trained)
    for name in trained:
        np.testing.assert_allclose(mlp["losses"][name], mlp["losses"]["reference"], rtol=1e-5)
        assert [len(step) for step in mlp["weights"][name]] == [4] * len(mlp["losses"][name])
    assert _failures(report) == []


CASES = ["column_dense", "column_dense_gathered", "row_dense", "row_dense_whole_input",
         "einsum_column_heads", "einsum_column_shared_bias_gathered", "einsum_row_heads",
         "attention_self_causal", "attention_cross_masked"]


@pytest.mark.mpi
def test_split_over_two_ranks_equals_the_unsplit_layers(mpirun):
    result = mpirun("tensor_parallel.py", n=2, timeout=180)
    assert sorted(result.results) == [0, 1], result.output[-4000:]
    for rank in (0, 1):
        report = result.rank(rank)
        assert (report["group_size"], report["group_rank"]) == (2, rank)
        _check_cases(report, CASES, trained=["eager", "xla"])
        assert len(report["xla_attention"]["grads"]) == 9
        errors = report["errors"]
        assert "units (5) must be divisible by the group's size (2)" in errors["units"]
        assert "num_heads (3) must be divisible" in errors["heads"]
        assert "Axis 'd' of the output (3) must be divisible" in errors["einsum_heads"]
        assert "input width (5) must be divisible" in errors["row_width"]
        assert "unsplit kernel's rows (5) must be divisible" in errors["load_rows"]


@pytest.mark.mpi
def test_two_process_sets_of_two_ranks_split_their_layers_apart(mpirun):
    result = mpirun("tensor_parallel.py", n=4, args=["pairs"], timeout=180)
    assert sorted(result.results) == [0, 1, 2, 3], result.output[-4000:]
    for rank in range(4):
        report = result.rank(rank)
        assert (report["group_size"], report["group_rank"]) == (2, rank % 2)
        _check_cases(report, ["attention_self_causal"], trained=["eager"])
    # Each pair trained on its own data.
    assert result.rank(0)["mlp"]["losses"] == result.rank(1)["mlp"]["losses"]
    assert result.rank(0)["mlp"]["losses"] != result.rank(2)["mlp"]["losses"]
    # Tensor parallelism within pairs, data parallelism across them, in fit: the whole
    # MLP's training on the global batch.
    assert all(result.rank(r)["data_parallel_error"] < 1e-5 for r in range(4)), [
        result.rank(r)["data_parallel_error"] for r in range(4)]


# In a world of one rank, each split layer is the unsplit layer: same initial weights for
# the same seed, same outputs and same gradients.

def _same(got, expected):
    for g, e in zip(got, expected):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(e))


def _forward_backward(layer, inputs, call):
    inputs = [tf.constant(x) for x in inputs]
    with tf.GradientTape() as tape:
        tape.watch(inputs)
        loss = tf.reduce_sum(tf.sin(call(layer, inputs)))
    return [loss] + tape.gradient(loss, inputs + layer.trainable_weights)


ONE_RANK = {
    "column": (lambda: keras.layers.Dense(6, activation="relu"),
               lambda: ColumnParallelDense(6, activation="relu"), [(3, 4)], None),
    "column_gathered": (lambda: keras.layers.Dense(6),
                        lambda: ColumnParallelDense(6, gather_output=True), [(3, 4)], None),
    "row": (lambda: keras.layers.Dense(5), lambda: RowParallelDense(5), [(3, 4)], None),
    "row_whole_input": (lambda: keras.layers.Dense(5, use_bias=False),
                        lambda: RowParallelDense(5, input_is_parallel=False, use_bias=False),
                        [(3, 4)], None),
    "einsum_column": (lambda: keras.layers.EinsumDense("abc,cde->abde", (None, 2, 3),
                                                       bias_axes="e"),
                      lambda: ColumnParallelEinsumDense("abc,cde->abde", (None, 2, 3), "d",
                                                        bias_axes="e"), [(2, 3, 4)], None),
    "einsum_row": (lambda: keras.layers.EinsumDense("abcd,cde->abe", (None, 4),
                                                    bias_axes="e"),
                   lambda: RowParallelEinsumDense("abcd,cde->abe", (None, 4), "c",
                                                  bias_axes="e"), [(2, 3, 2, 5)], None),
    "attention": (lambda: keras.layers.MultiHeadAttention(2, 3, output_shape=5),
                  lambda: TensorParallelMultiHeadAttention(2, 3, output_shape=5),
                  [(2, 3, 4), (2, 6, 4)],
                  lambda layer, xs: layer(xs[0], xs[1], use_causal_mask=True)),
}


@pytest.mark.parametrize("name", sorted(ONE_RANK))
def test_in_a_world_of_one_each_layer_is_the_unsplit_layer(name):
    make_reference, make_split, shapes, call = ONE_RANK[name]
    call = call or (lambda layer, xs: layer(*xs))
    rng = np.random.default_rng(0)
    inputs = [rng.normal(size=shape).astype("float32") for shape in shapes]
    keras.utils.set_random_seed(1)
    reference = make_reference()
    expected = _forward_backward(reference, inputs, call)
    keras.utils.set_random_seed(1)
    split = make_split()
    got = _forward_backward(split, inputs, call)
    assert len(got) == len(expected)
    _same(got, expected)  # the same weights from the same seed, and the same numbers
    # Other weights come in through load_from_full, and full_weights gives them back.
    reference.set_weights([rng.normal(size=w.shape) for w in reference.get_weights()])
    split.load_from_full(reference)
    _same(split.full_weights(), reference.get_weights())
    _same(_forward_backward(split, inputs, call), _forward_backward(reference, inputs, call))
    # A fresh layer builds itself from the unsplit weights' shapes.
    fresh = make_split()
    fresh.load_from_full(reference.get_weights())
    _same(call(fresh, [tf.constant(x) for x in inputs]),
          call(reference, [tf.constant(x) for x in inputs]))


def test_attention_with_dropout_in_training_masks_as_keras_does():
    # Training with dropout takes the explicit softmax path instead of Keras's fused one;
    # at a negligible rate it must agree with the unsplit layer's masked attention.
    rng = np.random.default_rng(0)
    query, value = (tf.constant(rng.normal(size=s).astype("float32"))
                    for s in ((2, 4, 6), (2, 5, 6)))
    mask = rng.random((2, 4, 5)) < 0.6
    mask[:, :, 0] = True
    reference = keras.layers.MultiHeadAttention(2, 3)
    expected = reference(query, value, attention_mask=mask, use_causal_mask=True)
    split = TensorParallelMultiHeadAttention(2, 3, dropout=1e-9, seed=1)
    split.load_from_full(reference)
    got = split(query, value, attention_mask=mask, use_causal_mask=True, training=True)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_configs_round_trip_and_models_save_and_load(tmp_path):
    x = np.random.default_rng(0).normal(size=(2, 3, 8)).astype("float32")
    inputs = keras.Input((3, 8))
    hidden = ColumnParallelDense(16, activation="gelu")(inputs)
    hidden = RowParallelDense(8)(hidden)
    heads = ColumnParallelEinsumDense("abc,cde->abde", (None, 2, 4), "d", bias_axes="de")(hidden)
    merged = RowParallelEinsumDense("abcd,cde->abe", (None, 8), "c", bias_axes="e")(heads)
    outputs = TensorParallelMultiHeadAttention(2, 4, dropout=0.1)(merged, merged)
    model = keras.Model(inputs, outputs)
    for layer in model.layers[1:]:
        config = layer.get_config()
        assert "group" not in config
        assert type(layer).from_config(config).get_config() == config
    model.save(tmp_path / "model.keras")
    loaded = keras.models.load_model(tmp_path / "model.keras")
    np.testing.assert_allclose(loaded(x), model(x), rtol=1e-6)


def test_groups_are_the_world_a_process_set_or_a_communicator():
    kdist.init()
    assert ColumnParallelDense(4).comm is kdist.comm.world()
    assert ColumnParallelDense(4, group=kdist.global_process_set).comm is kdist.comm.world()
    own = Communicator()
    assert RowParallelDense(4, group=own).comm is own
    with pytest.raises(TypeError, match="group must be None"):
        ColumnParallelDense(4, group=[0, 1])


def test_bad_arguments_and_inputs_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="units must be a positive integer"):
        ColumnParallelDense(0)
    with pytest.raises(ValueError, match="needs gather_output=True"):
        ColumnParallelDense(4, activation="softmax")
    with pytest.raises(ValueError, match=r"no '\.\.\.'"):
        ColumnParallelEinsumDense("...b,bc->...c", (4,), "c")
    with pytest.raises(ValueError, match="split_axis must be one letter of the kernel"):
        ColumnParallelEinsumDense("abc,cd->abd", (None, 4), "x")
    with pytest.raises(ValueError, match="column-parallel split needs a kernel axis that is an "
                                         "output axis"):
        ColumnParallelEinsumDense("abc,cd->abd", (None, 4), "c")
    with pytest.raises(ValueError, match="row-parallel split needs a kernel axis that is "
                                         "contracted"):
        RowParallelEinsumDense("abc,cd->abd", (None, 4), "d")
    with pytest.raises(ValueError, match="'z' is not an output axis"):
        RowParallelEinsumDense("abc,cd->abd", (None, 4), "c", bias_axes="z")
    with pytest.raises(ValueError, match="output_shape"):
        RowParallelEinsumDense("abc,cd->abd", (4,), "c")
    with pytest.raises(ValueError, match="num_heads must be a positive integer"):
        TensorParallelMultiHeadAttention(0, 4)

    dense = ColumnParallelDense(4)
    dense.build((None, 3))
    with pytest.raises(ValueError, match=r"expects inputs of width 3 on axis -1; got an input "
                                         r"of shape \(2, 5\)"):
        dense(np.ones((2, 5), "float32"))
    row = RowParallelDense(4)
    row.build((None, 6))
    with pytest.raises(ValueError, match="slice of the input features of width 6"):
        row(np.ones((2, 5), "float32"))
    with pytest.raises(ValueError, match=r"the unsplit kernel should have shape \(6, 4\); got "
                                         r"\(5, 4\)"):
        row.load_from_full([np.ones((5, 4)), np.ones(4)])
    with pytest.raises(ValueError, match="holds 2 weights"):
        row.load_from_full([np.ones((6, 4))])
    with pytest.raises(ValueError, match="needs a built Dense"):
        row.load_from_full(keras.layers.Dense(4))
    with pytest.raises(TypeError, match="takes the unsplit layer"):
        row.load_from_full("weights.h5")
    with pytest.raises(ValueError, match="is not built yet"):
        RowParallelDense(4).full_weights()

    attention = TensorParallelMultiHeadAttention(2, 4)
    with pytest.raises(ValueError, match=r"query of shape \(batch, length, features\)"):
        attention(np.ones((2, 8), "float32"), np.ones((2, 8), "float32"))
    with pytest.raises(ValueError, match="takes 8 weights"):
        TensorParallelMultiHeadAttention(2, 4).load_from_full([np.ones((4, 2, 4))] * 4)
