"""Population-based training: exploit carries weights, step count and optimizer
slots; explore moves hyper-parameters within their bounds; schedules replay;
a killed search resumes."""

import json
import os
import subprocess
import sys
import textwrap
import warnings

import keras
import keras_tuner as kt
import numpy as np
import pytest

import kdist.tune
from kdist.tune import bandit, population
from kdist.tune.pbt import restore_training_state, save_training_state

ROWS, BATCH = 256, 32
STEPS = 6  # an epoch, on the three quarters of the rows that train


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, 8)).astype("float32")
    return x, (x @ rng.normal(size=8) > 0).astype("float32")


def _build(hp):
    model = keras.Sequential([
        keras.Input((8,)), keras.layers.Dense(8, activation="relu"),
        keras.layers.Dropout(hp.Float("dropout", 0.0, 0.5)),
        keras.layers.Dense(1, activation="sigmoid")])
    rate = hp.Float("learning_rate", 1e-4, 0.2, sampling="log")
    model.compile(keras.optimizers.Adam(rate), "binary_crossentropy", metrics=["accuracy"])
    return model


class _Starts(keras.callbacks.Callback):
    """What each round starts from and ends with: step count, learning rate,
    weights, optimizer slots."""

    def __init__(self):
        super().__init__()
        self.seen, self.ended = [], []

    def _state(self):
        optimizer = self.model.optimizer
        slots = [keras.ops.convert_to_numpy(v).copy() for v in optimizer.variables
                 if v.name not in ("iteration", "learning_rate")]
        return {"iterations": int(optimizer.iterations.numpy()),
                "learning_rate": float(optimizer.learning_rate.numpy()),
                "weights": [w.copy() for w in self.model.get_weights()], "slots": slots}

    def on_train_begin(self, logs=None):
        self.seen.append(self._state())

    def on_train_end(self, logs=None):
        self.ended.append(self._state())


def _search(tmp_path, starts=None, **options):
    settings = dict(objective="val_loss", population_size=4, perturbation_interval=1,
                    max_epochs=3, seed=3)
    settings.update(options)
    tuner = kdist.tune.PBT(_build, directory=str(tmp_path), project_name="pbt",
                           overwrite=True, **settings)
    callbacks = [starts] if starts is not None else []
    tuner.search(*_data(), validation_split=0.25, batch_size=BATCH, verbose=0,
                 callbacks=callbacks)
    return tuner


def _rounds(tuner):
    return [(trial_id, trial.hyperparameters.values)
            for trial_id, trial in sorted(tuner.oracle.trials.items())]


def test_exploit_hands_over_weights_step_count_and_slots_and_keeps_the_explored_rate(
        tmp_path):
    starts = _Starts()
    # Perturbed, never resampled: an explored rate is the donor's times 1.2 or 0.8.
    tuner = _search(tmp_path, starts, resample_probability=0.0)
    rounds = _rounds(tuner)
    assert len(rounds) == 4 * 3 and all(
        t.status == "COMPLETED" for t in tuner.oracle.trials.values())
    by_id = dict(rounds)
    ended = {trial_id: state for (trial_id, _), state in zip(rounds, starts.ended)}
    exploited = 0
    for (trial_id, values), start in zip(rounds, starts.seen):
        parent = values.get("tuner/trial_id")
        assert start["learning_rate"] == pytest.approx(values["learning_rate"], rel=1e-6)
        if values["tuner/initial_epoch"] == 0:
            # A member is never a donor before it has finished a round.
            assert parent is None and start["iterations"] == 0
            continue
        donor = by_id[parent]
        assert donor["tuner/epochs"] == values["tuner/initial_epoch"]
        # No reset: the round starts where the donor's training ended, step count,
        # weights and optimizer slots alike.
        assert start["iterations"] == ended[parent]["iterations"] == (
            STEPS * values["tuner/initial_epoch"])
        for ours, theirs in zip(start["weights"] + start["slots"],
                                ended[parent]["weights"] + ended[parent]["slots"]):
            np.testing.assert_array_equal(ours, theirs)
        if donor["pbt/member"] != values["pbt/member"]:
            exploited += 1
            ratio = values["learning_rate"] / donor["learning_rate"]
            assert (ratio == pytest.approx(1.2) or ratio == pytest.approx(0.8)
                    or values["learning_rate"] in (pytest.approx(1e-4), pytest.approx(0.2)))
            # The member's schedule now starts with the donor's history.
            schedule = tuner.learned_schedule(trial_id)
            assert schedule[-1] == {"epoch": values["tuner/initial_epoch"],
                                    "values": population.searched_values(values)}
            assert schedule[:-1] == tuner.learned_schedule(parent)
        else:
            assert population.searched_values(values) == population.searched_values(donor)
    # One bottom member of four at each of the two boundaries.
    assert exploited == 2
    # Synchronous: no round starts before every member finished the one before.
    starts_in_order = [values["tuner/initial_epoch"] for _, values in rounds]
    assert starts_in_order == sorted(starts_in_order)


def test_a_failed_first_round_starts_afresh_and_the_member_catches_up(tmp_path):
    failed = []

    def flaky_build(hp):
        if hp.values.get("pbt/member") == 1 and not failed:
            failed.append(hp.values["tuner/initial_epoch"])
            raise ValueError("this round cannot be built")
        return _build(hp)

    tuner = kdist.tune.PBT(flaky_build, objective="val_loss", population_size=3,
                           perturbation_interval=1, max_epochs=2, seed=1,
                           directory=str(tmp_path), overwrite=True)
    tuner.search(*_data(), validation_split=0.25, batch_size=BATCH, verbose=0)
    assert failed == [0]
    statuses = sorted(t.status for t in tuner.oracle.trials.values())
    assert statuses == ["COMPLETED"] * 6 + ["FAILED"]
    retried = [values for _, values in _rounds(tuner)
               if values["pbt/member"] == 1 and values["tuner/initial_epoch"] == 0]
    assert len(retried) == 2 and all("tuner/trial_id" not in v for v in retried)


def test_the_best_model_and_its_learned_schedule_replay_in_plain_keras(tmp_path):
    tuner = _search(tmp_path, max_epochs=2)
    best = tuner.oracle.get_best_trials(1)[0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = tuner.get_best_models(1)[0]
    assert not [w for w in caught if "Skipping variable loading" in str(w.message)]
    x, y = _data()
    assert model.evaluate(x[-64:], y[-64:], verbose=0)[0] == pytest.approx(best.score, rel=1e-4)
    # With its optimizer's state, so that it trains on as the member would.
    assert int(model.optimizer.iterations.numpy()) == STEPS * best.hyperparameters.values[
        "tuner/epochs"]
    assert float(model.optimizer.learning_rate.numpy()) == pytest.approx(
        best.hyperparameters.values["learning_rate"], rel=1e-6)
    schedule = tuner.learned_schedule()
    assert schedule[0]["epoch"] == 0
    assert [entry["epoch"] for entry in schedule] == sorted({e["epoch"] for e in schedule})
    assert schedule[-1]["values"] == population.searched_values(best.hyperparameters.values)
    assert set(schedule[0]["values"]) == {"dropout", "learning_rate"}

    axes = kdist.tune.plot_population(tuner.oracle, tmp_path / "population.png")
    assert (tmp_path / "population.png").stat().st_size > 1000
    assert [ax.get_ylabel() for ax in axes] == ["val_loss (min)", "dropout", "learning_rate"]
    assert axes[2].get_yscale() == "log" and axes[1].get_yscale() == "linear"
    # One dashed score line per exploit, one thick line per round of the best lineage.
    exploits = [values for _, values in _rounds(tuner) if "tuner/trial_id" in values and
                tuner.oracle.trials[values["tuner/trial_id"]].hyperparameters.values[
                    "pbt/member"] != values["pbt/member"]]
    assert exploits
    assert len([line for line in axes[0].get_lines() if line.get_linestyle() == "--"]) == len(
        exploits)
    assert len([line for line in axes[1].get_lines() if line.get_linewidth() > 2]) >= len(
        schedule)
    with pytest.raises(ValueError, match=r"\['units'\] are not explored numbers"):
        kdist.tune.plot_population(tuner.oracle, hyperparameters=["units"])

    rates = []
    record = keras.callbacks.LambdaCallback(on_epoch_begin=lambda epoch, logs: rates.append(
        float(plain.optimizer.learning_rate.numpy())))
    replay = kdist.tune.ScheduleReplay(
        [{"epoch": 0, "values": {"learning_rate": 0.1, "dropout": 0.2}},
         {"epoch": 2, "values": {"learning_rate": 0.01, "beta_1": 0.8}}])
    plain = _build(kt.HyperParameters())
    plain.fit(x, y, epochs=3, batch_size=BATCH, verbose=0, callbacks=[replay, record])
    assert rates == pytest.approx([0.1, 0.1, 0.01])
    assert plain.optimizer.beta_1 == 0.8
    with pytest.raises(ValueError, match=r"\['dropout'\] are not hyper-parameters of Adam"):
        plain.fit(x, y, epochs=1, verbose=0, callbacks=[kdist.tune.ScheduleReplay(
            schedule, names=["dropout"])])


def test_no_member_is_exploited_before_the_burn_in_and_pb2_explores_after_it(tmp_path,
                                                                              monkeypatch):
    # Asynchronous rounds are tested on three groups of ranks (test_tune_distributed.py).
    chosen, choose = [], bandit.choose

    def recorded(*args, **kwargs):
        chosen.append(choose(*args, **kwargs))
        return chosen[-1]

    monkeypatch.setattr(population.bandit, "choose", recorded)
    tuner = _search(tmp_path, burn_in=2, max_epochs=3, explore="pb2")
    exploits = {}
    for _, values in _rounds(tuner):
        if values["tuner/initial_epoch"] > 0:
            parent = tuner.oracle.trials[values.get("tuner/trial_id")].hyperparameters.values
            exploits.setdefault(values["tuner/initial_epoch"], []).append(
                parent["pbt/member"] != values["pbt/member"])
    # Not before the burn-in ends; from the epoch it ends on.
    assert not any(exploits[1]) and sorted(exploits[2]) == [False, False, False, True]
    # By then the four second rounds are known, so the process chose the values.
    assert len(chosen) == 1 and chosen[0] is not None
    exploited = [values for _, values in _rounds(tuner) if values["tuner/initial_epoch"] == 2
                 and values["pbt/member"] != tuner.oracle.trials[
                     values["tuner/trial_id"]].hyperparameters.values["pbt/member"]]
    assert population.searched_values(exploited[0]) == population.searched_values(chosen[0])
    assert 1e-4 <= exploited[0]["learning_rate"] <= 0.2
    assert 0.0 <= exploited[0]["dropout"] <= 0.5


def test_pb2_takes_the_values_whose_rounds_improved_most():
    space = kt.HyperParameters()
    space.Float("learning_rate", 1e-4, 1.0, sampling="log")
    space.Float("dropout", 0.0, 0.5)
    rng = np.random.default_rng(0)
    rounds = []
    for _ in range(24):
        values = {"learning_rate": float(10 ** rng.uniform(-4, 0)),
                  "dropout": float(rng.uniform(0, 0.5)), "tuner/epochs": int(rng.integers(1, 9))}
        # Losses fall most near a rate of 1e-1 (0.75 of the log range), whatever the dropout.
        where = space.space[0].value_to_prob(values["learning_rate"])
        rounds.append((values, 1.0 - (0.1 - (where - 0.75) ** 2), 1.0))
    observed = bandit.observations(rounds, maximise=False)
    assert len(observed) == 24 and max(c for _, _, c in observed) > 0
    donated = {"learning_rate": 1e-3, "dropout": 0.1, "other": "kept"}
    chosen = bandit.choose(space, observed, donated, end_epoch=9, max_epochs=10, rng=rng)
    assert chosen["other"] == "kept"
    assert abs(space.space[0].value_to_prob(chosen["learning_rate"]) - 0.75) < 0.1
    assert bandit.choose(space, observed[:3], donated, 9, 10, rng) is None
    # A round without its parent's score tells nothing about a change.
    assert bandit.observations([({"tuner/epochs": 1}, 0.5, None)], maximise=True) == []


def test_restoring_keeps_the_explored_rate_whether_or_not_the_optimizer_is_built(tmp_path):
    x, y = _data()
    hp = kt.HyperParameters()
    hp.values = {"learning_rate": 0.1, "dropout": 0.0}
    donor = _build(hp)
    donor.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    path = str(tmp_path / "donor.weights.h5")
    save_training_state(donor, path)
    hp.values["learning_rate"] = 0.01
    for built in (False, True):
        member = _build(hp)
        if built:  # a build(hp) may build its optimizer; then the file's would load
            member.optimizer.build(member.trainable_variables)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            restore_training_state(member, path)
        assert not [w for w in caught if "Skipping variable loading" in str(w.message)]
        assert float(member.optimizer.learning_rate.numpy()) == pytest.approx(0.01)
        assert int(member.optimizer.iterations.numpy()) == STEPS * 4 // 3
        for ours, theirs in zip(member.get_weights(), donor.get_weights()):
            np.testing.assert_array_equal(ours, theirs)


def test_explore_stays_within_each_hyper_parameters_bounds():
    hp = kt.HyperParameters()
    hp.Float("rate", 0.01, 1.0)
    hp.Int("units", 2, 8)
    hp.Choice("width", [16, 32, 64])
    hp.Choice("activation", ["relu", "tanh"])
    hp.Fixed("fixed", 3)
    rng = np.random.default_rng(0)
    values = {"rate": 0.9, "units": 8, "width": 64, "activation": "relu", "fixed": 3}
    for _ in range(50):
        explored = population.explore(hp.space, values, rng, resample_probability=0.25)
        assert 0.01 <= explored["rate"] <= 1.0 and 2 <= explored["units"] <= 8
        assert explored["width"] in (16, 32, 64) and explored["fixed"] == 3
        assert explored["activation"] in ("relu", "tanh")
    never_resampled = population.explore(hp.space, values, rng, resample_probability=0.0,
                                         factors=(0.8,))
    assert never_resampled == {"rate": pytest.approx(0.72), "units": 6, "width": 32,
                               "activation": "relu", "fixed": 3}
    # A small integer moves by one step at least.
    assert population.perturb(hp.space[1], 2, (1.2,), rng) == 3


@pytest.mark.parametrize("argument,value,message", [
    ("population_size", 1, "population_size"),
    ("quantile_fraction", 0.6, r"quantile_fraction must be in \(0, 0.5\]"),
    ("resample_probability", 2, "resample_probability"),
    ("perturbation_factors", (1.2, -1), "perturbation_factors"),
    ("perturbation_interval", 0, "perturbation_interval"),
])
def test_bad_settings_say_what_is_wrong(argument, value, message):
    with pytest.raises(ValueError, match=message):
        kdist.tune.PBTOracle(objective="loss", **{argument: value})


def test_explore_is_pb2_or_a_function():
    with pytest.raises(TypeError, match="explore must be 'pb2' or callable"):
        kdist.tune.PBTOracle(objective="loss", explore="pb3")


def test_search_refuses_epochs_the_rounds_set(tmp_path):
    tuner = kdist.tune.PBT(_build, objective="loss", population_size=2, max_epochs=1,
                           directory=str(tmp_path), overwrite=True,
                           max_consecutive_failed_trials=1)
    with pytest.raises(RuntimeError, match="epochs is set by the population's rounds"):
        tuner.search(*_data(), epochs=3, verbose=0)


def test_a_killed_search_resumes_with_every_member_where_it_was(tmp_path):
    script = tmp_path / "search.py"
    script.write_text(textwrap.dedent(f"""
        import os, sys
        import keras, numpy as np
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_pbt import _build, _data, BATCH
        import kdist.tune

        class Kill(keras.callbacks.Callback):
            # Dies hard in the middle of the sixth round, as a killed job does.
            rounds = 0
            def on_train_begin(self, logs=None):
                Kill.rounds += 1
            def on_train_batch_end(self, batch, logs=None):
                if sys.argv[1] == "kill" and Kill.rounds == 6 and batch == 1:
                    os._exit(9)

        tuner = kdist.tune.PBT(_build, objective="val_loss", population_size=3,
                               perturbation_interval=1, max_epochs=3, seed=5,
                               directory={str(tmp_path)!r}, project_name="pbt",
                               overwrite=False)
        tuner.search(*_data(), validation_split=0.25, batch_size=BATCH, verbose=0,
                     callbacks=[Kill()])
        print("rounds trained", Kill.rounds)
    """))
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    killed = subprocess.run([sys.executable, str(script), "kill"], capture_output=True,
                            text=True, timeout=300, env=env)
    assert killed.returncode == 9, killed.stderr[-2000:]
    resumed = subprocess.run([sys.executable, str(script), "resume"], capture_output=True,
                             text=True, timeout=300, env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    # Five rounds had finished: only the killed one and the three after it train.
    assert "rounds trained 4" in resumed.stdout
    tuner = kdist.tune.PBT(_build, objective="val_loss", population_size=3,
                           perturbation_interval=1, max_epochs=3, seed=5,
                           directory=str(tmp_path), project_name="pbt", overwrite=False)
    trials = tuner.oracle.trials.values()
    assert len(trials) == 9 and all(t.status == "COMPLETED" for t in trials)
    for member in range(3):
        epochs = sorted((t.hyperparameters.values["tuner/initial_epoch"],
                         t.hyperparameters.values["tuner/epochs"]) for t in trials
                        if t.hyperparameters.values["pbt/member"] == member)
        assert epochs == [(0, 1), (1, 2), (2, 3)]


def test_a_round_missing_from_the_saved_population_is_found_again(tmp_path):
    tuner = kdist.tune.PBT(_build, objective="val_loss", population_size=2,
                           perturbation_interval=1, max_epochs=2, seed=2,
                           directory=str(tmp_path), project_name="pbt", overwrite=True)
    tuner.search(*_data(), validation_split=0.25, batch_size=BATCH, verbose=0)
    members = tuner.oracle.members
    assert sorted(sum(members, [])) == sorted(tuner.oracle.trials)
    # As if the job died after writing the last trial and before oracle.json.
    path = os.path.join(tmp_path, "pbt", "oracle.json")
    with open(path) as f:
        state = json.load(f)
    state["members"] = [m[:1] for m in state["members"]]
    with open(path, "w") as f:
        json.dump(state, f)
    again = kdist.tune.PBT(_build, objective="val_loss", population_size=2,
                           perturbation_interval=1, max_epochs=2, seed=2,
                           directory=str(tmp_path), project_name="pbt", overwrite=False)
    assert again.oracle.members == members
