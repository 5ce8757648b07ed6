"""The parameter server's update rules, optimizers, layout and settings, on one process."""

import keras
import numpy as np
import pytest

from kdist.ps import algorithms, master_optimizers, messages, rules
from kdist.ps.layout import Layout
from kdist.ps.server import mean_logs
from kdist.ps.hierarchy import shard_bounds, topology


def _rng_arrays(n=64, count=3, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.normal(size=n).astype(np.float32) for _ in range(count)]


def test_easgd_moves_worker_and_centre_towards_each_other_by_the_same_amount():
    worker, center, _ = _rng_arrays()
    w0, c0 = worker.copy(), center.copy()
    algorithms.easgd_exchange_(worker, center, 0.3, np.empty_like(worker))
    np.testing.assert_allclose(worker, w0 - 0.3 * (w0 - c0), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(center, c0 + 0.3 * (w0 - c0), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(worker + center, w0 + c0, rtol=1e-6, atol=1e-6)


def test_easgd_with_force_one_moves_the_centre_onto_the_worker():
    worker, center, _ = _rng_arrays()
    w0 = worker.copy()
    algorithms.easgd_exchange_(worker, center, 1.0, np.empty_like(worker))
    np.testing.assert_allclose(center, w0, atol=1e-6)


@pytest.mark.parametrize("force", [0.0, -0.1, 1.5])
def test_easgd_rejects_a_force_outside_zero_one(force):
    worker, center, _ = _rng_arrays()
    with pytest.raises(ValueError, match="elastic_force"):
        algorithms.easgd_exchange_(worker, center, force, np.empty_like(worker))


def test_gem_scale_follows_the_formula_and_is_clipped():
    update, momentum, drift = _rng_arrays()
    kappa = 1.5
    expected = np.clip((kappa * np.abs(momentum) - np.abs(drift)) / (np.abs(update) + 1e-8),
                       0, algorithms.GEM_MAX_SCALE)
    np.testing.assert_allclose(algorithms.gem_scale(update, momentum, drift, kappa), expected,
                               rtol=1e-5)
    huge = algorithms.gem_scale(np.full(4, 1e-6, np.float32), np.ones(4, np.float32),
                                np.zeros(4, np.float32), 2.0)
    assert huge.max() == algorithms.GEM_MAX_SCALE
    none = algorithms.gem_scale(np.ones(4, np.float32), np.zeros(4, np.float32),
                                np.ones(4, np.float32), 2.0)
    assert none.max() == 0.0


def test_gem_apply_updates_momentum_then_adds_the_rescaled_update():
    update, momentum, drift = _rng_arrays()
    center = np.zeros_like(update)
    u0, m0 = update.copy(), momentum.copy()
    algorithms.gem_apply_(center, update, momentum, drift, kappa=2.0, mu=0.9)
    m1 = 0.9 * m0 + u0
    np.testing.assert_allclose(momentum, m1, rtol=1e-6)
    factor = np.clip((2.0 * np.abs(m1) - np.abs(drift)) / (np.abs(u0) + 1e-8), 0, 5)
    np.testing.assert_allclose(center, u0 * factor, rtol=1e-5, atol=1e-6)


def test_staleness_counts_updates_since_the_pull_and_scales_the_rate():
    assert algorithms.staleness(10, 7) == 3
    assert algorithms.staleness_factor(0) == 1.0
    assert algorithms.staleness_factor(4) == 0.25
    with pytest.raises(ValueError):
        algorithms.staleness(3, 5)


def test_downpour_with_sgd_at_rate_one_adds_the_update_into_the_reply():
    update, center, reply = _rng_arrays()
    before = center.copy()
    algorithms.downpour_apply(center, update.copy(), master_optimizers.MasterSGD(), reply)
    np.testing.assert_allclose(reply, before + update, rtol=1e-6)
    np.testing.assert_array_equal(center, before)  # the old centre is left alone


def test_downpour_staleness_scale_multiplies_the_step():
    update, center, _ = _rng_arrays()
    expected = center + 0.25 * 0.5 * update
    algorithms.downpour_apply(center, update.copy(), master_optimizers.MasterSGD(0.5), center,
                              0.25)
    np.testing.assert_allclose(center, expected, rtol=1e-5)


def test_easgd_can_write_the_worker_elsewhere():
    worker, center, out = _rng_arrays()
    w0, c0 = worker.copy(), center.copy()
    algorithms.easgd_exchange_(worker, center, 0.5, np.empty_like(worker), worker_out=out)
    np.testing.assert_array_equal(worker, w0)
    np.testing.assert_allclose(out, w0 - 0.5 * (w0 - c0), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name,ours,theirs", [
    ("sgd", master_optimizers.MasterSGD(0.1, momentum=0.9),
     keras.optimizers.SGD(0.1, momentum=0.9)),
    ("adam", master_optimizers.MasterAdam(0.01), keras.optimizers.Adam(0.01)),
])
def test_master_optimizers_match_keras_with_the_update_as_minus_the_gradient(name, ours,
                                                                           theirs):
    updates = _rng_arrays(n=16, count=5, seed=1)
    center = np.linspace(-1, 1, 16).astype(np.float32)
    variable = keras.Variable(center.copy())
    for update in updates:
        theirs.apply([keras.ops.convert_to_tensor(-update)], [variable])
        ours.apply_(center, update.copy())
    np.testing.assert_allclose(center, keras.ops.convert_to_numpy(variable), rtol=1e-4,
                               atol=1e-5)


def test_master_optimizer_state_round_trips():
    opt = master_optimizers.MasterAdam(0.01)
    center = np.zeros(8, np.float32)
    for update in _rng_arrays(n=8):
        opt.apply_(center, update)
    restored = master_optimizers.get(opt.get_config())
    restored.set_state(opt.get_state())
    a, b = center.copy(), center.copy()
    opt.apply_(a, np.ones(8, np.float32))
    restored.apply_(b, np.ones(8, np.float32))
    np.testing.assert_array_equal(a, b)


def test_unknown_master_optimizer_says_what_is_known():
    with pytest.raises(ValueError, match="'sgd', 'adam'"):
        master_optimizers.get("rmsprop")


def test_staleness_aware_downpour_divides_the_update_by_its_staleness():
    rule = rules.make("downpour", 4, staleness_aware=True)
    center, reply = np.zeros(4, np.float32), np.zeros(4, np.float32)
    center = rule.absorb(1, np.full(4, 2.0, np.float32), center, reply, stale=4)
    np.testing.assert_allclose(center, 0.5)
    plain = rules.make("downpour", 4)
    out = plain.absorb(1, np.full(4, 2.0, np.float32), np.zeros(4, np.float32),
                       np.zeros(4, np.float32), stale=4)
    np.testing.assert_allclose(out, 2.0)


def test_gem_rule_uses_the_centre_the_child_last_pulled():
    rule = rules.make("gem", 4, gem_kappa=1.0, gem_momentum=0.0)
    center = np.full(4, 2.0, np.float32)
    reply = np.full(4, 2.0, np.float32)  # what child 1 pulled: no drift since
    center = rule.absorb(1, np.ones(4, np.float32), center, reply, stale=0)
    # No drift, momentum == update, kappa 1: the update passes unscaled.
    assert center is reply
    np.testing.assert_allclose(center, 3.0)
    other = np.full(4, 2.5, np.float32)  # child 2 pulled when the centre was 2.5
    center = rule.absorb(2, np.ones(4, np.float32), center, other, stale=1)
    np.testing.assert_allclose(center, 3.0 + 0.5, rtol=1e-6)


def test_topology_places_masters_submasters_and_workers():
    assert topology(3) == ({1: 0, 2: 0}, {0: [1, 2]})
    parent, children = topology(7, submasters=2)
    assert children == {0: [1, 2], 1: [3, 5], 2: [4, 6]}
    assert parent[5] == 1 and parent[1] == 0
    # Two top servers: ranks 0 and 1; the children of "0" exchange with both.
    parent, children = topology(6, submasters=1, servers=2)
    assert children == {0: [2], 2: [3, 4, 5]} and parent == {2: 0, 3: 2, 4: 2, 5: 2}


def test_shards_cover_the_centre_once_in_near_equal_parts():
    for size, servers in ((10, 3), (451, 2), (7, 7), (1000003, 4)):
        bounds = shard_bounds(size, servers)
        assert bounds[0][0] == 0 and bounds[-1][1] == size
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
        lengths = [stop - start for start, stop in bounds]
        assert max(lengths) - min(lengths) <= 1


@pytest.mark.parametrize("size,submasters,servers,match", [
    (1, 0, 1, "at least 2 ranks"),
    (4, 2, 1, "need at least 2 workers"),
    (4, -1, 1, "0 or more"),
    (2, 0, 2, "at least 3 ranks"),
    (4, 0, 0, "servers must be a whole number, at least 1"),
    (4, 0, 1.5, "servers must be a whole number; got 1.5"),
])
def test_topology_rejects_impossible_layouts(size, submasters, servers, match):
    with pytest.raises(ValueError, match=match):
        topology(size, submasters, servers)


@pytest.mark.parametrize("kwargs,match", [
    ({"sync_every": 0}, "sync_every"),
    ({"elastic_force": 1.5}, "elastic_force"),
    ({"elastic_force": 0.0}, "elastic_force"),
    ({"elastic_step_scale": 0}, "elastic_step_scale"),
    ({"elastic_step_scale": "ranks"}, "elastic_step_scale"),
    ({"elastic_step_scale": True}, "elastic_step_scale"),
    ({"mode": "hogwild"}, "mode"),
    ({"gem_kappa": 0}, "gem_kappa"),
    ({"gem_momentum": 1.0}, "gem_momentum"),
    ({"validate_every": 0}, "validate_every"),
    ({}, "at least 2 ranks"),
])
def test_strategy_rejects_bad_settings_with_what_to_change(kwargs, match):
    import kdist

    with pytest.raises(ValueError, match=match):
        kdist.ps.ParameterServerStrategy(**kwargs)


def test_layout_round_trips_a_model_with_trainable_values_first():
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4),
                              keras.layers.BatchNormalization(), keras.layers.Dense(2)])
    layout = Layout(model)
    trainable = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    assert layout.trainable_size == trainable
    assert layout.size == trainable + sum(int(np.prod(v.shape))
                                          for v in model.non_trainable_variables)
    flat = layout.read()
    layout.write(flat * 2)
    np.testing.assert_allclose(layout.read(), flat * 2, rtol=1e-6)
    with pytest.raises(ValueError, match="Expected"):
        layout.write(flat[:-1])


def test_message_header_and_body_share_one_buffer():
    message = messages.Message(5)
    message.set(kind=messages.EPOCH_END, epoch=3, stop=True, steps=17)
    message.body[:] = 1.5
    assert (message.kind, message.epoch, message.stop, message.steps) == (
        messages.EPOCH_END, 3, True, 17)
    assert message.raw.nbytes == messages.HEADER_SLOTS * 8 + 5 * 4
    assert np.frombuffer(message.raw[-4:].tobytes(), np.float32)[0] == 1.5


def test_mean_logs_averages_each_metric_over_children():
    assert mean_logs({1: {"loss": 1.0, "acc": 0.5}, 2: {"loss": 3.0}}) == {"loss": 2.0,
                                                                          "acc": 0.5}


@pytest.fixture(params=["fused", "numpy"])
def rule_kernels(request, monkeypatch):
    """Runs a test with the compiled loops, then with the numpy fallback."""
    from kdist.ps import kernels

    if request.param == "fused":
        if kernels.compiled() is None:
            pytest.fail(f"the fused loops did not build: {kernels._failure}")
    else:
        monkeypatch.setattr(kernels, "_loops", None)
        monkeypatch.setattr(kernels, "_failure", "off for this test")
    return request.param


def _rule_inputs(seed, n=1001):
    rng = np.random.default_rng(seed)
    return [rng.normal(size=n).astype(np.float32) for _ in range(4)]


def test_easgd_rule_in_one_pass_equals_the_formula(rule_kernels):
    worker, center, _, _ = _rule_inputs(0)
    expected_center = center + 0.3 * (worker - center)
    expected_reply = worker - 0.3 * (worker - center)
    rule = rules.EasgdRule(worker.size, 0.3)
    reply = np.empty_like(center)
    result = rule.absorb(1, worker.copy(), center, reply, 0)
    assert result is center
    np.testing.assert_allclose(center, expected_center, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(reply, expected_reply, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("staleness_aware", [False, True])
def test_gem_rule_in_one_pass_equals_the_formula(rule_kernels, staleness_aware):
    update, center, pulled, momentum = _rule_inputs(1)
    update *= 0.1
    kappa, mu, stale = 1.5, 0.9, 3
    m = mu * momentum + update
    factor = np.clip((kappa * np.abs(m) - np.abs(center - pulled))
                     / (np.abs(update) + algorithms.GEM_EPS), 0.0, algorithms.GEM_MAX_SCALE)
    step = factor * update * (1.0 / stale if staleness_aware else 1.0)
    rule = rules.GemRule(update.size, kappa, mu, staleness_aware)
    rule.momenta[2] = momentum.copy()
    reply = pulled.copy()  # the reply buffer holds what the child pulled; the new centre goes there
    result = rule.absorb(2, update.copy(), center.copy(), reply, stale)
    assert result is reply
    np.testing.assert_allclose(reply, center + step, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(rule.momenta[2], m, rtol=1e-6, atol=1e-7)
    assert rule.last_mean_scale == pytest.approx(float(factor.mean()), rel=1e-5)
    assert 0 < (factor == algorithms.GEM_MAX_SCALE).sum() and 0 < (factor == 0).sum()


def test_a_checkpoint_resumes_only_with_its_mode_and_number_of_servers(tmp_path):
    from kdist.ps import master_checkpoint

    snapshot = {"center": np.arange(4, dtype=np.float32), "clock": 7,
                "rule": {"momentum/2": np.ones(2, np.float32),
                         "shard1/momentum/2": np.ones(2, np.float32)}}
    config = {"mode": "gem", "servers": 2}
    master_checkpoint.save(tmp_path, 3, snapshot, config, {"loss": [1.0]})
    loaded = master_checkpoint.load(tmp_path, 4, config)
    assert (loaded["epoch"], loaded["clock"]) == (3, 7)
    assert set(loaded["rule"]) == {"momentum/2", "shard1/momentum/2"}
    with pytest.raises(ValueError, match="written by 2 server"):
        master_checkpoint.load(tmp_path, 4, {"mode": "gem", "servers": 1})
    with pytest.raises(ValueError, match="written in mode 'gem'"):
        master_checkpoint.load(tmp_path, 4, {"mode": "easgd", "servers": 2})
    with pytest.raises(ValueError, match="another model"):
        master_checkpoint.load(tmp_path, 5, config)


def test_the_scope_hands_models_compiled_in_it_to_the_strategy_and_changes_no_class():
    import sys
    import threading

    import kdist

    class TwoRanks:  # what the strategy reads of its communicator when built
        size, rank = 2, 0

    class OwnCompile(keras.Sequential):
        def compile(self, *args, **kwargs):
            super().compile(*args, **kwargs)

    def build(cls=keras.Sequential):
        return cls([keras.Input((3,)), keras.layers.Dense(2)])

    strategy = kdist.ps.ParameterServerStrategy(comm=TwoRanks())
    compile_before, seen = keras.Model.compile, []

    def profiler(frame, event, arg):  # a profile function set before the block
        seen.append(event)

    sys.setprofile(profiler)
    try:
        with strategy.scope():
            inside, subclassed, failed = build(), build(OwnCompile), build()
            inside.compile("sgd", "mse")
            subclassed.compile("sgd", "mse")
            with pytest.raises(ValueError):
                failed.compile("no_such_optimizer", "mse")
            elsewhere = build()
            thread = threading.Thread(target=lambda: elsewhere.compile("sgd", "mse"))
            thread.start()
            thread.join()
            assert keras.Model.compile is compile_before
        assert sys.getprofile() is profiler
    finally:
        sys.setprofile(None)
    assert seen  # still called while the block was open
    outside = build()
    outside.compile("sgd", "mse")
    assert "fit" in vars(inside) and "fit" in vars(subclassed)
    for model in (failed, elsewhere, outside):
        assert "fit" not in vars(model)
    assert inside.fit.func == strategy.fit and inside.fit.args == (inside,)
