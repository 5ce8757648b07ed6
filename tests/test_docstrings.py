"""Every `>>>` example in kdist's docstrings runs and prints what it shows.

An example sees only what its module defines, as a reader sees only the
example and the name it documents, so it imports everything else it uses.

Multi-rank examples: a docstring whose example section starts with
"On 2 ranks" shows what each rank of a 2-rank job sees (outputs must be the
same on both). Such docstrings are named in MULTI_RANK and run under
mpiexec on 2 ranks; every other example runs in this process, a world of one
rank. A test keeps the list and the docstrings in step, so an example cannot
be marked in one place only.
"""

import doctest
import importlib
import importlib.util
import io
import pkgutil
import shutil

import pytest

import kdist

FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
MARK = "On 2 ranks"

MULTI_RANK = {
    "kdist.callbacks.broadcast.BroadcastGlobalVariablesCallback",
    "kdist.callbacks.learning_rate.LearningRateWarmupCallback",
    "kdist.comm.collectives.allreduce",
    "kdist.comm.collectives.broadcast_",
    "kdist.comm.collectives.grouped_allgather",
    "kdist.comm.collectives.grouped_reducescatter",
    "kdist.comm.collectives.reducescatter",
    "kdist.comm.joining.join",
    "kdist.distribute.mpi_strategy.MPIStrategy",
    "kdist.optimizers.tape.DistributedGradientTape",
}

# Modules that are not meant to be imported.
NOT_MODULES = {
    "kdist._prefix": "a script that `kdist run` starts by path on each rank",
}


def _has_hls4ml_and_compiler():
    return importlib.util.find_spec("hls4ml") is not None and (
        shutil.which("g++") is not None or shutil.which("c++") is not None)


# Docstrings whose examples need an optional package or tool: name -> (available, why).
NEEDS = {
    "kdist.sparsity.hls.export_hls4ml": (_has_hls4ml_and_compiler,
                                         "needs hls4ml and a C++ compiler"),
}


def _module_names():
    names = ["kdist"] + [info.name for info in pkgutil.walk_packages(kdist.__path__, "kdist.")]
    found = []
    for name in names:
        if name in NOT_MODULES:
            continue
        with open(importlib.util.find_spec(name).origin, encoding="utf-8") as f:
            if ">>>" in f.read():
                found.append(name)
    return found


MODULES = _module_names()


def docstrings(module_name):
    """The module's docstrings that hold examples, as doctest finds them."""
    module = importlib.import_module(module_name)
    own = {name: value for name, value in vars(module).items()
           if name.startswith("__") or getattr(value, "__module__", None) == module_name}
    return [test for test in doctest.DocTestFinder().find(module, module_name, globs=own)
            if test.examples]


def run_docstrings(tests):
    """Runs `tests`; returns how many examples ran, how many failed and doctest's report."""
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    out = io.StringIO()
    for test in tests:
        runner.run(test, out=out.write)
    return {"attempted": runner.tries, "failed": runner.failures, "report": out.getvalue()}


def run_named(names):
    """Runs the docstrings called `names` (a rank of the multi-rank job calls this)."""
    modules = sorted({name for name in MODULES if any(n.startswith(name + ".") for n in names)})
    tests = [test for module in modules for test in docstrings(module) if test.name in names]
    result = run_docstrings(tests)
    result["names"] = sorted(test.name for test in tests)
    return result


@pytest.mark.parametrize("module_name", MODULES)
def test_examples_run(module_name):
    tests, skipped = [], []
    for test in docstrings(module_name):
        if test.name in MULTI_RANK:
            continue
        available, why = NEEDS.get(test.name, (lambda: True, ""))
        if available():
            tests.append(test)
        else:
            skipped.append(f"{test.name} ({why})")
    if not tests:
        pytest.skip("; ".join(skipped) or "only multi-rank examples")
    result = run_docstrings(tests)
    assert result["failed"] == 0, result["report"]


def test_multi_rank_examples_are_marked_and_listed():
    marked = {test.name for module in MODULES for test in docstrings(module)
              if MARK in test.docstring}
    assert marked == MULTI_RANK


MULTI_RANK_SCRIPT = """
import sys

import kdist
from workers.common import report

from test_docstrings import run_named

kdist.init()
report(run_named(set(sys.argv[1:])))
"""


@pytest.mark.mpi
def test_multi_rank_examples_run_on_two_ranks(mpirun):
    result = mpirun(MULTI_RANK_SCRIPT, n=2, args=sorted(MULTI_RANK), timeout=240)
    assert sorted(result.results) == [0, 1], result.output[-4000:]
    for rank, outcome in result.results.items():
        assert outcome["names"] == sorted(MULTI_RANK)
        assert outcome["failed"] == 0, f"rank {rank}:\n{outcome['report']}"
        assert outcome["attempted"] > 0
