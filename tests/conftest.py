"""Shared fixtures. Multi-process tests launch real `mpiexec` jobs through `mpirun`."""

import gc
import json
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
WORKERS = os.path.join(HERE, "workers")


@dataclass
class MPIResult:
    returncode: int
    output: str
    results: dict  # rank -> JSON object the rank wrote with workers.common.report()

    def rank(self, r):
        return self.results[r]


def _mpiexec():
    from kdist.cli import find_mpiexec

    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return None
    return find_mpiexec()


def _read_reports(report_dir):
    """rank -> the JSON object that rank (or TF worker) wrote into `report_dir`."""
    results = {}
    for name in os.listdir(report_dir):
        if name.startswith("rank-") and name.endswith(".json"):
            with open(os.path.join(report_dir, name)) as f:
                results[int(name[5:-5])] = json.load(f)
    return results


WITHOUT_MPI = "KDIST_TEST_WITHOUT_MPI"


def _without_mpi_asked():
    return os.environ.get(WITHOUT_MPI, "").strip().lower() not in ("", "0", "false", "no",
                                                                   "off")


SLOW_OPTION = "--slow"


def pytest_addoption(parser):
    parser.addoption(
        SLOW_OPTION, action="store_true",
        help="also run the tests marked slow: whole benchmark scripts and the longer fault "
             "and strategy matrices, each of whose behaviours a default test covers too")


@pytest.hookimpl(tryfirst=True)
def pytest_itemcollected(item):
    """Every test that launches MPI jobs is an `mpi` test, marked or not, so that
    `-m "not mpi"` leaves all of them out."""
    if "mpiexec_path" in getattr(item, "fixturenames", ()):
        item.add_marker(pytest.mark.mpi)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """Refuses to run a selection that holds multi-process tests when MPI is missing:
    skipping them would leave a green run that tested none of the distributed behaviour.
    `KDIST_TEST_WITHOUT_MPI=1` skips them knowingly instead."""
    if not config.getoption(SLOW_OPTION):
        # Skipped, not deselected, so that the summary counts what the run left out.
        left_out = pytest.mark.skip(reason=f"slow: runs with {SLOW_OPTION}")
        for item in items:
            if item.get_closest_marker("slow"):
                item.add_marker(left_out)
    needs_mpi = [item for item in items if "mpiexec_path" in getattr(item, "fixturenames", ())]
    if needs_mpi and _mpiexec() is None and not _without_mpi_asked():
        raise pytest.UsageError(
            f"{len(needs_mpi)} selected tests launch MPI jobs, but mpi4py or mpiexec is "
            f"missing (pip install -e '.[test]' installs both). Set {WITHOUT_MPI}=1 to skip "
            f"them knowingly, or deselect them with -m 'not mpi'.")


def pytest_collection_finish(session):
    """Moves what the imports made (TensorFlow, Keras, keras-tuner) out of the garbage
    collector's sight. Keras's `clear_session` and keras-tuner's every trial call
    `gc.collect()`, which otherwise walks those objects each time: about 0.3 s a call."""
    gc.collect()
    gc.freeze()


@pytest.fixture(scope="session")
def mpiexec_path():
    path = _mpiexec()
    if path is None:
        pytest.skip(f"needs mpi4py and mpiexec (pip install 'kdist[mpi]'); skipped because "
                    f"{WITHOUT_MPI} is set")
    return path


@pytest.fixture
def mpirun(mpiexec_path, tmp_path):
    """Runs a Python script on N ranks with a hard timeout and collects each rank's report.

    `script` is a path under tests/workers/ or a string of code. Each rank may
    call `workers.common.report(obj)` to hand a JSON object back; the test
    gets them as `result.results[rank]`. A job that outlives `timeout` is
    killed and the test fails with its output, so a hang can never stall CI.
    """
    from kdist.cli import mpiexec_command

    def run(script, n=2, args=(), timeout=180, check=True, env=None, fault_tolerant=False,
            mpi_args=(), hosts=None):
        """`hosts`: spread the `n` ranks evenly over that many emulated hosts (see
        tests/emulated_hosts.py), launched from the first as on a cluster."""
        if hosts is not None:
            import emulated_hosts

            why_not = emulated_hosts.available()
            if why_not:
                pytest.skip(why_not)
            if n % hosts:
                raise ValueError(f"{n} ranks do not spread evenly over {hosts} hosts")
            with emulated_hosts.EmulatedHosts(hosts) as machines:
                return _run(script, n, args, timeout, check, env, fault_tolerant, mpi_args,
                            machines)
        return _run(script, n, args, timeout, check, env, fault_tolerant, mpi_args, None)

    def _run(script, n, args, timeout, check, env, fault_tolerant, mpi_args, machines):
        if "\n" in script or not script.endswith(".py"):
            path = tmp_path / f"script_{abs(hash(script))}.py"
            path.write_text(textwrap.dedent(script))
            script = str(path)
        elif not os.path.isabs(script):
            script = os.path.join(WORKERS, script)
        report_dir = tmp_path / f"reports_{abs(hash((script, tuple(args))))}"
        report_dir.mkdir(exist_ok=True)
        command = [sys.executable, "-u", script] + [str(a) for a in args]
        settings = {
            "PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]),
            "KDIST_TEST_REPORTS": str(report_dir),
            "TF_CPP_MIN_LOG_LEVEL": "3",
            "PYTHONUNBUFFERED": "1",
            # A rank that crashes in native code prints every thread's Python stack.
            "PYTHONFAULTHANDLER": "1",
        }
        settings.update(env or {})
        if machines is not None:
            # So that a worker can pull its own host's cable (see emulated_hosts.set_link).
            settings.update({"KDIST_TEST_SWITCH": f"{machines.prefix}sw",
                             "KDIST_TEST_HOSTS": machines.prefix})
            # Open MPI gives ranks on other hosts only the variables it is told to.
            mpi_args = machines.mpi_args(n // machines.count, forward=sorted(settings)) + list(
                mpi_args)
        argv, full_env = mpiexec_command(n, command, mpiexec=mpiexec_path, extra=mpi_args,
                                         fault_tolerant=fault_tolerant)
        full_env.update(settings)
        if machines is not None:
            argv = machines.on_first_host(argv)
        try:
            done = subprocess.run(argv, env=full_env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as error:
            out = error.output or ""
            if isinstance(out, bytes):
                out = out.decode(errors="replace")
            # TensorFlow's start-up lines would crowd out what the ranks said.
            out = "\n".join(line for line in out.splitlines()
                             if "absl::InitializeLog" not in line and "cudart_stub" not in line)
            reported = sorted(p.name for p in report_dir.iterdir())
            pytest.fail(f"mpiexec job did not finish within {timeout} s; reports written: "
                        f"{reported}\n{out[-6000:]}")
        results = _read_reports(report_dir)
        result = MPIResult(done.returncode, done.stdout, results)
        if check and done.returncode != 0:
            pytest.fail(f"mpiexec job failed with exit code {done.returncode}:\n"
                        f"{done.stdout[-6000:]}")
        return result

    return run


@pytest.fixture(scope="session")
def python_run(tmp_path_factory):
    """Runs a worker script in a fresh single Python process (no MPI launcher).

    The workers are seeded, so a single-process reference is a function of the
    script and its arguments: a run asked for again is answered from the first.
    """
    answered = {}

    def run(script, args=(), timeout=180):
        key = (script, tuple(str(a) for a in args))
        if key not in answered:
            answered[key] = json.dumps(_run_single(script, args, timeout))
        return json.loads(answered[key])

    def _run_single(script, args, timeout):
        report_dir = tmp_path_factory.mktemp("single")
        env = dict(os.environ)
        for name in list(env):
            if name.startswith(("OMPI_", "PMIX_", "PMI_")):
                env.pop(name)
        env.update({"PYTHONPATH": os.pathsep.join([HERE, env.get("PYTHONPATH", "")]),
                    "KDIST_TEST_REPORTS": str(report_dir), "TF_CPP_MIN_LOG_LEVEL": "3"})
        path = script if os.path.isabs(script) else os.path.join(WORKERS, script)
        done = subprocess.run([sys.executable, "-u", path] + [str(a) for a in args], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=timeout)
        if done.returncode != 0:
            pytest.fail(f"{script} failed:\n{done.stdout[-6000:]}")
        with open(report_dir / "rank-0.json") as f:
            return json.load(f)

    return run


@pytest.fixture(scope="session")
def tf_launch(tmp_path_factory):
    """Runs a script as N TensorFlow workers through `kdist launch` and collects reports.

    Like `mpirun`, but each worker gets TF_CONFIG instead of an MPI rank and
    reports with `workers.tf_common.report(obj)`. On `timeout` the launcher
    gets SIGTERM, which stops its workers, and the test fails with the output.
    """

    def run(script, n=2, args=(), timeout=120, check=True, env=None, launch_args=()):
        if not os.path.isabs(script):
            script = os.path.join(WORKERS, script)
        report_dir = tmp_path_factory.mktemp("tf_reports")
        full_env = {name: value for name, value in os.environ.items()
                    if not name.startswith(("OMPI_", "PMIX_", "PMI_", "SLURM_", "TF_CONFIG"))}
        full_env.update({
            "PYTHONPATH": os.pathsep.join([WORKERS, HERE, os.environ.get("PYTHONPATH", "")]),
            "KDIST_TEST_REPORTS": str(report_dir),
            "TF_CPP_MIN_LOG_LEVEL": "3",
            "PYTHONUNBUFFERED": "1",
        })
        full_env.update(env or {})
        argv = [sys.executable, "-m", "kdist.cli", "launch", "-n", str(n), *launch_args,
                script, *[str(a) for a in args]]
        process = subprocess.Popen(argv, env=full_env, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True)
        try:
            output, _ = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.terminate()
            try:
                output, _ = process.communicate(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                output, _ = process.communicate()
            pytest.fail(f"kdist launch did not finish within {timeout} s:\n{output[-6000:]}")
        results = _read_reports(report_dir)
        result = MPIResult(process.returncode, output, results)
        if check and process.returncode != 0:
            pytest.fail(f"kdist launch failed with exit code {process.returncode}:\n"
                        f"{output[-6000:]}")
        return result

    return run
