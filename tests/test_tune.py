"""Hyper-parameter search: the oracles' contract, the GA operators, K-fold arithmetic."""

import contextlib
import io
import json

import keras
import keras_tuner as kt
import numpy as np
import pytest

import kdist.tune
from kdist.tune import operators
from kdist.tune.space import Encoding


class FunctionTuner(kt.Tuner):
    """Scores a trial by a function of its values: no model is built."""

    def run_trial(self, trial, function, **kwargs):
        self.seen.append(dict(trial.hyperparameters.values))
        return function(trial.hyperparameters.values)


def _space():
    hp = kt.HyperParameters()
    hp.Float("lr", 1e-4, 1e-1, sampling="log")
    hp.Int("units", 8, 128, step=8)
    hp.Choice("activation", ["relu", "tanh", "gelu"])
    hp.Boolean("batch_norm")
    hp.Fixed("epochs", 3)
    with hp.conditional_scope("activation", ["relu"]):
        hp.Int("relu_extra", 1, 3)
    return hp


def _loss(values):
    """Smallest near lr=1e-2, units=64, tanh, no batch norm."""
    return (np.log10(values["lr"]) + 2) ** 2 + ((values["units"] - 64) / 64) ** 2 + (
        0.0 if values["activation"] == "tanh" else 0.5) + 0.3 * values["batch_norm"]


def _search(oracle, directory, function=_loss, name="p"):
    tuner = FunctionTuner(oracle=oracle, directory=str(directory), project_name=name)
    tuner.seen = []
    with contextlib.redirect_stdout(io.StringIO()):
        tuner.search(function)
    return tuner


ORACLES = {
    "genetic": lambda seed, trials=20: kdist.tune.GeneticOracle(
        objective=kt.Objective("loss", "min"), max_trials=trials, population_size=6, seed=seed,
        hyperparameters=_space()),
    "bayesian": lambda seed, trials=20: kdist.tune.BayesianOracle(
        objective=kt.Objective("loss", "min"), max_trials=trials, seed=seed,
        hyperparameters=_space(), candidates=300),
}


# The space encoding -----------------------------------------------------------------------

def test_encoding_round_trips_every_kind_and_drops_inactive_values():
    for one_hot in (False, True):
        encoding = Encoding(_space(), one_hot=one_hot)
        assert encoding.dimensions == (7 if one_hot else 5)  # Fixed takes none
        values = {"lr": 1e-3, "units": 40, "activation": "tanh", "batch_norm": True}
        decoded = encoding.decode(encoding.encode(values))
        assert decoded["units"] == 40 and decoded["activation"] == "tanh"
        assert decoded["batch_norm"] is True and decoded["epochs"] == 3
        assert decoded["lr"] == pytest.approx(1e-3)
        assert "relu_extra" not in decoded  # its condition is off
        decoded = encoding.decode(encoding.encode(dict(values, activation="relu")))
        assert decoded["relu_extra"] in (1, 2, 3)
    # A log scale puts 1e-3 a third of the way from 1e-4 to 1e-1.
    assert Encoding(_space()).encode({"lr": 1e-3})[0] == pytest.approx(1 / 3)



def test_every_step_of_a_stepped_float_encodes_to_itself():
    # keras-tuner stores -0.1 in steps of 0.1 from -1 as -0.09999999999999998; its own
    # value_to_prob puts that one step down.
    space = kt.HyperParameters()
    space.Float("b", -1.0, 1.0, step=0.1)
    space.Float("f", 0.3, 2.1, step=0.3)
    space.Float("l", 1e-4, 1e-1, step=10, sampling="log")
    encoding = Encoding(space)
    for hp in encoding.space:
        steps = sorted({hp.prob_to_value(p) for p in np.linspace(0.0, 1.0, 401)})
        assert len(steps) > 3
        for value in steps:
            assert encoding.decode(encoding.encode({hp.name: value}))[hp.name] == value


def test_snapped_points_are_the_encodings_of_their_values():
    encoding = Encoding(_space(), one_hot=True)
    points = np.random.default_rng(0).uniform(-0.1, 1.1, size=(50, encoding.dimensions))
    snapped = encoding.snap_points(points)
    active = [encoding.encode(encoding.decode(p)) for p in points]
    for row, whole in zip(snapped, active):
        # Inactive conditional values keep their place (the last dimension here).
        np.testing.assert_allclose(row[:-1], whole[:-1])
        assert encoding.decode(row).get("relu_extra") == encoding.decode(whole).get("relu_extra")
    assert encoding.discrete
    continuous = kt.HyperParameters()
    continuous.Float("x", 0.0, 1.0)
    assert not Encoding(continuous).discrete
    np.testing.assert_allclose(Encoding(continuous).snap_points([[0.3], [1.2]]), [[0.3], [1.0]])

# Genetic operators -------------------------------------------------------------------------

def test_directed_crossover_follows_the_formula_and_stays_in_bounds():
    fitter, other = np.array([0.6, 0.2, 0.9]), np.array([0.4, 0.5, 0.1])
    for seed in range(20):
        r = np.random.default_rng(seed).uniform()
        child = operators.directed_crossover(fitter, other, np.random.default_rng(seed))
        np.testing.assert_allclose(child, np.clip(r * (fitter - other) + fitter, 0, 1))
        assert np.all((child >= 0) & (child <= 1))
    categorical = np.array([False, True, False])
    children = [operators.directed_crossover(fitter, other, np.random.default_rng(s),
                                             categorical)[1] for s in range(40)]
    assert set(children) == {0.2, 0.5}


def test_nonuniform_mutation_stays_in_bounds_and_shrinks_over_generations():
    genes = np.full(200, 0.5)
    spread = []
    for generation in (0, 5, 9, 10):
        mutated = operators.nonuniform_mutation(genes, generation, 10,
                                                np.random.default_rng(generation), rate=1.0)
        assert np.all((mutated >= 0) & (mutated <= 1))
        spread.append(np.mean(np.abs(mutated - 0.5)))
    assert spread[0] > spread[1] > spread[2] > spread[3] == 0.0
    # At generation 0 a step reaches anywhere up to the bound it heads for.
    assert spread[0] == pytest.approx(0.25, abs=0.05)
    untouched = operators.nonuniform_mutation(genes, 0, 10, np.random.default_rng(0), rate=0.0)
    np.testing.assert_array_equal(untouched, genes)


def test_elite_and_tournament_use_fitness():
    individuals = [operators.Individual([i / 10], fitness=i, key=str(i)) for i in range(10)]
    assert [i.key for i in operators.select_elite(individuals, 0.2)] == ["9", "8"]
    winners = operators.binary_tournament(individuals, 200, np.random.default_rng(0))
    mean = np.mean([w.fitness.values[0] for w in winners])
    assert mean > 5.5  # a tournament of two favours the fitter: expected 6.15
    again = operators.binary_tournament(individuals, 200, np.random.default_rng(0))
    assert [w.key for w in again] == [w.key for w in winners]


# The oracle contract -----------------------------------------------------------------------

@pytest.mark.parametrize("kind", sorted(ORACLES))
def test_oracle_runs_every_trial_and_is_reproducible(kind, tmp_path):
    first = _search(ORACLES[kind](seed=3, trials=12), tmp_path / "a")
    trials = first.oracle.trials
    assert len(trials) == 12
    assert all(t.status == "COMPLETED" for t in trials.values())
    hashes = {first.oracle._compute_values_hash(v) for v in first.seen}
    assert len(hashes) == 12  # never the same values twice
    again = _search(ORACLES[kind](seed=3, trials=12), tmp_path / "b")
    assert again.seen == first.seen
    # Another seed: six trials already differ, and cost half of twelve.
    other = _search(ORACLES[kind](seed=4, trials=6), tmp_path / "c")
    assert other.seen != first.seen[:6]
    for values in first.seen:
        assert 1e-4 <= values["lr"] <= 1e-1 and values["units"] % 8 == 0
        assert ("relu_extra" in values) == (values["activation"] == "relu")


@pytest.mark.parametrize("kind", sorted(ORACLES))
def test_oracle_beats_its_own_random_start(kind, tmp_path):
    tuner = _search(ORACLES[kind](seed=0, trials=30), tmp_path)
    scores = [_loss(v) for v in tuner.seen]
    assert min(scores[15:]) < min(scores[:6])


@pytest.mark.parametrize("kind", sorted(ORACLES))
def test_oracle_state_saves_and_reloads_and_a_rerun_keeps_finished_trials(kind, tmp_path):
    calls = []

    def failing_after_eight(values):
        calls.append(values)
        if len(calls) > 8:
            raise KeyboardInterrupt  # the job is killed mid-search
        return _loss(values)

    with pytest.raises(KeyboardInterrupt):
        _search(ORACLES[kind](seed=1), tmp_path, failing_after_eight, name="resume")
    resumed = _search(ORACLES[kind](seed=1), tmp_path, _loss, name="resume")
    trials = resumed.oracle.trials
    assert len(trials) == 20
    assert all(t.status == "COMPLETED" for t in trials.values())
    # The eight finished trials were kept; the interrupted one ran again.
    assert len(resumed.seen) == 12
    if kind == "genetic":
        assert resumed.oracle.generation >= 1


@pytest.mark.parametrize("kind", sorted(ORACLES))
def test_a_reloaded_oracle_does_not_run_its_last_finished_trial_again(kind, tmp_path):
    # As behind the oracle service of a distributed search: trials end through
    # the oracle alone, and its last save happens inside end_trial, while the
    # trial is still listed as running.
    oracle = ORACLES[kind](seed=2, trials=9)
    oracle._set_project_dir(str(tmp_path), "extend")
    oracle.verbose = 0
    for _ in range(6):
        _finish(oracle, oracle.create_trial("group0"))
    reloaded = ORACLES[kind](seed=2, trials=9)
    reloaded._set_project_dir(str(tmp_path), "extend")
    reloaded.verbose = 0
    reloaded.reload()
    assert reloaded.create_trial("group0").trial_id == "6"
    assert all(reloaded.trials[str(i)].status == "COMPLETED" for i in range(6))


@pytest.mark.parametrize("kind", sorted(ORACLES))
def test_a_trial_created_just_before_a_kill_runs_after_the_reload(kind, tmp_path, monkeypatch):
    from kdist.tune import storage

    oracle = ORACLES[kind](seed=3, trials=6)
    oracle._set_project_dir(str(tmp_path), "extend")
    oracle.verbose = 0
    for _ in range(3):
        _finish(oracle, oracle.create_trial("group0"))
    # The new trial's file is written; the job dies before the oracle's is.
    monkeypatch.setattr(oracle, "save", lambda: (_ for _ in ()).throw(SystemExit))
    with pytest.raises(SystemExit):
        oracle.create_trial("group0")
    monkeypatch.undo()
    written = json.loads((tmp_path / "extend" / "trial_3" / "trial.json").read_text())
    assert written["status"] == "RUNNING"
    reloaded = ORACLES[kind](seed=3, trials=6)
    reloaded._set_project_dir(str(tmp_path), "extend")
    reloaded.verbose = 0
    reloaded.reload()
    assert storage.requeue_orphans(reloaded) == []  # queued once, by the reload
    handed = []
    while True:
        trial = reloaded.create_trial("group0")
        if trial.status == "STOPPED":
            break
        handed.append(trial.trial_id)
        _finish(reloaded, trial)
    assert handed == ["3", "4", "5"]
    assert {t.status for t in reloaded.trials.values()} == {"COMPLETED"}

def test_state_files_are_written_whole_or_not_at_all(tmp_path, monkeypatch):
    from kdist.tune import storage

    path = tmp_path / "state.json"
    storage.write_json(path, {"trials": 1})

    def killed(fd):
        raise KeyboardInterrupt  # the process dies before the new state is in place

    monkeypatch.setattr(storage.os, "fsync", killed)
    with pytest.raises(KeyboardInterrupt):
        storage.write_json(path, {"trials": 2})
    assert json.loads(path.read_text()) == {"trials": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]  # no temporary left
    monkeypatch.undo()
    storage.write_json(path, {"trials": np.int64(3)})
    assert json.loads(path.read_text()) == {"trials": 3}


@pytest.mark.parametrize("kind", sorted(ORACLES))
def test_an_oracle_killed_while_saving_keeps_its_last_state(kind, tmp_path, monkeypatch):
    from kdist.tune import storage

    tuner = _search(ORACLES[kind](seed=1, trials=4), tmp_path)
    before = (tmp_path / "p" / "oracle.json").read_text()
    monkeypatch.setattr(storage.os, "fsync", lambda fd: (_ for _ in ()).throw(SystemExit))
    with pytest.raises(SystemExit):
        tuner.oracle.save()
    with pytest.raises(SystemExit):
        tuner.oracle._save_trial(tuner.oracle.trials["0"])
    assert (tmp_path / "p" / "oracle.json").read_text() == before
    monkeypatch.undo()
    assert len(_search(ORACLES[kind](seed=1, trials=4), tmp_path).oracle.trials) == 4


def test_a_reloaded_search_ranks_tied_trials_as_the_original_did(tmp_path, monkeypatch):
    from keras_tuner.src import backend

    tied = lambda values: 1.0  # noqa: E731 - every trial scores the same
    first = _search(ORACLES["genetic"](seed=2, trials=5), tmp_path, tied)
    best = first.oracle.get_best_trials(1)[0].trial_id
    # File systems list directories in any order; keras-tuner reloads in that order.
    listing = backend.io.glob
    monkeypatch.setattr(backend.io, "glob", lambda pattern: sorted(listing(pattern))[::-1])
    again = _search(ORACLES["genetic"](seed=2, trials=5), tmp_path, tied)
    assert again.seen == []  # nothing ran twice
    assert list(again.oracle.trials) == sorted(first.oracle.trials)
    assert again.oracle.get_best_trials(1)[0].trial_id == best == "0"


def test_genetic_generations_wait_and_steady_state_does_not():
    oracle = kdist.tune.GeneticOracle(objective=kt.Objective("loss", "min"), max_trials=30,
                                      population_size=4, seed=0, hyperparameters=_space())
    assert oracle.planned_generations == 1 + int(np.ceil(26 / 3))
    with pytest.raises(ValueError, match="population_size"):
        kdist.tune.GeneticOracle(population_size=1)
    with pytest.raises(ValueError, match="elite_fraction"):
        kdist.tune.GeneticOracle(elite_fraction=1.0)
    with pytest.raises(ValueError, match="children"):
        kdist.tune.GeneticOracle(children=0)
    with pytest.raises(ValueError, match="num_initial_points"):
        kdist.tune.BayesianOracle(num_initial_points=0)


def _finish(oracle, trial, loss=None):
    oracle.update_trial(trial.trial_id, {"loss": _loss(trial.hyperparameters.values)
                                         if loss is None else loss})
    trial.status = "COMPLETED"
    oracle.end_trial(trial)


@pytest.mark.parametrize("steady", [False, True])
def test_genetic_oracle_never_leaves_a_concurrent_request_idle(steady, tmp_path):
    oracle = kdist.tune.GeneticOracle(objective=kt.Objective("loss", "min"), max_trials=40,
                                      population_size=4, seed=0, steady_state=steady,
                                      hyperparameters=_space())
    oracle._set_project_dir(str(tmp_path), "concurrent")
    # Generation 0 has four members; a fifth request while they run gets a fifth.
    trials = [oracle.create_trial(f"group{i}") for i in range(5)]
    assert [t.status for t in trials] == ["RUNNING"] * 5
    for trial in trials[:4]:
        _finish(oracle, trial)
    # Four finished: the next request breeds from them, while trial 5 still runs.
    child = oracle.create_trial("group0")
    assert child.status == "RUNNING"
    if not steady:
        assert oracle.generation == 1 and trials[4].trial_id in oracle.members
        assert set(oracle.population) <= {t.trial_id for t in trials[:4]}
    # keras-tuner's own pattern: four tuners ask, report, and ask again, ten times.
    _finish(oracle, trials[4])
    _finish(oracle, child)
    for _ in range(7):
        batch = [oracle.create_trial(f"group{i}") for i in range(4)]
        assert all(t.status == "RUNNING" for t in batch)
        for trial in batch:
            _finish(oracle, trial)
    assert len(oracle.trials) == 34
    assert steady or oracle.generation == 7  # each batch after the first made a generation


def test_genetic_oracle_finds_the_corner_of_keras_tuners_float_optimisation_test(tmp_path):
    # keras-tuner's own test: -a^3 + b^3 + c - |d| on [-1, 1]^4 peaks at 3 at
    # (-1, 1, 1, 0); its bar is 3 within 0.4 after 50 trials. Training every
    # child (children=1) clears it for 3 seeds in 10, not for seeds 0 and 4;
    # pre-selection for 19 seeds in 20, those two among them.
    class PolynomialTuner(kt.engine.base_tuner.BaseTuner):
        def run_trial(self, trial, **kwargs):
            hp = trial.hyperparameters
            return -hp["a"] ** 3 + hp["b"] ** 3 + hp["c"] - abs(hp["d"])

    for seed in (0, 4):
        space = kt.HyperParameters()
        for name in "abcd":
            space.Float(name, -1, 1)
        tuner = PolynomialTuner(
            oracle=kdist.tune.GeneticOracle(objective=kt.Objective("score", "max"),
                                            hyperparameters=space, max_trials=50, seed=seed),
            directory=str(tmp_path), project_name=f"float{seed}")
        with contextlib.redirect_stdout(io.StringIO()):
            tuner.search()
        best = tuner.oracle.get_best_trials()[0]
        assert best.score == pytest.approx(3, abs=0.4), seed
        found = [best.hyperparameters[name] for name in "abcd"]
        np.testing.assert_allclose(found, [-1, 1, 1, 0], atol=0.2, err_msg=f"seed {seed}")


def test_genetic_generations_keep_elites_and_the_best_finished_children(tmp_path):
    oracle = kdist.tune.GeneticOracle(objective=kt.Objective("loss", "min"), max_trials=40,
                                      population_size=4, elite_fraction=0.25, seed=3,
                                      hyperparameters=_space())
    oracle._set_project_dir(str(tmp_path), "generations")
    # Distinct tuner ids: keras-tuner hands a tuner its running trial again.
    first = [oracle.create_trial(f"t{i}") for i in range(4)]
    for loss, trial in zip([4.0, 1.0, 3.0, 2.0], first):
        _finish(oracle, trial, loss)
    brood = [oracle.create_trial(f"t{i}") for i in range(4)]  # 3 children and one more
    assert oracle.generation == 1
    assert oracle.population == [first[1].trial_id, first[3].trial_id, first[2].trial_id,
                                 first[0].trial_id]
    for loss, trial in zip([0.5, 5.0, 6.0, 0.7], brood):
        _finish(oracle, trial, loss)
    oracle.create_trial("t0")
    # The elite (loss 1.0) and the best three of the four finished children.
    assert oracle.generation == 2
    assert oracle.population == [first[1].trial_id, brood[0].trial_id, brood[3].trial_id,
                                 brood[1].trial_id]


@pytest.mark.parametrize("kind", ["genetic", "bayesian"])
def test_populate_space_takes_any_trial_id_and_seed_zero_is_a_seed(kind, tmp_path):
    # keras-tuner's own tests call populate_space with ids the oracle never created.
    oracle = ORACLES[kind](seed=0)
    assert oracle.seed == 0
    oracle._set_project_dir(str(tmp_path), "ids")
    for trial_id in [str(i) for i in range(10)] + ["1_0", "tuner-a"]:
        response = oracle.populate_space(trial_id)
        assert response["status"] == "RUNNING" and "lr" in response["values"]
    again = ORACLES[kind](seed=0)
    again._set_project_dir(str(tmp_path), "ids_again")
    assert again.populate_space("1_0") == ORACLES[kind](seed=0).populate_space("1_0")
    with pytest.raises(ValueError, match="non-negative integer"):
        ORACLES[kind](seed=-1)


def test_genetic_state_restores_every_field(tmp_path):
    oracle = kdist.tune.GeneticOracle(objective=kt.Objective("loss", "min"), max_trials=30,
                                      population_size=5, elite_fraction=0.4, mutation_rate=0.3,
                                      generations=7, steady_state=True, children=5, seed=4,
                                      hyperparameters=_space())
    oracle._set_project_dir(str(tmp_path), "state")
    _finish(oracle, oracle.create_trial("solo"))
    state = oracle.get_state()
    restored = kdist.tune.GeneticOracle(objective=kt.Objective("loss", "min"))
    restored.set_state(state)
    for field in ("population_size", "elite_fraction", "elite_size", "mutation_rate",
                  "steady_state", "children", "generations", "generation", "population", "members",
                  "seed"):
        assert getattr(restored, field) == getattr(oracle, field), field


def test_keras_tuner_is_pinned_to_the_tested_versions():
    import pathlib
    import re

    from kdist.tune import compat

    assert compat.keras_tuner_is_tested(), (
        f"keras-tuner {kt.__version__} is installed but kdist.tune is tested with "
        f"{compat.TESTED_KERAS_TUNER}: test it and widen the range in compat.py and "
        "pyproject.toml")
    assert not compat.keras_tuner_is_tested("1.5.0")
    pyproject = (pathlib.Path(__file__).parents[1] / "pyproject.toml").read_text()
    pins = set(re.findall(r'"keras-tuner([^"]*)"', pyproject))
    assert pins == {compat.TESTED_KERAS_TUNER}


def test_bayesian_concurrent_proposals_differ_from_pending_trials(tmp_path):
    oracle = ORACLES["bayesian"](seed=0)
    oracle._set_project_dir(str(tmp_path), "pending")
    for i in range(8):  # finish the initial design
        trial = oracle.create_trial("solo")
        oracle.update_trial(trial.trial_id, {"loss": _loss(trial.hyperparameters.values)})
        trial.status = "COMPLETED"
        oracle.end_trial(trial)
    first = oracle.create_trial("group0")
    second = oracle.create_trial("group1")
    assert first.status == second.status == "RUNNING"
    assert first.hyperparameters.values != second.hyperparameters.values



def test_bayesian_proposals_never_round_onto_a_running_trial():
    # Integer and stepped inputs: the best point is a=4, b=1. With a trial running
    # there, a proposal whose values round to the same ones would be the same trial.
    from kdist.tune import bayesian

    space = kt.HyperParameters()
    space.Int("a", 0, 10)
    space.Float("b", 0.0, 1.0, step=0.25)
    encoding = Encoding(space, one_hot=True)
    oracle = bayesian.BayesianOracle(objective=kt.Objective("loss", "min"),
                                     hyperparameters=space, candidates=300)
    running = encoding.encode({"a": 4, "b": 1.0})[None]
    for seed in range(8):  # before rounding was scored, seeds 1 and 7 proposed a=4, b=1
        rng = np.random.default_rng(seed)
        finished = encoding.snap_points(rng.uniform(size=(10, 2)))
        scores = np.array([abs(v["a"] - 4) - v["b"] for v in map(encoding.decode, finished)])
        for pending in (np.empty((0, 2)), running):
            point = oracle._propose(encoding, finished, scores, pending, rng)
            np.testing.assert_allclose(point, encoding.snap_points(point[None])[0])
        assert encoding.decode(point) != {"a": 4, "b": 1.0}, seed


def _four_groups_in_rounds(seed, directory, rounds=10):
    """Four groups share one oracle; each round all four ask, then all four report.
    The best score is -0.9 at a=4, b=0.9, c=1e-3 (keras-tuner never proposes b=1.0,
    the last step of its grid)."""
    space = kt.HyperParameters()
    space.Int("a", 0, 10)
    space.Float("b", -1.0, 1.0, step=0.1)
    space.Float("c", 1e-5, 1e-2, sampling="log")
    oracle = kdist.tune.BayesianOracle(objective=kt.Objective("loss", "min"),
                                       max_trials=4 * rounds, seed=seed, hyperparameters=space)
    oracle._set_project_dir(str(directory), "groups")
    for _ in range(rounds):
        trials = [oracle.create_trial(f"group{g}") for g in range(4)]
        for trial in trials:
            values = trial.hyperparameters.values
            _finish(oracle, trial, abs(values["a"] - 4) - values["b"]
                    + 0.1 * abs(3 + np.log10(values["c"])))
    return oracle.get_best_trials()[0]


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(10))
def test_four_groups_asking_in_rounds_find_the_best_steps(seed, tmp_path):
    best = _four_groups_in_rounds(seed, tmp_path)
    values = best.hyperparameters.values
    assert best.score < -0.85, values
    assert values["a"] == 4 and values["b"] == pytest.approx(0.9), values
    assert 3e-4 < values["c"] < 3e-3, values


def test_running_trials_shape_proposals_until_they_fail(tmp_path, monkeypatch):
    # Each proposal sees the trials running at that moment; a running trial that fails
    # no longer counts, and the proposal it shaped is not repeated for it.
    oracle = ORACLES["bayesian"](seed=0)
    oracle._set_project_dir(str(tmp_path), "failed")
    for _ in range(8):
        _finish(oracle, oracle.create_trial("solo"))
    seen = []
    propose = oracle._propose

    def recording(encoding, finished, scores, pending, rng, *args, **kwargs):
        seen.append(len(pending))
        return propose(encoding, finished, scores, pending, rng, *args, **kwargs)

    monkeypatch.setattr(oracle, "_propose", recording)
    first = oracle.create_trial("group0")
    second = oracle.create_trial("group1")
    first.status = "FAILED"
    oracle.end_trial(first)
    third = oracle.create_trial("group0")
    assert seen == [0, 1, 1]
    assert len({str(t.hyperparameters.values) for t in (first, second, third)}) == 3
    _finish(oracle, second)
    oracle.create_trial("group1")
    assert seen == [0, 1, 1, 1]  # only the third runs now


def _branin(values):
    x, y = values["x"], values["y"]
    return ((y - 5.1 / (4 * np.pi ** 2) * x ** 2 + 5 / np.pi * x - 6) ** 2
            + 10 * (1 - 1 / (8 * np.pi)) * np.cos(x) + 10)


def test_fantasies_of_running_trials_average_back_to_expected_improvement():
    # Scores depend on the first input only. Averaged over the running trial's draws,
    # expected improvement is the process's own as long as no draw may become the score
    # to beat (the draws only redistribute the posterior); once they may, nothing is
    # left to gain at the running trial's point, and no point gains.
    from kdist.tune import bayesian

    rng = np.random.default_rng(0)
    finished = rng.uniform(size=(16, 2))
    scores = bayesian.standardised((finished[:, 0] - 0.3) ** 2)
    scores = scores - scores.max()
    model = bayesian.fit_process(finished, scores, rng)
    pending = np.array([[0.3, 0.1]])
    points = np.array([[0.3, 0.1], [0.3, 0.9], [0.32, 0.5], [0.4, 0.5]])
    mean, std = model.predict(points, return_std=True)
    plain = bayesian.expected_improvement(mean, std, scores.min())
    assert np.all(plain > 1e-5), plain

    def averaged(asked):
        return bayesian.fantasised_improvement(model, finished, scores, pending,
                                               np.array([asked]), scores.min(), 0.0, 256,
                                               rng)(points)

    np.testing.assert_allclose(averaged(False), plain, rtol=0.02)
    lowered = averaged(True)
    assert lowered[0] < 0.01 * plain[0]
    assert np.all(lowered <= plain * 1.001) and np.all(lowered[1:] > 0.0)


def test_concurrent_bayesian_proposals_spread_out(tmp_path):
    # Four groups ask at once after three rounds of four. With fantasies the closest
    # pair of the four is 0.02 to 0.10 apart in the cube over these seeds. A kriging
    # believer with the kernel's starting hyper-parameters left two of the six seeds
    # with a pair within 0.001; with the kernel refitted to believed scores and the real
    # incumbent kept, the median was 0.0003: near-copies of one point.
    closest = []
    for seed in range(6):
        hp = kt.HyperParameters()
        hp.Float("x", -5.0, 10.0)
        hp.Float("y", 0.0, 15.0)
        oracle = kdist.tune.BayesianOracle(objective=kt.Objective("loss", "min"),
                                           max_trials=40, seed=seed, hyperparameters=hp)
        oracle._set_project_dir(str(tmp_path), f"spread{seed}")
        encoding = Encoding(oracle.hyperparameters, one_hot=True)
        with contextlib.redirect_stdout(io.StringIO()):
            for _ in range(3):
                for trial in [oracle.create_trial(f"group{i}") for i in range(4)]:
                    _finish(oracle, trial, _branin(trial.hyperparameters.values))
            batch = [oracle.create_trial(f"group{i}") for i in range(4)]
        points = [encoding.encode(t.hyperparameters.values) for t in batch]
        closest.append(min(np.linalg.norm(points[i] - points[j])
                           for i in range(4) for j in range(i)))
    assert min(closest) > 0.01, closest


def test_trials_running_count_towards_the_bayesian_initial_design(tmp_path, monkeypatch):
    oracle = ORACLES["bayesian"](seed=0)
    oracle._set_project_dir(str(tmp_path), "design")
    proposed = []
    propose = oracle._propose
    monkeypatch.setattr(oracle, "_propose",
                        lambda *a, **k: proposed.append(1) or propose(*a, **k))

    def batch(size):
        trials = [oracle.create_trial(f"group{i}") for i in range(size)]
        for trial in trials:
            oracle.update_trial(trial.trial_id, {"loss": _loss(trial.hyperparameters.values)})
            trial.status = "COMPLETED"
            oracle.end_trial(trial)

    design = oracle.initial_points(Encoding(oracle.hyperparameters, one_hot=True).dimensions)
    batch(design - 2)  # nothing finished yet: the design's points, all of them
    assert proposed == []
    # Two more design points, and the model proposes the rest of the batch while they
    # run: eight groups asking at once get no more design points than one group would.
    batch(8)
    assert len(proposed) == 6
    assert len(oracle.trials) == design + 6


def test_expected_improvement():
    ei = kdist.tune.expected_improvement
    assert ei(np.array([0.0]), np.array([1.0]), 0.0)[0] == pytest.approx(0.398942, abs=1e-6)
    # Far better mean: EI is the improvement itself; far worse: nothing.
    assert ei(np.array([-5.0]), np.array([0.01]), 0.0)[0] == pytest.approx(5.0)
    assert ei(np.array([5.0]), np.array([0.01]), 0.0)[0] == pytest.approx(0.0)


def test_oracles_inside_a_stock_keras_tuner_tuner(tmp_path):
    def build(hp):
        model = keras.Sequential([keras.Input((4,)),
                                  keras.layers.Dense(hp.Int("units", 2, 8, step=2)),
                                  keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(hp.Float("lr", 1e-3, 1e-1, sampling="log")), "mse")
        return model

    x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    for oracle in (kdist.tune.GeneticOracle(objective="val_loss", max_trials=3,
                                            population_size=2, seed=0),
                   kdist.tune.BayesianOracle(objective="val_loss", max_trials=3, seed=0)):
        tuner = kt.RandomSearch(build, max_trials=3, directory=str(tmp_path),
                                project_name=type(oracle).__name__, objective="val_loss")
        tuner.oracle = oracle
        oracle._set_project_dir(str(tmp_path), type(oracle).__name__)
        with contextlib.redirect_stdout(io.StringIO()):
            tuner.search(x, y, epochs=1, validation_split=0.25, verbose=0)
        assert len(oracle.trials) == 3
        assert tuner.get_best_models(1)[0].count_params() > 0


# K-fold -------------------------------------------------------------------------------------

def test_fold_indices_partition_the_rows_and_keep_class_proportions():
    y = np.array([0] * 30 + [1] * 10)
    splits = kdist.tune.fold_indices(y, 5, seed=0)
    held = np.concatenate([v for _, v in splits])
    assert sorted(held.tolist()) == list(range(40))
    for train, held_out in splits:
        assert len(held_out) == 8 and not set(train) & set(held_out)
        assert np.mean(y[held_out]) == pytest.approx(0.25)
    regression = kdist.tune.fold_indices(np.linspace(0, 1, 10), 3, seed=0)
    assert sorted(len(v) for _, v in regression) == [3, 3, 4]
    with pytest.raises(ValueError, match="folds"):
        kdist.tune.fold_indices(y, 1)
    with pytest.raises(ValueError, match="class labels"):
        kdist.tune.fold_indices(np.linspace(0, 1, 10), 2, stratified=True)


def test_kfold_tuner_reports_the_mean_and_spread_over_folds(tmp_path):
    built = []

    class Recording(kt.HyperModel):
        def build(self, hp):
            model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
            model.compile(keras.optimizers.SGD(hp.Float("lr", 1e-3, 1e-1, sampling="log")),
                          "mse", metrics=["mae"])
            built.append(model)
            return model

    rng = np.random.default_rng(0)
    x = rng.normal(size=(90, 3)).astype("float32")
    y = (x @ np.array([1.0, -2.0, 0.5]) + 0.1 * rng.normal(size=90)).astype("float32")
    tuner = kdist.tune.KFoldTuner(Recording(), oracle=kdist.tune.BayesianOracle(
        objective="val_loss", max_trials=2, seed=0), folds=3, directory=str(tmp_path),
        project_name="kfold")
    with contextlib.redirect_stdout(io.StringIO()):
        tuner.search(x, y, epochs=2, verbose=0)
    # keras-tuner builds once to learn the space, then a fresh model per fold and trial.
    assert len(built) == 1 + 2 * 3
    trial = tuner.oracle.get_best_trials(1)[0]
    metrics = {name: trial.metrics.get_last_value(name) for name in trial.metrics.metrics}
    folds = [metrics[f"val_loss_fold_{k}"] for k in range(3)]
    assert metrics["val_loss"] == pytest.approx(np.mean(folds), rel=1e-6)
    assert metrics["val_loss_std"] == pytest.approx(np.std(folds), rel=1e-6)
    assert trial.score == pytest.approx(metrics["val_loss"], rel=1e-6)
    assert "val_mae" in metrics and "val_mae_std" in metrics
    # The saved model is the best fold's: it scores that fold's loss on that fold's rows.
    best = tuner.get_best_models(1)[0]
    _, held_out = kdist.tune.fold_indices(y, 3, seed=0)[int(np.argmin(folds))]
    assert best.evaluate(x[held_out], y[held_out], verbose=0)[0] == pytest.approx(
        min(folds), rel=1e-5)
    with pytest.raises(ValueError, match="folds"):
        kdist.tune.KFoldTuner(Recording(), oracle=kdist.tune.BayesianOracle(), folds=1)


def test_kfold_tuner_refuses_validation_data(tmp_path):
    tuner = kdist.tune.KFoldTuner(
        lambda hp: keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)]),
        oracle=kdist.tune.GeneticOracle(objective="val_loss", max_trials=1, population_size=2,
                                        max_consecutive_failed_trials=1),
        folds=2, directory=str(tmp_path), project_name="bad")
    with pytest.raises(RuntimeError), contextlib.redirect_stdout(io.StringIO()):
        tuner.search(np.zeros((8, 2)), np.zeros(8), validation_data=(np.zeros((2, 2)),
                                                                     np.zeros(2)))
    assert "validation_data" in tuner.oracle.trials["0"].message


def test_kfold_tuner_trains_to_the_trial_budget_and_promotes_from_the_parent_fold(tmp_path):
    fits, current = [], []

    class Budgeted(kt.HyperModel):
        def build(self, hp):
            model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
            model.compile(keras.optimizers.SGD(hp.Float("lr", 1e-3, 1e-1, sampling="log")),
                          "mse")
            return model

        def fit(self, hp, model, x, y, **kwargs):
            fits.append(dict(trial=current[-1], values=dict(hp.values),
                             epochs=kwargs.get("epochs"), start=kwargs.get("initial_epoch", 0),
                             weights=[w.copy() for w in model.get_weights()]))
            history = model.fit(x, y, verbose=0, **kwargs)
            fits[-1]["ran"] = len(history.epoch)
            return history

    class Tuner(kdist.tune.KFoldTuner):
        def run_trial(self, trial, *args, **kwargs):
            current.append(trial.trial_id)
            return super().run_trial(trial, *args, **kwargs)

    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 3)).astype("float32")
    y = (x @ np.array([1.0, -2.0, 0.5])).astype("float32")
    tuner = Tuner(Budgeted(), oracle=kdist.tune.BOHBOracle(objective="val_loss", max_epochs=2,
                                                           factor=2, seed=0),
                  folds=2, directory=str(tmp_path), project_name="budget")
    with contextlib.redirect_stdout(io.StringIO()):
        tuner.search(x, y, epochs=50, batch_size=8)
    assert fits and len(fits) % 2 == 0
    promoted = 0
    for k, fit in enumerate(fits):
        values, fold = fit["values"], k % 2
        # The search's own epochs=50 gives way to the trial's budget.
        assert fit["epochs"] == values["tuner/epochs"]
        assert fit["ran"] == values["tuner/epochs"] - fit["start"]
        if values.get("tuner/trial_id") is None:
            assert fit["start"] == 0
            continue
        promoted += 1
        assert fit["start"] == values["tuner/initial_epoch"] > 0
        parent = tuner.hypermodel.build(kt.HyperParameters())
        parent.load_weights(tuner.fold_checkpoint(values["tuner/trial_id"], fold))
        for started, saved in zip(fit["weights"], parent.get_weights()):
            np.testing.assert_array_equal(started, saved)
    assert promoted >= 2
