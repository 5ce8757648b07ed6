"""BOHB: Hyperband's budgets, ASHA's promotions, a model's proposals, through keras-tuner."""

import contextlib
import io
import tempfile

import keras
import keras_tuner as kt
import numpy as np
import pytest

import kdist.tune
from kdist.tune import bohb
from kdist.tune.space import Encoding


def _space():
    hp = kt.HyperParameters()
    hp.Float("x", 0.0, 1.0)
    hp.Float("y", 0.0, 1.0)
    return hp


def _curve(values):
    """A learning curve: the loss falls with epochs towards a floor set by (x, y)."""
    floor = (values["x"] - 0.3) ** 2 + (values["y"] - 0.7) ** 2
    return floor + 1.0 / values["tuner/epochs"]


def _oracle(directory, **kwargs):
    kwargs.setdefault("max_epochs", 9)
    kwargs.setdefault("factor", 3)
    oracle = kdist.tune.BOHBOracle(objective=kt.Objective("loss", "min"),
                                   hyperparameters=_space(), **kwargs)
    oracle._set_project_dir(str(directory), "bohb")
    oracle.verbose = 0
    return oracle


def _finish(oracle, trial, loss=None):
    oracle.update_trial(trial.trial_id, {"loss": _curve(trial.hyperparameters.values)
                                         if loss is None else loss})
    trial.status = "COMPLETED"
    oracle.end_trial(trial)


def _run_to_the_end(oracle):
    """Runs trials one at a time until the oracle stops; returns them in order."""
    trials = []
    while True:
        trial = oracle.create_trial("tuner0")
        if trial.status != "RUNNING":
            assert trial.status == "STOPPED"
            return trials
        trials.append(dict(trial.hyperparameters.values, id=trial.trial_id))
        _finish(oracle, trial)


@pytest.mark.parametrize("max_epochs,factor", [(8, 2), (9, 3), (27, 3), (100, 3), (10, 4)])
def test_budgets_are_keras_tuners_hyperband_budgets(max_epochs, factor):
    reference = kt.oracles.HyperbandOracle(objective=kt.Objective("loss", "min"),
                                           max_epochs=max_epochs, factor=factor)
    count = bohb.bracket_count(max_epochs, factor)
    assert count == reference._get_num_brackets()
    for bracket in range(count):
        for round_ in range(bracket + 1):
            assert (bohb.round_epochs(max_epochs, factor, bracket, round_)
                    == reference._get_epochs(bracket, round_))
            assert (bohb.round_size(max_epochs, factor, bracket, round_)
                    == reference._get_size(bracket, round_))
    # One synchronous iteration, run to its end, spends the default budget.
    reference.hyperparameters = _space()
    reference._set_project_dir(tempfile.mkdtemp(), "reference")
    reference.verbose = 0
    spent = 0
    while (trial := reference.create_trial("tuner0")).status == "RUNNING":
        values = trial.hyperparameters.values
        spent += values["tuner/epochs"] - values["tuner/initial_epoch"]
        _finish(reference, trial, loss=float(len(reference.trials) % 7))
    assert spent == bohb.iteration_epochs(max_epochs, factor)
    assert kdist.tune.BOHBOracle(max_epochs=max_epochs, factor=factor).budget == spent


def test_a_search_spends_its_budget_and_promotes_by_the_asha_rule(tmp_path):
    oracle = _oracle(tmp_path, budget=120, seed=3)
    trials = _run_to_the_end(oracle)
    spent = sum(t["tuner/epochs"] - t["tuner/initial_epoch"] for t in trials)
    assert 120 - 1 <= spent <= 120  # the cheapest trial costs 1 epoch
    by_id = {t["id"]: t for t in trials}
    promoted = [t for t in trials if "tuner/trial_id" in t]
    assert promoted and any(t["tuner/epochs"] == 9 and t["tuner/round"] == 2 for t in promoted)
    parents = [t["tuner/trial_id"] for t in promoted]
    assert len(parents) == len(set(parents))  # a trial is promoted once
    for child in promoted:
        parent = by_id[child["tuner/trial_id"]]
        assert child["tuner/bracket"] == parent["tuner/bracket"]
        assert child["tuner/round"] == parent["tuner/round"] + 1
        assert child["tuner/initial_epoch"] == parent["tuner/epochs"]
        assert (child["x"], child["y"]) == (parent["x"], parent["y"])
        # When it was promoted, the parent ranked in the best 1/factor of the
        # trials then finished in its bracket and round.
        order = list(by_id).index(child["id"])
        peers = [t for t in trials[:order] if t["tuner/bracket"] == parent["tuner/bracket"]
                 and t["tuner/round"] == parent["tuner/round"]]
        ranked = sorted(peers, key=_curve)
        assert parent in ranked[:len(ranked) // 3]
    # A round promotes no more than a third of its trials, as in Hyperband, even
    # when later trials displace promoted ones from its top third.
    for key in {(t["tuner/bracket"], t["tuner/round"]) for t in trials}:
        members = [t["id"] for t in trials if (t["tuner/bracket"], t["tuner/round"]) == key]
        assert sum(parent in members for parent in parents) <= len(members) // 3
    # Every bracket starts configurations, the aggressive ones more.
    starts = [t["tuner/bracket"] for t in trials if t["tuner/round"] == 0]
    assert set(starts) == {0, 1, 2}
    # In Hyperband's order: one iteration's 9 configurations at 1 epoch, 5 at 3, 3 at 9.
    assert starts[:17] == [2] * 9 + [1] * 5 + [0] * 3
    assert starts.count(2) > starts.count(1) > starts.count(0)
    # A configuration is never started twice.
    fresh = [(t["x"], t["y"]) for t in trials if t["tuner/round"] == 0]
    assert len(fresh) == len(set(fresh))


def test_concurrent_requests_are_never_idle_while_budget_is_left(tmp_path):
    oracle = _oracle(tmp_path, budget=60, seed=0)
    running, spent = [], 0
    for step in range(200):
        trial = oracle.create_trial(f"group{step}")
        if trial.status == "STOPPED":
            break
        assert trial.status == "RUNNING", f"request {step} got {trial.status}"
        values = trial.hyperparameters.values
        spent += values["tuner/epochs"] - values["tuner/initial_epoch"]
        running.append(trial)
        if len(running) == 4:  # four groups busy: the oldest finishes, then asks again
            _finish(oracle, running.pop(0))
    else:
        pytest.fail("the search never stopped")
    assert spent <= 60 and spent >= 60 - 1
    # Trials running when the budget ran out still finish and are recorded.
    for trial in running:
        _finish(oracle, trial)
    assert all(t.status == "COMPLETED" for t in oracle.trials.values())


def test_the_model_finds_better_configurations_than_random_ones(tmp_path):
    regrets = {}
    for fraction in (1.0, 0.0):
        found = []
        for seed in range(3):
            oracle = _oracle(tmp_path / f"{fraction}-{seed}", budget=150, seed=seed,
                             random_fraction=fraction, candidates=300)
            trials = _run_to_the_end(oracle)
            found.append(min(_curve(t) for t in trials if t["tuner/epochs"] == 9) - 1 / 9)
        regrets[fraction] = np.median(found)
    # Measured: 0.0068 for random configurations, 0.0003 for the model's.
    assert regrets[0.0] < 0.25 * regrets[1.0], regrets


def test_the_model_is_asked_about_the_full_budget_whatever_the_new_trial_starts_at(
        tmp_path, monkeypatch):
    oracle = _oracle(tmp_path, budget=60, seed=0, random_fraction=0.0, min_points=3)
    asked = []
    propose = oracle._propose

    def spying(encoding, finished, scores, pending, rng, context=(), incumbent=None):
        asked.append((list(context), finished[:, -1].copy(), np.asarray(incumbent).copy()))
        return propose(encoding, finished, scores, pending, rng, context, incumbent)

    monkeypatch.setattr(oracle, "_propose", spying)
    trials = _run_to_the_end(oracle)
    # Configurations started at 1, 3 and 9 epochs, most of them proposed.
    assert {t["tuner/epochs"] for t in trials if t["tuner/round"] == 0} == {1, 3, 9}
    assert len(asked) >= 6
    for context, fidelity, incumbent in asked:
        assert context == [1.0]  # log(9) / log(max_epochs = 9)
        # The results it must beat are those at the largest budget reached so far.
        assert incumbent.any() and np.all(fidelity[incumbent] == fidelity.max())


def test_state_round_trips_and_a_reloaded_search_goes_on_with_what_is_left(tmp_path):
    oracle = _oracle(tmp_path, budget=40, seed=1, random_fraction=0.5, min_points=4)
    for _ in range(8):
        _finish(oracle, oracle.create_trial("tuner0"))
    spent = oracle.spent
    state = oracle.get_state()
    copy = _oracle(tmp_path / "other")
    copy.set_state(state)
    for name in ("max_epochs", "factor", "budget", "hyperband_iterations", "random_fraction",
                 "min_points", "seed"):
        assert getattr(copy, name) == getattr(oracle, name), name

    reloaded = kdist.tune.BOHBOracle(objective=kt.Objective("loss", "min"))
    reloaded._set_project_dir(str(tmp_path), "bohb")
    reloaded.verbose = 0
    reloaded.reload()
    assert reloaded.budget == 40 and reloaded.spent == spent
    rest = _run_to_the_end(reloaded)
    assert spent + sum(t["tuner/epochs"] - t["tuner/initial_epoch"] for t in rest) <= 40


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="factor"):
        kdist.tune.BOHBOracle(factor=1)
    with pytest.raises(ValueError, match="max_epochs"):
        kdist.tune.BOHBOracle(max_epochs=0)
    with pytest.raises(ValueError, match="budget"):
        kdist.tune.BOHBOracle(budget=2.5)
    with pytest.raises(ValueError, match="random_fraction"):
        kdist.tune.BOHBOracle(random_fraction=1.5)
    with pytest.raises(ValueError, match="min_points"):
        kdist.tune.BOHBOracle(min_points=1)
    with pytest.raises(ValueError, match="seed"):
        kdist.tune.BOHBOracle(seed=-1)
    with pytest.raises(ValueError, match="factor needs to be an int larger than 1; got 2.5"):
        kdist.tune.BOHBOracle(factor=2.5)
    # Whole numbers from a config array are whole numbers.
    oracle = kdist.tune.BOHBOracle(max_epochs=np.int64(9), factor=np.int64(3), budget=27.0,
                                   min_points=np.int32(4))
    assert (oracle.max_epochs, oracle.factor, oracle.budget, oracle.min_points) == (9, 3, 27, 4)
    assert all(type(v) is int for v in (oracle.max_epochs, oracle.factor, oracle.budget,
                                        oracle.min_points))
    with pytest.raises(TypeError, match="max_epochs must be a whole number"):
        kdist.tune.BOHBOracle(max_epochs=True)


def test_the_bohb_tuner_trains_promoted_trials_on_from_their_parents(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype("float32")
    y = x @ np.array([1.0, -2.0, 0.5, 0.0], dtype="float32")
    epochs_run = []

    class Count(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            epochs_run.append(epoch)

    def build(hp):
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(hp.Float("lr", 1e-3, 1e-1, sampling="log")), "mse")
        return model

    tuner = kdist.tune.BOHB(build, objective="val_loss", max_epochs=4, factor=2, budget=24,
                            seed=0, min_points=2, xi=0.05, candidates=100,
                            directory=str(tmp_path), project_name="bohb")
    assert (tuner.oracle.min_points, tuner.oracle.xi, tuner.oracle.candidates) == (2, 0.05, 100)
    with contextlib.redirect_stdout(io.StringIO()):
        tuner.search(x, y, validation_data=(x, y), batch_size=16, verbose=0,
                     callbacks=[Count()])
    trials = list(tuner.oracle.trials.values())
    assert all(t.status == "COMPLETED" for t in trials)
    assert len(epochs_run) == tuner.oracle.spent <= 24
    child = next(t for t in trials if "tuner/trial_id" in t.hyperparameters.values)
    parent = tuner.oracle.trials[child.hyperparameters.values["tuner/trial_id"]]
    # The promoted trial starts from its parent's weights: its first epoch is
    # no worse than where the parent ended.
    first = child.metrics.get_history("val_loss")[0].value[0]
    assert first <= parent.score * 1.05
    best = tuner.get_best_hyperparameters(1)[0]
    assert 1e-3 <= best["lr"] <= 1e-1


def test_a_used_up_space_idles_while_running_trials_may_be_promoted_then_stops(tmp_path):
    # Two choices only: the space is used up after two configurations. While they run,
    # a tuner asking for work must wait (keras-tuner's Hyperband says IDLE), not leave;
    # once they finished and were promoted as far as the budget goes, STOPPED.
    hp = kt.HyperParameters()
    hp.Choice("x", [0.1, 0.3])
    oracle = kdist.tune.BOHBOracle(objective=kt.Objective("loss", "min"), hyperparameters=hp,
                                   max_epochs=9, factor=3)
    oracle._set_project_dir(str(tmp_path), "bohb")
    oracle.verbose = 0
    first, second = oracle.create_trial("t0"), oracle.create_trial("t1")
    assert first.status == second.status == "RUNNING"
    idle = oracle.create_trial("t2")
    assert idle.status == "IDLE"
    statuses = []
    for trial in (first, second):
        oracle.update_trial(trial.trial_id, {"loss": trial.hyperparameters.values["x"]})
        trial.status = "COMPLETED"
        oracle.end_trial(trial)
    while True:
        trial = oracle.create_trial("t0")
        statuses.append(trial.status)
        if trial.status != "RUNNING":
            break
        oracle.update_trial(trial.trial_id, {"loss": 0.01})
        trial.status = "COMPLETED"
        oracle.end_trial(trial)
    assert statuses[-1] == "STOPPED" and "IDLE" not in statuses


def test_a_bad_factor_is_refused_in_keras_tuners_words():
    for factor in (1, 2.5):
        with pytest.raises(ValueError, match="factor needs to be an int larger than 1"):
            kdist.tune.BOHBOracle(objective="loss", factor=factor)


def test_only_running_trials_at_the_asked_budget_set_the_score_to_beat(tmp_path, monkeypatch):
    # A running 1-epoch trial is believed to score like the 1-epoch results around it,
    # which a full training would not reach; only running trials at the budget the
    # model is asked about (max_epochs) may lower the score a proposal must beat.
    from kdist.tune import bayesian

    oracle = _oracle(tmp_path, seed=0)
    encoding = Encoding(oracle.hyperparameters, one_hot=True)
    rng = np.random.default_rng(0)
    # Full-budget results on a grid around a bowl whose bottom, (0.5, 0.5), no result has
    # reached; 1-epoch results at the same points, on a far lower scale.
    grid = np.array([(x, y) for x in (0.1, 0.3, 0.7, 0.9) for y in (0.1, 0.3, 0.7, 0.9)])
    bowl = 1.0 + np.sum((grid - 0.5) ** 2, axis=1)
    finished = np.vstack([np.hstack([grid, np.ones((16, 1))]),
                          np.hstack([grid, np.zeros((16, 1))])])
    losses = np.concatenate([bowl, bowl - 10.0])
    pending = np.array([[0.5, 0.5, 1.0], [0.5, 0.5, 0.0]])
    seen = {}
    fit = bayesian.fit_process
    monkeypatch.setattr(bayesian, "fit_process", lambda inputs, targets, rng: seen.setdefault(
        "model", fit(inputs, targets, rng)))
    improvement = bayesian.expected_improvement
    monkeypatch.setattr(bayesian, "expected_improvement", lambda mean, std, best, xi=0.0: (
        seen.setdefault("best", np.ravel(best)), improvement(mean, std, best, xi))[1])
    oracle._propose(encoding, finished, losses, pending, rng, context=[1.0],
                    incumbent=finished[:, -1] == 1.0)
    scores = bayesian.standardised(losses)
    scores = scores - scores.max()
    believed, spread = seen["model"].predict(pending, return_std=True)
    # The running full-budget trial is believed better than every full-budget result,
    # and the 1-epoch one better still.
    assert believed[1] < believed[0] < scores[:16].min()
    # Each fantasy's score to beat is its draw for the full-budget trial, when lower
    # than the best result; the 1-epoch trial's draws, far lower, never are.
    assert len(seen["best"]) == bayesian.FANTASIES
    assert np.median(seen["best"]) == pytest.approx(believed[0], abs=spread[0])
    assert seen["best"].min() > believed[1] + 3 * spread[1]
