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


@pytest.mark.parametrize("mixin", [distributed._Leading, distributed._Following])
def test_a_part_is_played_by_a_view_and_the_tuner_keeps_its_class(tmp_path, mixin):
    tuner = _tuner(tmp_path)
    before, oracle = dict(vars(tuner)), tuner.oracle
    environment = {name: value for name, value in os.environ.items()
                   if name.startswith("KERASTUNER_")}
    scratch = tmp_path / "scratch"
    part = distributed._Part(None, "group0", scratch=str(scratch))
    part.client = object()
    view = distributed._playing(tuner, mixin, part)
    assert isinstance(view, mixin) and isinstance(view, _Own) and type(tuner) is _Own
    # What the search records on the view is recorded on the user's tuner.
    view.recorded = 1
    assert tuner.recorded == 1
    del view.recorded
    # The part's state stays on the view.
    assert view._role is part and "_role" not in vars(tuner)
    if mixin is distributed._Leading:
        assert view.oracle is part.client and view.tuner_id == "group0"
        assert compat.is_worker(view) and not compat.is_worker(tuner)
        # kdist's whole-file saves, set on the tuner, save as the view: a worker's.
        kdist.tune.storage.make_saves_whole(tuner)
        before["save"] = tuner.save
        view.save()
        assert os.path.exists(compat.tuner_file(view))
        assert not os.path.exists(compat.oracle_file(tuner.oracle))
    else:
        assert compat.checkpoint_path(view, "7") == str(scratch / "trial_7.weights.h5")
    assert vars(tuner) == before and tuner.oracle is oracle and tuner.tuner_id == "tuner0"
    assert {name: value for name, value in os.environ.items()
            if name.startswith("KERASTUNER_")} == environment
    # The same class is reused, not made again for every search.
    assert distributed._subclass(_Own, mixin) is distributed._subclass(_Own, mixin)


def test_a_distributed_search_leaves_nothing_on_the_tuner_even_when_it_fails(mpirun, tmp_path):
    job = mpirun("tune_leftovers.py", n=3, timeout=300, args=[tmp_path])
    for rank in range(3):
        report = job.rank(rank)
        assert report["class"] == "Own", report
        for name in ("run_trial", "_get_checkpoint_fname", "tuner_id"):
            assert name not in report["added"], report
        assert report["same_oracle"] and report["hypermodel_fit"] is False, report
        assert report["environment"] == {}, report
    assert job.rank(1)["failed"] == "FatalError: the search stops here"


def test_the_oracle_client_is_keras_tuners_own_built_without_the_environment(monkeypatch):
    from keras_tuner.src.distribute import oracle_client

    oracle = kt.oracles.RandomSearchOracle(kt.Objective("loss", "min"), max_trials=1)
    # keras-tuner's constructor, from its environment (gRPC channels connect lazily).
    monkeypatch.setenv("KERASTUNER_ORACLE_IP", "127.0.0.1")
    monkeypatch.setenv("KERASTUNER_ORACLE_PORT", "1")
    monkeypatch.setenv("KERASTUNER_TUNER_ID", "group0")
    theirs = oracle_client.OracleClient(oracle)
    for name in ("KERASTUNER_ORACLE_IP", "KERASTUNER_ORACLE_PORT", "KERASTUNER_TUNER_ID"):
        monkeypatch.delenv(name)
    ours = compat.oracle_client(oracle, ("127.0.0.1", 1), "group0")
    assert type(ours) is type(theirs) and set(vars(ours)) == set(vars(theirs))
    assert ours.tuner_id == theirs.tuner_id == "group0" and ours.objective == oracle.objective
    assert (ours.multi_worker, ours.should_report) == (theirs.multi_worker, theirs.should_report)


def test_a_search_with_keras_tuners_own_variables_set_is_refused(monkeypatch):
    from types import SimpleNamespace

    monkeypatch.setenv("KERASTUNER_TUNER_ID", "chief")
    with pytest.raises(ValueError, match="KERASTUNER_TUNER_ID set: .* unset them"):
        distributed.search(None, comm=SimpleNamespace(size=3, rank=0))
