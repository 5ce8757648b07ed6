"""Multi-objective search: Pareto fronts, NSGA-II and ParEGO through keras-tuner."""

import contextlib
import io

import keras_tuner as kt
import numpy as np
import pytest

import kdist.tune

OBJECTIVES = [kt.Objective("f1", "min"), kt.Objective("f2", "min")]


def _space(dims=3):
    hp = kt.HyperParameters()
    for i in range(dims):
        hp.Float(f"x{i}", 0.0, 1.0)
    return hp


def zdt1(values):
    """Two losses whose Pareto front is f2 = 1 - sqrt(f1), reached when x1.. = 0."""
    x = np.array([values[k] for k in sorted(values) if k.startswith("x")])
    g = 1.0 + 9.0 * x[1:].mean()
    return {"f1": float(x[0]), "f2": float(g * (1.0 - np.sqrt(x[0] / g)))}


def hypervolume(points, reference=(1.1, 11.0)):
    """Area dominated by two-objective losses, up to `reference`."""
    points = sorted(p for p in points if p[0] < reference[0] and p[1] < reference[1])
    area, ceiling = 0.0, reference[1]
    for f1, f2 in points:
        if f2 < ceiling:
            area += (reference[0] - f1) * (ceiling - f2)
            ceiling = f2
    return area


class FunctionTuner(kt.Tuner):
    def run_trial(self, trial, function, **kwargs):
        metrics = function(trial.hyperparameters.values)
        # keras-tuner wants its summed objective in a returned dict.
        return dict(metrics, multi_objective=self.oracle.objective.get_value(metrics))


def _search(oracle, directory, function=zdt1, name="p"):
    tuner = FunctionTuner(oracle=oracle, directory=str(directory), project_name=name)
    with contextlib.redirect_stdout(io.StringIO()):
        tuner.search(function)
    return tuner


def _losses(oracle):
    return [oracle.objective_values(t) for t in oracle.pareto_front()]


def test_dominates_follows_each_objectives_direction():
    assert kdist.tune.dominates([1.0, 1.0], [2.0, 2.0], signs=[-1, -1])
    assert not kdist.tune.dominates([1.0, 3.0], [2.0, 2.0], signs=[-1, -1])
    assert not kdist.tune.dominates([1.0, 1.0], [1.0, 1.0], signs=[-1, -1])
    assert kdist.tune.dominates([0.9, 5.0], [0.8, 5.0], signs=[1, -1])


@pytest.mark.parametrize("kind", ["nsga2", "parego"])
def test_fronts_hold_exactly_the_non_dominated_trials(kind, tmp_path):
    objectives = [kt.Objective("accuracy", "max"), kt.Objective("size", "min")]

    def accuracy_against_size(values):
        x = np.array([values["x0"], values["x1"], values["x2"]])
        return {"accuracy": float(1 - (1 - x[0]) ** 2 - 0.3 * x[2]), "size": float(x[0] + x[1])}

    oracle = (kdist.tune.NSGA2Oracle(objectives, max_trials=24, seed=0, hyperparameters=_space())
              if kind == "nsga2" else
              kdist.tune.ParEGOOracle(objectives, max_trials=12, seed=0, candidates=200,
                                      hyperparameters=_space()))
    tuner = _search(oracle, tmp_path, accuracy_against_size)
    signs = oracle.signs
    assert list(signs) == [1.0, -1.0]
    everything = [oracle.objective_values(t) for t in oracle.trials.values()]
    front = _losses(oracle)
    assert front
    for point in front:
        assert not any(kdist.tune.dominates(other, point, signs) for other in everything)
    for point in everything:
        if point not in front:
            assert any(kdist.tune.dominates(f, point, signs) for f in front)
    # The best trials come front by front; the tuner hands the whole front over.
    best = tuner.get_best_hyperparameters(len(front))
    assert [h.values for h in best] == [t.hyperparameters.values
                                        for t in oracle.pareto_front()]
    assert oracle.get_best_trials(len(oracle.trials)) and len(
        oracle.get_best_trials(len(oracle.trials))) == len(oracle.trials)
    # keras-tuner's summed score is kept for its displays.
    trial = next(iter(oracle.trials.values()))
    accuracy, size = oracle.objective_values(trial)
    assert trial.score == pytest.approx(size - accuracy)


def test_nsga2_finds_a_better_front_than_random_search(tmp_path):
    volumes = {"nsga2": [], "random": []}
    for seed in range(3):
        nsga2 = kdist.tune.NSGA2Oracle(OBJECTIVES, max_trials=80, seed=seed,
                                       hyperparameters=_space())
        random = kt.oracles.RandomSearchOracle(OBJECTIVES, max_trials=80, seed=seed,
                                               hyperparameters=_space())
        _search(nsga2, tmp_path / f"n{seed}")
        tuner = _search(random, tmp_path / f"r{seed}")
        volumes["nsga2"].append(hypervolume(_losses(nsga2)))
        points = [list(zdt1(t.hyperparameters.values).values())
                  for t in tuner.oracle.trials.values()]
        volumes["random"].append(hypervolume(points))
    assert np.median(volumes["nsga2"]) > np.median(volumes["random"]) + 0.2, volumes


def test_parego_finds_a_better_front_than_its_random_start(tmp_path):
    oracle = kdist.tune.ParEGOOracle(OBJECTIVES, max_trials=24, num_initial_points=8, seed=1,
                                     candidates=300, hyperparameters=_space())
    _search(oracle, tmp_path)
    trials = sorted(oracle.trials.values(), key=lambda t: int(t.trial_id))
    start = [oracle.objective_values(t) for t in trials[:8]]
    rest = [oracle.objective_values(t) for t in trials[8:]]
    assert hypervolume(start + rest) > hypervolume(start) + 0.2
    # Different scalarisations aim at different parts of the front.
    assert len({round(p[0], 2) for p in rest}) > 4


def test_nsga2_never_leaves_a_concurrent_request_idle_and_reloads(tmp_path):
    oracle = kdist.tune.NSGA2Oracle(OBJECTIVES, max_trials=30, population_size=4, seed=2,
                                    hyperparameters=_space())
    oracle._set_project_dir(str(tmp_path), "nsga2")
    oracle.verbose = 0
    running = []
    for step in range(20):
        trial = oracle.create_trial(f"group{step}")
        assert trial.status == "RUNNING"
        running.append(trial)
        if len(running) == 4:
            done = running.pop(0)
            oracle.update_trial(done.trial_id, zdt1(done.hyperparameters.values))
            done.status = "COMPLETED"
            oracle.end_trial(done)
    state = oracle.get_state()
    reloaded = kdist.tune.NSGA2Oracle(OBJECTIVES, max_trials=30)
    reloaded._set_project_dir(str(tmp_path), "nsga2")
    reloaded.verbose = 0
    reloaded.reload()
    for name in ("population_size", "crossover_eta", "mutation_eta", "mutation_rate", "seed"):
        assert getattr(reloaded, name) == state[name] if name in state else True
    assert reloaded.population_size == 4 and reloaded.seed == 2
    assert [t.trial_id for t in reloaded.pareto_front()] == [
        t.trial_id for t in oracle.pareto_front()]


def test_bad_objectives_and_settings_are_refused():
    with pytest.raises(ValueError, match="at least two objectives"):
        kdist.tune.NSGA2Oracle(kt.Objective("loss", "min"))
    with pytest.raises(ValueError, match="at least two objectives"):
        kdist.tune.ParEGOOracle([kt.Objective("loss", "min")])
    with pytest.raises(ValueError, match="population_size"):
        kdist.tune.NSGA2Oracle(OBJECTIVES, population_size=3)
    with pytest.raises(ValueError, match="mutation_rate"):
        kdist.tune.NSGA2Oracle(OBJECTIVES, mutation_rate=2.0)
    with pytest.raises(ValueError, match="crossover_eta"):
        kdist.tune.NSGA2Oracle(OBJECTIVES, crossover_eta=0)


def test_the_front_plot_is_written(tmp_path):
    oracle = kdist.tune.NSGA2Oracle(OBJECTIVES, max_trials=10, seed=0, hyperparameters=_space())
    _search(oracle, tmp_path)
    path = tmp_path / "front.png"
    ax = kdist.tune.plot_front(oracle, path)
    assert path.stat().st_size > 1000
    assert ax.get_xlabel() == "f1 (min)" and ax.get_ylabel() == "f2 (min)"
    empty = kdist.tune.NSGA2Oracle(OBJECTIVES)
    with pytest.raises(ValueError, match="no finished trial"):
        kdist.tune.plot_front(empty)
