"""The shared worlds the multi-rank tests run on: nothing leaks, every rank counts, nothing hangs."""

import os
import textwrap

import pytest

import shared_world
from conftest import _rank_environment

pytestmark = pytest.mark.mpi
pytest_plugins = ["pytester"]

LEAVES_STATE = """
import logging, os, random, signal, sys
import keras, numpy as np, tensorflow as tf
import kdist
import kdist.ps.server
from workers.common import report

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import leaky_helper  # written beside this script by the test

leaky_helper.calls += 1
kdist.init()
pair = kdist.add_process_set([1])
os.environ["KDIST_TEST_LEFT_BEHIND"] = "1"
os.environ["KDIST_STALL_WARNING"] = "3"
keras.config.set_dtype_policy("mixed_float16")
keras.config.set_floatx("float64")
tf.config.run_functions_eagerly(True)
keras.utils.set_random_seed(1234)
draws = [random.random(), float(np.random.rand()), float(tf.random.uniform(()))]
tf.config.experimental.enable_op_determinism()  # unseeded random ops would then fail
layer = keras.layers.Dense(2)
logging.getLogger().addHandler(logging.StreamHandler())
signal.signal(signal.SIGTERM, lambda *a: None)
sys.path.append("/left/behind")
os.chdir(os.path.dirname(os.path.abspath(__file__)))
report({"pid": os.getpid(), "draws": draws, "layer": layer.name, "set": pair.process_set_id,
        "handlers": len(logging.getLogger().handlers) - 1,
        "libraries": [id(sys.modules[m]) for m in ("kdist", "kdist.ps.server", "keras")]})
"""

FINDS_IT_FRESH = """
import logging, os, random, signal, sys
import keras, numpy as np, tensorflow as tf
import kdist
import kdist.ps.server
from kdist.comm import process_sets
from workers.common import report

initialized_before = kdist.comm.is_initialized()
kdist.init()
pair = kdist.add_process_set([1])
report({
    "pid": os.getpid(),
    "initialized_before": initialized_before,
    "set": pair.process_set_id,
    "sets": [i for i in range(1, 4) if process_sets.registered(i) is not None],
    "env": os.environ.get("KDIST_TEST_LEFT_BEHIND"),
    "stall_warning": os.environ.get("KDIST_STALL_WARNING"),
    "policy": keras.config.dtype_policy().name,
    "floatx": keras.config.floatx(),
    "eager": tf.config.functions_run_eagerly(),
    "draws": [random.random(), float(np.random.rand()), float(tf.random.uniform(()))],
    "layer": keras.layers.Dense(2).name,
    "handlers": len(logging.getLogger().handlers),
    "sigterm_default": signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None),
    "path_left": "/left/behind" in sys.path,
    "module_left": "leaky_helper" in sys.modules,
    "cwd": os.getcwd(),
    "libraries": [id(sys.modules[m]) for m in ("kdist", "kdist.ps.server", "keras")],
})
"""


def test_what_a_script_leaves_behind_does_not_reach_the_next(mpirun, tmp_path):
    (tmp_path / "leaky_helper.py").write_text("calls = 0\n")
    script = tmp_path / "leaves_state.py"
    script.write_text(textwrap.dedent(LEAVES_STATE))
    left = mpirun(str(script), n=2)
    fresh = mpirun(FINDS_IT_FRESH, n=2)
    for rank in (0, 1):
        before, after = left.rank(rank), fresh.rank(rank)
        assert before["pid"] == after["pid"], "both scripts ran in the same shared world"
        assert not after["initialized_before"], "kdist was shut down between the scripts"
        # Process sets: the new world's first set takes id 1 again, and no old one is there.
        assert before["set"] == after["set"] == 1 and after["sets"] == [1]
        assert after["env"] is None and after["stall_warning"] is None
        assert after["policy"] == "float32" and after["floatx"] == "float32"
        assert after["eager"] is False
        assert after["layer"] == before["layer"] == "dense", "Keras's names start again"
        assert after["draws"] != before["draws"], "generators are seeded afresh"
        assert after["handlers"] == before["handlers"]
        assert after["sigterm_default"] and not after["path_left"] and not after["module_left"]
        assert after["cwd"] == os.getcwd()
        # Libraries stay loaded: only the script's own modules are forgotten.
        assert after["libraries"] == before["libraries"]
    # As in two new processes, the ranks' unseeded generators differ.
    assert fresh.rank(0)["draws"] != fresh.rank(1)["draws"]


def test_only_the_scripts_own_modules_are_forgotten_wherever_the_checkout_lives(tmp_path):
    clone = tmp_path / "clone"  # a checkout under /tmp, its environment inside it
    tests, package = clone / "tests", clone / "kdist"
    venv = clone / ".venv" / "lib" / "python3.11" / "site-packages"
    scripts = tmp_path / "pytest-0" / "test_x0"
    for folder in (tests / "workers", package / "ps", venv / "keras", scripts):
        folder.mkdir(parents=True)

    def own(path, folders=()):
        path.touch()
        return shared_world.is_scripts_own(str(path), [str(f) for f in folders], str(tests),
                                           keep=[str(package)])

    assert own(tests / "workers" / "common.py", [tests / "workers"])
    assert own(scripts / "helper.py", [scripts])
    assert not own(package / "ps" / "server.py", [clone])  # kdist, even below a script
    assert not own(venv / "keras" / "__init__.py", [clone])  # an installed library
    assert not own(tmp_path / "elsewhere.py", [scripts])
    assert not shared_world.is_scripts_own(None, [str(scripts)], str(tests))


ONE_RANK_FAILS = """
import kdist
kdist.init()
total = kdist.allreduce(1.0, op=kdist.Sum, name="before the failure")
if kdist.rank() == 1:
    assert total == 3.0, f"rank 1 checks a wrong total on purpose: {total}"
"""

SEGFAULT_ON_RANK_1 = """
import ctypes, kdist
kdist.init()
kdist.allreduce(1.0, name="before the crash")
assert kdist.comm.native.load() is not None, kdist.comm.native.failure()
if kdist.rank() == 1:
    ctypes.string_at(0)  # the crash
kdist.allreduce(1.0, name="rank 0 waits here")
"""


def test_a_world_names_each_failing_rank_and_ends_when_a_rank_crashes(tmp_path):
    """Starts a world of its own: the test ends it by crashing one of its ranks."""
    from kdist.cli import find_mpiexec

    fail, crash = tmp_path / "fail.py", tmp_path / "crash.py"
    fail.write_text(ONE_RANK_FAILS)
    crash.write_text(SEGFAULT_ON_RANK_1)
    environ = _rank_environment()
    world = shared_world.World(2, environ, mpiexec=find_mpiexec())
    try:
        failed = world.run(fail, environ=environ, timeout=60)
        assert failed.returncode == 1 and sorted(failed.failures) == [1]
        assert "rank 1 checks a wrong total on purpose: 2.0" in failed.failures[1]
        report = failed.report()
        assert "--- rank 1 failed ---" in report and "AssertionError" in report
        assert not failed.ended_world and world.alive(), "rank 0 was not left waiting"
        crashed = world.run(crash, environ=environ, timeout=60)
        assert crashed.ended_world and not world.alive()
        assert sorted(crashed.failures) == [0, 1]
        # What the crash leaves: the native backtrace of the crashing thread (kdist's
        # ops are loaded), then the fault and every thread's Python stack with the line.
        output = crashed.output
        line = SEGFAULT_ON_RANK_1.splitlines().index("    ctypes.string_at(0)  # the crash") + 1
        assert "kdist: native backtrace of the crashing thread:" in output
        assert "Fatal Python error: Segmentation fault" in output
        assert output.index("native backtrace") < output.index("Fatal Python error")
        assert f'File "{crash}", line {line} in <module>' in output
        assert "kdist-watchdog" in output or "watchdog.py" in output, "every thread's stack"
    finally:
        world.end()


HANGS = '''
HANGING = """
import time
import kdist

def wait_here_for_ever():
    while True:
        time.sleep(0.1)

kdist.init()
if kdist.rank() == 1:
    wait_here_for_ever()
kdist.barrier()
"""


def test_hangs(mpirun):
    mpirun(HANGING, n=2, timeout=8)


def test_after_the_hang(mpirun):
    mpirun("import kdist\\nkdist.init()", n=2)
'''


def test_a_hang_dumps_every_rank_and_the_rest_of_its_file_is_not_run(pytester, monkeypatch):
    """Runs a session of its own: its subject is what the suite reports after a hang."""
    here = os.path.dirname(os.path.abspath(__file__))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    with open(os.path.join(here, "conftest.py")) as f:
        pytester.makeconftest(f.read())
    pytester.makepyfile(test_hangs=HANGS)
    pytester.makeini("[pytest]\nmarkers =\n    mpi: mpi\n    slow: long\n")
    result = pytester.runpytest_subprocess("-rs", "-p", "no:cacheprovider", timeout=240)
    result.assert_outcomes(failed=1, skipped=1)
    out = result.stdout.str()
    assert "did not end on rank(s) [0, 1] within 8 s" in out
    assert "in wait_here_for_ever" in out, "rank 1's stack shows where it waits"
    assert "kdist.barrier" in out or "barrier" in out, "rank 0's stack shows its wait"
    assert "not run: the shared world hung in test_hangs.py::test_hangs" in out


def test_every_test_with_a_job_of_its_own_says_why():
    import ast

    here = os.path.dirname(os.path.abspath(__file__))
    silent = []
    for name in sorted(os.listdir(here)):
        if not (name.startswith("test_") and name.endswith(".py")):
            continue
        with open(os.path.join(here, name)) as f:
            tree = ast.parse(f.read())
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_") and \
                    "mpi_job" in [a.arg for a in node.args.args]:
                if len(ast.get_docstring(node) or "") < 30:
                    silent.append(f"{name}::{node.name}")
    assert not silent, f"tests with a job of their own must say why in a docstring: {silent}"
