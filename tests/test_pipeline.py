"""Pipeline parallelism: schedules, cutting models, and training that equals one process."""

import keras
import numpy as np
import pytest

from kdist.pipeline import schedule, split


def test_1f1b_fills_the_pipe_then_alternates_and_drains():
    assert schedule.actions("1f1b", 0, 4, 6) == [
        ("F", 0), ("F", 1), ("F", 2), ("F", 3), ("B", 0), ("F", 4), ("B", 1), ("F", 5),
        ("B", 2), ("B", 3), ("B", 4), ("B", 5)]
    assert schedule.actions("1f1b", 3, 4, 2) == [("F", 0), ("B", 0), ("F", 1), ("B", 1)]
    assert schedule.actions("gpipe", 1, 2, 3) == [
        ("F", 0), ("F", 1), ("F", 2), ("B", 2), ("B", 1), ("B", 0)]


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages, micro_batches", [(2, 1), (2, 4), (4, 4), (4, 8), (4, 16)])
def test_both_schedules_idle_the_gpipe_share_and_1f1b_holds_fewer(name, stages, micro_batches):
    _, bubble = schedule.simulate(name, stages, micro_batches)
    assert bubble == pytest.approx((stages - 1) / (micro_batches + stages - 1))
    held = [schedule.peak_in_flight(schedule.actions(name, s, stages, micro_batches))
            for s in range(stages)]
    if name == "gpipe":
        assert held == [micro_batches] * stages
    else:
        assert held == [min(stages - s, micro_batches) for s in range(stages)]


def test_unequal_passes_cost_gpipe_more_than_1f1b():
    # The first stage's passes 2.5 + 3.5, the last stage's 2 + 4: equal work per
    # micro-batch, split differently. 1F1B still idles the formula's share; in GPipe the
    # last stage's longer backward passes hold up the first stage's, which idles more.
    times = dict(forward_time=[2.5, 2.0], backward_time=[3.5, 4.0])
    assert schedule.simulate("1f1b", 2, 4, **times)[1] == pytest.approx(0.2)
    assert schedule.simulate("gpipe", 2, 4, **times)[1] == pytest.approx(0.238, abs=1e-3)
    with pytest.raises(ValueError, match="one time per stage"):
        schedule.simulate("gpipe", 2, 4, forward_time=[1.0])


def test_bad_schedules_are_refused():
    with pytest.raises(ValueError, match="Unknown pipeline schedule"):
        schedule.actions("interleaved", 0, 2, 2)
    with pytest.raises(ValueError, match="at least one micro-batch"):
        schedule.actions("1f1b", 0, 2, 0)
    with pytest.raises(ValueError, match="not one of the 2 stages"):
        schedule.actions("1f1b", 2, 2, 4)


def _sequential():
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, name="a"),
                             keras.layers.Dense(8, name="b"), keras.layers.Dense(2, name="c")])


def test_split_cuts_a_sequential_model_into_stages_that_share_its_layers():
    model = _sequential()
    first, second = split(model, ["b"])
    assert [layer.name for layer in first.layers] == ["a"]
    assert [layer.name for layer in second.layers] == ["b", "c"]
    x = np.ones((3, 4), "float32")
    np.testing.assert_allclose(second(first(x)), model(x), rtol=1e-6)


@pytest.mark.parametrize("cuts, message", [
    ([0], "between 1 and 2"), ([2, 1], "increasing"), (["nope"], "No layer is named"),
])
def test_split_refuses_bad_cuts(cuts, message):
    with pytest.raises(ValueError, match=message):
        split(_sequential(), cuts)


def test_split_needs_a_built_sequential_model():
    with pytest.raises(ValueError, match="Build the model"):
        split(keras.Sequential([keras.layers.Dense(2)]), [1])
    functional = keras.Model(*(lambda i: (i, keras.layers.Dense(2)(i)))(keras.Input((3,))))
    with pytest.raises(TypeError, match="one keras.Model per stage"):
        split(functional, [1])


def test_a_pipeline_needs_one_rank_per_stage_and_built_stages():
    import kdist
    from kdist.pipeline import PipelineModel

    kdist.init()
    with pytest.raises(ValueError, match="start 2 ranks"):
        PipelineModel(split(_sequential(), [1]))
    with pytest.raises(ValueError, match="replicas must be a whole number; got 0.5"):
        PipelineModel(split(_sequential(), [1]), replicas=0.5)
    with pytest.raises(ValueError, match="micro_batches"):
        PipelineModel([_sequential()], micro_batches=0)
    with pytest.raises(ValueError, match="not built"):
        PipelineModel([keras.Sequential([keras.layers.Dense(2)])])
    with pytest.raises(TypeError, match="keras.Model or a function"):
        PipelineModel(["dense"])
    with pytest.raises(ValueError, match="tensor_parallel must be a whole number"):
        PipelineModel([_sequential()], tensor_parallel=0)
    from kdist.comm.communicator import Communicator
    from kdist.pipeline.stages import build_stage
    with pytest.raises(TypeError, match="give a function that takes the group"):
        build_stage(_sequential(), 0, tensor_group=Communicator(None))
    model = PipelineModel([_sequential()])
    with pytest.raises(ValueError, match="needs a loss"):
        model.compile(optimizer="sgd")
    with pytest.raises(ValueError, match="jit_compile=True to PipelineModel"):
        model.compile(optimizer="sgd", loss="mse", jit_compile=True)
    with pytest.raises(NotImplementedError, match="save_weights"):
        model.save("x.keras")


def _check_equal(result, stages, replicas):
    assert sorted(result.results) == list(range(stages * replicas))
    for rank, report in result.results.items():
        assert report["stage"] == rank % stages and report["replica"] == rank // stages
        assert report["weight_error"] < 1e-5, report
        np.testing.assert_allclose(report["loss"], report["expected_loss"], rtol=1e-5)
        np.testing.assert_allclose(report["accuracy"], report["expected_accuracy"], rtol=1e-6)
        assert report["prediction_error"] < 1e-5
        assert report["restored_error"] < 1e-5
        assert report["checkpoint_error"] < 1e-5
        # kdist's own Checkpoint would save and broadcast rank 0's stage for all ranks.
        assert "holds a different part" in report["kdist_checkpoint_refused"]


@pytest.mark.parametrize("schedule_name, optimizer, recompute", [
    ("1f1b", "sgd", "0"), ("gpipe", "adam", "1")])
def test_two_stages_train_like_one_process(mpirun, tmp_path, schedule_name, optimizer,
                                           recompute):
    result = mpirun("pipeline_train.py", n=2, timeout=240, args=[
        2, 1, schedule_name, optimizer, recompute, tmp_path / "weights.h5"])
    _check_equal(result, 2, 1)


@pytest.mark.slow
def test_four_stages_and_two_by_two_hybrid_train_like_one_process(mpirun, tmp_path):
    result = mpirun("pipeline_train.py", n=4, timeout=300, args=[
        4, 1, "1f1b", "adam", "0", tmp_path / "four.h5"])
    _check_equal(result, 4, 1)
    hybrid = mpirun("pipeline_train.py", n=4, timeout=300, args=[
        2, 2, "1f1b", "sgd", "1", tmp_path / "hybrid.h5"])
    _check_equal(hybrid, 2, 2)
    # Saved by two replicas of two stages, loaded into four stages.
    assert all(r["relaid_prediction_error"] < 1e-5 for r in hybrid.results.values())


def test_stages_split_over_two_ranks_each_train_like_one_process(mpirun, tmp_path):
    result = mpirun("pipeline_tensor.py", n=4, timeout=300, args=[tmp_path / "tp.h5"])
    for rank in range(4):
        report = result.rank(rank)
        assert (report["stage"], report["tensor_rank"]) == (rank // 2, rank % 2)
        assert report["shard"] == ([10, 8] if rank < 2 else [12, 4])
        np.testing.assert_allclose(report["loss"], report["expected_loss"], rtol=1e-5)
        # The file holds the whole model, gathered from the slices.
        assert report["weight_error"] < 1e-5
        assert report["prediction_error"] < 1e-5


def test_a_weights_file_of_another_model_is_refused_and_its_own_loads(tmp_path):
    from kdist.pipeline import load_whole_model_weights
    from kdist.pipeline import model as pipeline_model
    from kdist.pipeline.stages import weighted_layers

    def build(outputs):
        return keras.Sequential([keras.Input((3,)), keras.layers.Dense(4),
                                 keras.layers.Dense(outputs)])

    saved = build(1)
    path = str(tmp_path / "pipe.weights.h5")
    pipeline_model._write_layers(
        path, {i: (layer.name, [w.numpy() for w in layer.weights])
               for i, layer in enumerate(weighted_layers(saved))}, overwrite=False)
    # Its first layer would fit; its second does not, and no layer changes.
    other = build(2)
    before = [w.copy() for w in other.get_weights()]
    with pytest.raises(ValueError, match=r"Layer 1 .* has shape \(4, 2\) .* another model"):
        load_whole_model_weights(other, path)
    assert all(np.array_equal(a, b) for a, b in zip(other.get_weights(), before))
    same = build(1)
    load_whole_model_weights(same, path)
    assert all(np.array_equal(a, b) for a, b in zip(same.get_weights(), saved.get_weights()))
