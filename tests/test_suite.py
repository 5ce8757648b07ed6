"""The suite's own guards: a run that cannot test the distributed behaviour says so."""

import os
import subprocess
import sys

pytest_plugins = ["pytester"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _collect_without_mpi4py(tmp_path, *args, files=("tests/test_ring.py",), **env):
    # An mpi4py that cannot be imported, ahead of the real one on the path.
    fake = tmp_path / "mpi4py"
    fake.mkdir(exist_ok=True)
    (fake / "__init__.py").write_text("raise ImportError('hidden for this test')\n")
    environ = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}"
                   f"{os.environ.get('PYTHONPATH', '')}")
    environ.pop("KDIST_TEST_WITHOUT_MPI", None)
    environ.update(env)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider",
         *args, *files], cwd=ROOT, env=environ, capture_output=True, text=True,
        timeout=300)


def test_a_selection_with_mpi_tests_refuses_to_run_without_mpi(tmp_path):
    refused = _collect_without_mpi4py(tmp_path)
    assert refused.returncode == 4, refused.stdout[-2000:] + refused.stderr[-2000:]
    assert "launch MPI jobs, but mpi4py or mpiexec is missing" in refused.stderr
    # Asked for knowingly, the same selection is collected (and its MPI tests skip).
    allowed = _collect_without_mpi4py(tmp_path, KDIST_TEST_WITHOUT_MPI="1")
    assert allowed.returncode == 0, allowed.stdout[-2000:] + allowed.stderr[-2000:]
    # Leaving the MPI tests out is another way, and it leaves out those that launch MPI
    # jobs without the marker too (test_cli.py has some).
    left_out = _collect_without_mpi4py(tmp_path, "-m", "not mpi",
                                       files=("tests/test_cli.py",))
    assert left_out.returncode == 0, left_out.stdout[-2000:] + left_out.stderr[-2000:]
    assert "test_run_prefixes_each_rank_and_reports_info" not in left_out.stdout
    assert "test_info_reports_versions_and_ranks" in left_out.stdout




def test_slow_tests_are_skipped_with_their_reason_unless_asked_for(pytester):
    with open(os.path.join(ROOT, "tests", "conftest.py")) as f:
        pytester.makeconftest(f.read())
    pytester.makeini("[pytest]\nmarkers =\n    slow: long\n")
    pytester.makepyfile(test_marked="""
        import pytest

        @pytest.mark.slow
        def test_long():
            pass

        def test_short():
            pass
    """)
    default = pytester.runpytest_subprocess("-rs")
    default.assert_outcomes(passed=1, skipped=1)
    assert "slow: runs with --slow" in default.stdout.str()
    pytester.runpytest_subprocess("--slow").assert_outcomes(passed=2)
