"""Shared fixtures. Multi-process tests launch real `mpiexec` jobs through `mpirun`."""

import contextlib
import gc
import json
import os
import resource
import shlex
import signal
import subprocess
import sys
import textwrap
import warnings
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


# What the suite spends on processes, printed at its end (pytest_terminal_summary).
_COST = {"worlds": None, "jobs": 0, "ranks": 0, "python": 0, "other": 0, "job_seconds": 0.0}
# The same, per test file: seconds of its tests, and the processes its tests started.
_BY_FILE = {}
_LAUNCHERS = ("mpiexec", "mpirun", "srun", "orterun", "prterun")


def _count_processes(event, args):
    """Counts every process this test process starts (an audit hook: nothing is patched)."""
    if event != "subprocess.Popen":
        return
    argv = [str(a) for a in (args[1] if isinstance(args[1], (list, tuple)) else [args[1]])]
    program = os.path.basename(argv[0]) if argv else ""
    own = _file_cost(_CURRENT["file"])
    if program in _LAUNCHERS and "-n" in argv:
        kind = "jobs"
        try:
            ranks = int(argv[argv.index("-n") + 1])
        except (IndexError, ValueError):
            ranks = 0
        _COST["ranks"] += ranks
        own["ranks"] += ranks
    elif program.startswith("python") or (argv and argv[0] == sys.executable):
        kind = "python"
    else:
        kind = "other"
    _COST[kind] += 1
    own[kind] += 1


def _file_cost(path):
    name = os.path.relpath(path, os.path.dirname(HERE)) if path else "(collection)"
    if name not in _BY_FILE:
        _BY_FILE[name] = {"seconds": 0.0, "tests": 0, "jobs": 0, "ranks": 0, "python": 0,
                          "other": 0, "scripts": 0}
    return _BY_FILE[name]


sys.addaudithook(_count_processes)


# The slow tests of this run and the seconds they took (setup, call and teardown).
_SLOW = {"ids": set(), "seconds": 0.0, "ran": set()}


def pytest_runtest_logreport(report):
    own = _file_cost(os.path.join(os.path.dirname(HERE), report.nodeid.split("::")[0]))
    own["seconds"] += report.duration
    own["tests"] += report.when == "call"
    if report.nodeid in _SLOW["ids"] and not report.skipped:
        _SLOW["seconds"] += report.duration
        _SLOW["ran"].add(report.nodeid)


def _own_record():
    """What this process counted, as JSON: under pytest-xdist each worker hands its own
    to the controller, which adds them up (pytest_testnodedown)."""
    worlds = _COST["worlds"]
    return {
        "files": _BY_FILE,
        "total": {k: v for k, v in _COST.items() if k != "worlds"},
        "worlds": {"started": [list(s) for s in worlds.started] if worlds else [],
                   "scripts": worlds.jobs if worlds else 0,
                   "start_cpu": list(worlds.start_cpu) if worlds else []},
        "slow": {"ran": sorted(_SLOW["ran"]), "seconds": _SLOW["seconds"]},
        "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "frozen": gc.get_freeze_count(),
    }


# The records of pytest-xdist's workers, as each ends.
_WORKER_RECORDS = []


def pytest_sessionfinish(session):
    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput["kdist_cost"] = json.dumps(_own_record())


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    record = getattr(node, "workeroutput", {}).get("kdist_cost")
    if record:
        _WORKER_RECORDS.append(json.loads(record))


def _suite_record():
    """This run's cost: this process's, or, under pytest-xdist, the workers' processes
    and worlds with the seconds the controller saw for each file."""
    record = _own_record()
    if not _WORKER_RECORDS:
        return record
    for worker in _WORKER_RECORDS:
        for name, theirs in worker["files"].items():
            own = _file_cost(os.path.join(os.path.dirname(HERE), name))
            for key in ("jobs", "ranks", "python", "other", "scripts"):
                own[key] += theirs[key]
        for key in ("jobs", "ranks", "python", "other"):
            record["total"][key] += worker["total"][key]
        for key in ("started", "start_cpu"):
            record["worlds"][key] += worker["worlds"][key]
        record["worlds"]["scripts"] += worker["worlds"]["scripts"]
        record["slow"]["ran"] += worker["slow"]["ran"]
        record["slow"]["seconds"] += worker["slow"]["seconds"]
        record["peak_mb"] = max(record["peak_mb"], worker["peak_mb"])
        record["frozen"] = max(record["frozen"], worker["frozen"])
    record["workers"] = len(_WORKER_RECORDS)
    return record


def pytest_terminal_summary(terminalreporter):
    """The suite's own cost: processes started, ranks, and the seconds spent starting
    shared worlds, so that a change that adds jobs shows here; and the slow tests' own
    time when they ran (--slow)."""
    record = _suite_record()
    slow = record["slow"]
    if slow["ran"]:
        terminalreporter.section("slow tests")
        terminalreporter.write_line(f"{len(slow['ran'])} slow tests ran in "
                                    f"{slow['seconds']:.0f} s")
    total, worlds = record["total"], record["worlds"]
    started = worlds["started"]
    launched = [s for s in started if s[1]]
    world_ranks = sum(size for size, _, _ in launched)
    jobs, ranks = total["jobs"] - len(launched), total["ranks"] - world_ranks
    python = total["python"] - (len(started) - len(launched))
    write = terminalreporter.write_line
    terminalreporter.section("kdist suite cost")
    if record.get("workers"):
        write(f"{record['workers']} pytest-xdist workers, each with worlds of its own")
    write(f"shared worlds: {len(started)} started ({world_ranks} ranks under mpiexec, "
          f"{len(started) - len(launched)} single processes), "
          f"{sum(s for _, _, s in started):.0f} s starting them, "
          f"{worlds['scripts']} scripts run on them")
    write(f"jobs of their own: {jobs} mpiexec or srun jobs with {ranks} ranks in all; "
          f"{python} other Python processes; {total['other']} other commands")
    cpu = worlds["start_cpu"]
    write(f"processes started in all: {world_ranks + ranks + python + len(started) - len(launched)}"
          f" Python ranks and processes, each of which imports TensorFlow before its first "
          f"test line" + (f" (about {sum(cpu) / len(cpu):.1f} s of CPU, as the worlds "
                          f"measured)" if cpu else ""))
    write(f"the test process{'es' if record.get('workers') else ''}: "
          f"{record['peak_mb']:.0f} MB at the peak, {record['frozen']} objects kept out "
          f"of the collector's sight")
    costly = sorted(_BY_FILE.items(), key=lambda item: -item[1]["seconds"])[:COSTLY_FILES]
    write(f"the {len(costly)} costliest files (seconds; scripts run on shared worlds; "
          "launcher jobs and their ranks, shared worlds included where a file started one):")
    for name, own in costly:
        write(f"  {own['seconds']:7.0f} s  {own['scripts']:3d} scripts {own['jobs']:3d} jobs "
              f"{own['ranks']:4d} ranks  {own['python']:3d} python  {name}")
    path = terminalreporter.config.getoption(COST_OPTION)
    if path:
        with open(path, "w") as f:
            json.dump({"files": _BY_FILE, "total": total}, f, indent=1)
        write(f"per-file cost written to {path}")


COSTLY_FILES = 8
COST_OPTION = "--suite-cost"


WITHOUT_MPI = "KDIST_TEST_WITHOUT_MPI"


def _without_mpi_asked():
    return os.environ.get(WITHOUT_MPI, "").strip().lower() not in ("", "0", "false", "no",
                                                                   "off")


SLOW_OPTION = "--slow"


def pytest_addoption(parser):
    parser.addoption(
        COST_OPTION, metavar="PATH",
        help="write every test file's seconds and the processes its tests started to PATH "
             "(JSON), beside the summary's costliest files")
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


# The files that take longest (`--suite-cost`, one process), longest first. Run first,
# they leave short files for the end, so that pytest-xdist's workers (README's `-n 2`,
# one file to a worker at a time) end together instead of one waiting for the other.
LONGEST_FILES = ("test_docs_examples.py", "test_hosts.py", "test_tune_distributed.py",
                 "test_examples.py", "test_ps.py", "test_elastic.py", "test_tune.py",
                 "test_pbt.py", "test_no_hang.py", "test_sparsity.py", "test_benchmarks.py",
                 "test_gan_calorimeter.py", "test_ring.py", "test_robustness.py")


def _costliest_first(item):
    name = item.path.name
    return LONGEST_FILES.index(name) if name in LONGEST_FILES else len(LONGEST_FILES)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """Refuses to run a selection that holds multi-process tests when MPI is missing:
    skipping them would leave a green run that tested none of the distributed behaviour.
    `KDIST_TEST_WITHOUT_MPI=1` skips them knowingly instead."""
    items.sort(key=_costliest_first)
    _SLOW["ids"] = {item.nodeid for item in items if item.get_closest_marker("slow")}
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


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """After each test, moves what is still alive out of the garbage collector's sight,
    as pytest_collection_finish does for the imports. Every `gc.collect()` (Keras's
    `clear_session`, keras-tuner's every trial) otherwise walks all that earlier tests
    left reachable (caches of TensorFlow and Keras): a tuning test that takes 4 s alone
    took 12 s after the sparsity tests and 22 s at its place in the suite."""
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
def mpirun(mpiexec_path, tmp_path, worlds):
    """Runs a Python script on every rank of a shared world of N ranks; collects reports.

    `script` is a path under tests/workers/ or a string of code. It runs as
    `python script args` would, on ranks that ran earlier tests' scripts (see
    shared_world.py): each rank may call `workers.common.report(obj)` to hand a JSON
    object back (`result.results[rank]`). The test fails, naming every rank whose
    script failed with its traceback, unless `check=False`. A job that outlives
    `timeout` has every rank's stack written out and its world ended, so a hang can
    never stall CI. Tests whose subject is the process use `mpi_job` instead.
    """

    def run(script, n=2, args=(), timeout=180, check=True, env=None, **fresh_only):
        if fresh_only:
            raise TypeError(f"mpirun runs on a shared world and takes no "
                            f"{', '.join(sorted(fresh_only))}; a test whose subject is the "
                            "process (faults, hosts, launcher arguments) uses mpi_job")
        script = _script_path(script, tmp_path)
        report_dir = _report_dir(tmp_path, script, args)
        environ = _job_environment(report_dir, env)
        outcome = _shared_job(worlds, n, script, args=args, environ=environ,
                              timeout=timeout)
        result = MPIResult(outcome.returncode, outcome.output, _read_reports(report_dir))
        if check and outcome.returncode != 0:
            pytest.fail(f"the script failed on a shared world of {n} ranks:\n"
                        f"{outcome.report()}", pytrace=False)
        return result

    return run


# The test that runs now (pytest_runtest_setup): a world that hangs ends its file's turn.
_CURRENT = {"file": None, "test": None}


def pytest_runtest_setup(item):
    _CURRENT.update(file=str(item.path), test=item.nodeid)


def _shared_job(worlds, n, script, launcher=True, **job):
    """Runs a job on the shared world of `n`; a test of a file whose world hung is not run."""
    test_file = _CURRENT["file"]
    _file_cost(test_file)["scripts"] += 1
    outcome = worlds.run(test_file, _CURRENT["test"], n, script, launcher=launcher, **job)
    if outcome is not None:
        for note in outcome.notes:
            warnings.warn(note)
    if outcome is None:
        pytest.skip(f"not run: the shared world hung in {worlds.hung_in[test_file]}, and "
                    "the rest of its file is not run (its report says where it hung)")
    return outcome


def _script_path(script, tmp_path):
    if "\n" in script or not str(script).endswith(".py"):
        path = tmp_path / f"script_{abs(hash(script))}.py"
        path.write_text(textwrap.dedent(script))
        return str(path)
    if not os.path.isabs(script):
        return os.path.join(WORKERS, script)
    return str(script)


def _report_dir(tmp_path, script, args):
    report_dir = tmp_path / f"reports_{abs(hash((script, tuple(str(a) for a in args))))}"
    report_dir.mkdir(exist_ok=True)
    return report_dir


# What every rank of the tests' jobs sees, shared world or not.
RANK_SETTINGS = {
    "TF_CPP_MIN_LOG_LEVEL": "3",
    "PYTHONUNBUFFERED": "1",
    # A rank that crashes in native code prints every thread's Python stack.
    "PYTHONFAULTHANDLER": "1",
}


def _rank_environment():
    return dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]),
                **RANK_SETTINGS)


def _job_environment(report_dir, env=None):
    environ = _rank_environment()
    environ["KDIST_TEST_REPORTS"] = str(report_dir)
    environ.update(env or {})
    return environ


@pytest.fixture(scope="session")
def worlds():
    """The session's shared worlds (shared_world.Worlds), ended when the session ends."""
    import shared_world

    manager = shared_world.Worlds(_rank_environment(), mpiexec=_mpiexec())
    _COST["worlds"] = manager
    yield manager
    manager.stop_all()


@pytest.fixture
def mpi_job(mpiexec_path, tmp_path):
    """Runs a Python script as a job of its own on N ranks, with a hard timeout.

    For tests whose subject is the process itself (kills, signals, exits, early leavers,
    deadlocks, elastic shrink and grow, emulated hosts, launchers, settings read at
    import); every other multi-rank test uses `mpirun`, whose ranks are shared. Such a
    test says in its docstring why it needs a job of its own.

    `script` is a path under tests/workers/ or a string of code. Each rank may
    call `workers.common.report(obj)` to hand a JSON object back; the test
    gets them as `result.results[rank]`. A job that outlives `timeout` is
    killed and the test fails with its output, so a hang can never stall CI.
    """
    from kdist.cli import mpiexec_command

    def run(script, n=2, args=(), timeout=180, check=True, env=None, fault_tolerant=False,
            mpi_args=(), hosts=None, kdist_run=False, elastic=False):
        """`hosts`: spread the `n` ranks evenly over that many emulated hosts (see
        tests/emulated_hosts.py), launched from the first as on a cluster. `kdist_run`:
        start the job with `kdist run` (its rank wrapper and its verdict) instead of
        the launcher itself; `elastic`: with `kdist run --elastic`."""
        if elastic and not kdist_run:
            raise TypeError("elastic=True runs the job with kdist run --elastic: pass "
                            "kdist_run=True too (fault_tolerant=True for a plain launcher)")
        fault_tolerant = "elastic" if elastic else fault_tolerant
        if hosts is not None:
            import emulated_hosts

            why_not = emulated_hosts.available()
            if why_not:
                pytest.skip(why_not)
            if n % hosts:
                raise ValueError(f"{n} ranks do not spread evenly over {hosts} hosts")
            with emulated_hosts.EmulatedHosts(hosts) as machines:
                return _run(script, n, args, timeout, check, env, fault_tolerant, mpi_args,
                            machines, kdist_run)
        return _run(script, n, args, timeout, check, env, fault_tolerant, mpi_args, None,
                    kdist_run)

    def _run(script, n, args, timeout, check, env, fault_tolerant, mpi_args, machines,
             kdist_run):
        script = _script_path(script, tmp_path)
        report_dir = _report_dir(tmp_path, script, args)
        command = [sys.executable, "-u", script] + [str(a) for a in args]
        settings = dict(RANK_SETTINGS, KDIST_TEST_REPORTS=str(report_dir),
                        PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
        settings.update(env or {})
        if machines is not None:
            # So that a worker can pull its own host's cable (see emulated_hosts.set_link).
            settings.update({"KDIST_TEST_SWITCH": f"{machines.prefix}sw",
                             "KDIST_TEST_HOSTS": machines.prefix})
            # Open MPI gives ranks on other hosts only the variables it is told to.
            mpi_args = machines.mpi_args(n // machines.count, forward=sorted(settings)) + list(
                mpi_args)
        if kdist_run:
            argv = [sys.executable, "-m", "kdist.cli", "run", "-n", str(n), "--mpi-args",
                    shlex.join(str(a) for a in mpi_args)]
            argv += ({"elastic": ["--elastic"], True: ["--fault-tolerant"]}.get(
                fault_tolerant, [])) + ["--"] + command
            full_env = dict(os.environ)
        else:
            argv, full_env = mpiexec_command(n, command, mpiexec=mpiexec_path,
                                             extra=mpi_args, fault_tolerant=fault_tolerant)
        full_env.update(settings)
        if machines is not None:
            argv = machines.on_first_host(argv)
        returncode, output, timed_out = _run_job(
            argv, full_env, timeout, machines.kill_processes if machines else None)
        if timed_out:
            import shared_world

            reported = sorted(p.name for p in report_dir.iterdir())
            pytest.fail(f"mpiexec job did not finish within {timeout} s (every rank's stack "
                        f"is below); reports written: {reported}\n"
                        f"{shared_world.quiet(output)[-8000:]}", pytrace=False)
        result = MPIResult(returncode, output, _read_reports(report_dir))
        if check and returncode != 0:
            pytest.fail(f"mpiexec job failed with exit code {returncode}:\n"
                        f"{output[-6000:]}", pytrace=False)
        return result

    return run


def _run_job(argv, env, timeout, kill_elsewhere=None):
    """Runs a job of its own: `(exit code, output, timed out)`.

    On `timeout` the launcher gets SIGUSR1 first, which Open MPI's and MPICH's launchers
    pass on to every rank, and on which every rank the tests start writes each thread's
    Python stack (sitecustomize.py); then the job is ended, with `kill_elsewhere()` for
    what runs outside the launcher's process group (daemons on emulated hosts).
    """
    process = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
        return process.returncode, output, False
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGUSR1)
        try:
            output, _ = process.communicate(timeout=3)
        except subprocess.TimeoutExpired:
            # The launcher may have ended while what it left behind holds the output open.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            if kill_elsewhere is not None:
                kill_elsewhere()
            output, _ = process.communicate()
        return process.returncode, output, True


@pytest.fixture(scope="session")
def python_script(tmp_path_factory, worlds):
    """Runs a script as `python script args` would, without an MPI launcher: on the
    shared world of one process that has none. Returns an `MPIResult` (rank 0's report,
    if it wrote one); fails the test unless `check=False`."""

    def run(script, args=(), timeout=180, check=True, env=None, cwd=None):
        report_dir = tmp_path_factory.mktemp("single")
        path = script if os.path.isabs(script) else os.path.join(WORKERS, script)
        outcome = _shared_job(worlds, 1, path, launcher=False, args=args,
                              environ=_job_environment(report_dir, env), timeout=timeout,
                              cwd=cwd)
        if check and outcome.returncode != 0:
            pytest.fail(f"{script} failed:\n{outcome.report()}", pytrace=False)
        return MPIResult(outcome.returncode, outcome.output, _read_reports(report_dir))

    return run


@pytest.fixture(scope="session")
def python_run(python_script):
    """Rank 0's report of a worker script run as one process without a launcher.

    The workers are seeded, so a single-process reference is a function of the
    script and its arguments: a run asked for again is answered from the first.
    """
    answered = {}

    def run(script, args=(), timeout=180):
        key = (script, tuple(str(a) for a in args))
        if key not in answered:
            answered[key] = json.dumps(python_script(script, args, timeout=timeout).rank(0))
        return json.loads(answered[key])

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
