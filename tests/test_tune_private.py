"""kdist reaches keras-tuner's private API only through kdist/tune/compat.py, and a
distributed search leaves nothing of itself on the tuner."""

import ast
import inspect
import os
import pathlib

import keras_tuner as kt
import pytest

import kdist.tune
from kdist.tune import compat, distributed

KDIST = pathlib.Path(kdist.tune.__file__).parents[1]
COMPAT = KDIST / "tune" / "compat.py"


def _private_keras_tuner_names():
    """Private attributes and methods of keras-tuner's public classes."""
    classes = [kt.Oracle, kt.Tuner, kt.Hyperband, kt.HyperModel, kt.HyperParameters,
               kt.engine.trial.Trial, kt.engine.base_tuner.BaseTuner]
    names = set()
    for cls in classes:
        for klass in inspect.getmro(cls):
            if klass.__module__.startswith("keras_tuner"):
                names.update(vars(klass))
    oracle = kt.oracles.RandomSearchOracle(kt.Objective("loss", "min"), max_trials=1)
    names.update(vars(oracle))  # instance attributes set in __init__
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def _modules_using_keras_tuner():
    for path in sorted(KDIST.rglob("*.py")):
        if path == COMPAT:
            continue
        text = path.read_text()
        if "keras_tuner" in text:
            yield path, ast.parse(text)


def test_only_compat_imports_keras_tuner_internals():
    found = []
    for path, tree in _modules_using_keras_tuner():
        for node in ast.walk(tree):
            modules = []
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                modules = [node.module]
            found += [f"{path.relative_to(KDIST)}:{node.lineno} {m}" for m in modules
                      if m == "keras_tuner.src" or m.startswith("keras_tuner.src.")]
    assert not found, "import keras-tuner internals in kdist/tune/compat.py only: " + \
        ", ".join(found)


def test_only_compat_touches_private_keras_tuner_attributes():
    private = _private_keras_tuner_names()
    assert {"_random_values", "_retry_queue", "_get_checkpoint_fname"} <= private
    found = []
    for path, tree in _modules_using_keras_tuner():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in private:
                found.append(f"{path.relative_to(KDIST)}:{node.lineno} .{node.attr}")
            elif isinstance(node, ast.ClassDef):
                # Overriding a private hook relies on it as much as calling it.
                found += [f"{path.relative_to(KDIST)}:{item.lineno} def {item.name}"
                          for item in node.body
                          if isinstance(item, ast.FunctionDef) and item.name in private]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                # Doctests are code too.
                found += [f"{path.relative_to(KDIST)}:{node.lineno} .{name} (in a string)"
                          for name in private if f".{name}(" in node.value]
    assert not found, ("reach keras-tuner's private API through kdist/tune/compat.py: "
                       + ", ".join(found))


class _Own(kt.Tuner):
    def run_trial(self, trial, *args, **kwargs):
        return {"loss": 1.0}


def _tuner(tmp_path):
    oracle = kt.oracles.RandomSearchOracle(kt.Objective("loss", "min"), max_trials=1)
    return _Own(oracle=oracle, hypermodel=lambda hp: None, directory=str(tmp_path),
                project_name="own")


def test_a_part_stands_in_for_public_attributes_and_gives_them_back(tmp_path):
    tuner = _tuner(tmp_path)
    before, oracle = dict(vars(tuner)), tuner.oracle
    stand_in = object()
    with pytest.raises(RuntimeError, match="the search failed"):
        with distributed._standing_in(tuner, oracle=stand_in, tuner_id="group0",
                                      directory=str(tmp_path / "scratch")):
            assert tuner.oracle is stand_in and tuner.tuner_id == "group0"
            # A follower's checkpoints land in its own directory.
            assert compat.checkpoint_path(tuner, "7").startswith(str(tmp_path / "scratch"))
            raise RuntimeError("the search failed")
    assert vars(tuner) == before and tuner.oracle is oracle and tuner.tuner_id == "tuner0"
    assert type(tuner) is _Own


def test_a_leaders_oracle_leaves_the_oracles_files_to_rank_0(tmp_path):
    tuner = _tuner(tmp_path)
    leader = distributed._LeaderOracle(client=tuner.oracle, roles=None, tuner_id="group0",
                                       lost_after=30)
    assert leader.objective == tuner.oracle.objective  # asked of the service's client
    with distributed._standing_in(tuner, oracle=leader, tuner_id="group0"):
        tuner.save()
        assert os.path.exists(compat.tuner_file(tuner))  # this group's own state
    assert not os.path.exists(compat.oracle_file(tuner.oracle))
    assert leader.finish_trial(None) is None  # no trial in hand: nothing to gather


def test_a_distributed_search_leaves_nothing_on_the_tuner_even_when_it_fails(mpirun, tmp_path):
    job = mpirun("tune_leftovers.py", n=3, timeout=300, args=[tmp_path])
    for rank in range(3):
        report = job.rank(rank)
        assert report["class"] == "Own", report
        for name in ("run_trial", "_get_checkpoint_fname", "tuner_id", "save"):
            assert name not in report["added"], report
        for name in ("save", "_save_trial"):
            assert name not in report["added_to_oracle"], report
        assert report["same_oracle"] and report["hypermodel_fit"] is False, report
        assert report["environment"] == {}, report
    assert job.rank(1)["failed"] == "FatalError: the search stops here"


def test_the_oracle_client_is_keras_tuners_own_and_leaves_no_environment(monkeypatch):
    from keras_tuner.src.distribute import oracle_client

    oracle = kt.oracles.RandomSearchOracle(kt.Objective("loss", "min"), max_trials=1)
    for name in ("KERASTUNER_ORACLE_IP", "KERASTUNER_ORACLE_PORT", "KERASTUNER_TUNER_ID"):
        monkeypatch.delenv(name, raising=False)
    # gRPC channels connect lazily: no service needs to listen.
    client = compat.oracle_client(oracle, ("127.0.0.1", 1), "group0")
    assert type(client) is oracle_client.OracleClient
    assert client.tuner_id == "group0" and client.objective == oracle.objective
    assert not [name for name in os.environ if name.startswith("KERASTUNER_")]


def test_a_search_with_keras_tuners_own_variables_set_is_refused(monkeypatch):
    from types import SimpleNamespace

    monkeypatch.setenv("KERASTUNER_TUNER_ID", "chief")
    with pytest.raises(ValueError, match="KERASTUNER_TUNER_ID set: .* unset them"):
        distributed.search(None, comm=SimpleNamespace(size=3, rank=0))
