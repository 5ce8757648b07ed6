"""Worlds of ranks that many tests share: one launch, then script after script.

A `World` is one `mpiexec -n N` job of `world_rank.py` (or one plain process, for
references run without a launcher). Its ranks import TensorFlow once; each test's script
then runs on every rank in turn (see world_rank.py for what a rank puts back between
scripts). This is how Horovod and mpi4py run their suites (one launch per file, every
rank running every test), with three additions:

- every rank's verdict counts: a job's outcome names each rank that failed and carries
  its traceback and output;
- a job that outlives its timeout, or a rank that dies, never leaves the others waiting:
  every rank's Python stack is written to its output, the world is ended, and the
  outcome says so; `Worlds` then reports the rest of that test file as not run when the
  world hung (a hang tends to repeat, each costing a timeout), and starts a new world
  for the next test after a crash or a failure that ended it;
- the cost is counted: worlds started, ranks, the seconds they took to start.
"""

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RANK_SCRIPT = os.path.join(HERE, "world_rank.py")
LAUNCHER_PREFIXES = ("OMPI_", "PMIX_", "PMI_", "PRTE_", "HYDRA_")
# TensorFlow's start-up lines, which crowd out what a rank said.
NOISE = ("absl::InitializeLog", "cudart_stub", "cuda_platform.cc", "cpu_feature_guard",
         "To enable the following instructions", "oneDNN custom operations", "port.cc:153")


def quiet(text):
    """`text` without TensorFlow's start-up lines, each line ending with a newline."""
    return "".join(line + "\n" for line in text.splitlines()
                   if not any(n in line for n in NOISE))


@dataclasses.dataclass
class Outcome:
    """How a job ended on a world: per rank, and as a whole."""

    returncode: int  # 0 when every rank's script ended well, as a job's exit status
    output: str  # every rank's output, rank after rank
    failures: dict  # rank -> traceback (or what ended it) for every rank that failed
    ended_world: str = ""  # why the world had to be ended, when it had to be
    hung: bool = False
    notes: list = dataclasses.field(default_factory=list)

    def report(self):
        """What a failed test shows: each failing rank with its traceback, then outputs."""
        lines = []
        if self.ended_world:
            lines.append(f"the shared world was ended: {self.ended_world}")
        for rank, text in sorted(self.failures.items()):
            lines.append(f"--- rank {rank} failed ---\n{text.rstrip()}")
        lines.append("--- output, rank after rank ---\n" + self.output[-8000:])
        return "\n".join(lines)


class WorldEnded(Exception):
    """The world's launcher ended before a job could be handed to it."""


class World:
    """`size` ranks (under `mpiexec` when `launcher`) that run one script after another."""

    def __init__(self, size, environ, mpiexec=None, launcher=True, start_timeout=300):
        if launcher and mpiexec is None:
            raise ValueError("a world with a launcher needs the mpiexec to start it with")
        self.size, self.launcher = size, launcher
        self.control = tempfile.mkdtemp(prefix=f"kdist-world{size}-")
        self.log_path = os.path.join(self.control, "launcher.log")
        self.environ = dict(environ)
        self.jobs = 0
        self.started = time.monotonic()
        command = [sys.executable, "-u", RANK_SCRIPT, self.control]
        if launcher:
            from kdist.cli import mpiexec_command

            argv, env = mpiexec_command(size, command, mpiexec=mpiexec)
            env.update(self.environ)
        else:
            if size != 1:
                raise ValueError("a world without a launcher has one process")
            argv = command
            env = {k: v for k, v in self.environ.items() if not k.startswith(LAUNCHER_PREFIXES)}
        self.environ = env
        self._log = open(self.log_path, "w")
        # A session of its own: ending the world ends the launcher and every rank.
        self.process = subprocess.Popen(argv, env=env, stdout=self._log,
                                        stderr=subprocess.STDOUT, start_new_session=True)
        self.pids = {}
        self.ready = self._wait_until_ready(start_timeout)
        self.start_seconds = time.monotonic() - self.started

    # -- starting and ending -------------------------------------------------------------

    def _wait_until_ready(self, timeout):
        deadline = time.monotonic() + timeout
        ready = {}
        while len(ready) < self.size:
            for rank in range(self.size):
                path = os.path.join(self.control, f"ready-{rank}.json")
                if rank not in ready and os.path.exists(path):
                    with open(path) as f:
                        ready[rank] = json.load(f)
                    self.pids[rank] = ready[rank]["pid"]
            if len(ready) == self.size:
                break
            if self.process.poll() is not None:
                raise WorldEnded(f"the world of {self.size} ended while starting "
                                 f"(exit code {self.process.returncode}):\n{self.launcher_log()}")
            if time.monotonic() > deadline:
                self.end("it did not start")
                raise WorldEnded(f"the world of {self.size} did not start within {timeout} s:\n"
                                 f"{self.launcher_log()}")
            time.sleep(0.02)
        return ready

    def alive(self):
        return self.process.poll() is None

    def launcher_log(self):
        if not self._log.closed:
            self._log.flush()
        with open(self.log_path, errors="replace") as f:
            return quiet(f.read())[-6000:]

    def dump_stacks(self):
        """Asks every rank to write each thread's Python stack into its job's output."""
        for pid in self.pids.values():
            try:
                os.kill(pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass

    def end(self, why=""):
        """Ends the launcher and every rank now."""
        if self.alive():
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
                self.process.wait(10)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        if self.alive():
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait()
        for pid in self.pids.values():  # a rank the launcher left behind
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._log.close()

    def stop(self, timeout=30):
        """Ends the world as a job ends: every rank leaves its loop and exits."""
        if self.alive():
            self._hand_over({"stop": True})
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        self.end()
        shutil.rmtree(self.control, ignore_errors=True)

    # -- jobs ----------------------------------------------------------------------------

    def _hand_over(self, job):
        path = os.path.join(self.control, f"job-{self.jobs}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(job, f)
        os.replace(path + ".tmp", path)
        self.jobs += 1
        return self.jobs - 1

    def run(self, script, args=(), environ=None, cwd=None, timeout=180):
        """Runs `script` with `args` on every rank; returns its `Outcome`.

        `environ` is the whole environment the script should see, as a job of its own
        would get it; the ranks are handed only what differs from the world's own.
        """
        if not self.alive():
            raise WorldEnded(f"the world of {self.size} has ended:\n{self.launcher_log()}")
        changes = _differences(self.environ, environ or self.environ)
        index = self._hand_over({"n": self.size, "script": str(script),
                                 "args": [str(a) for a in args], "environment": changes,
                                 "cwd": str(cwd or os.getcwd())})
        return self._collect(index, timeout)

    def _file(self, kind, index, rank, ext="json"):
        return os.path.join(self.control, f"{kind}-{index}-{rank}.{ext}")

    def _collect(self, index, timeout):
        deadline = time.monotonic() + timeout
        done, results, first_failure = {}, {}, None
        ended, hung = "", False
        while len(done) < self.size:
            for rank in range(self.size):
                if rank not in results and os.path.exists(self._file("result", index, rank)):
                    results[rank] = _read(self._file("result", index, rank))
                    if results[rank]["status"] != "ok" and first_failure is None:
                        first_failure = time.monotonic()
                if rank not in done and os.path.exists(self._file("done", index, rank)):
                    done[rank] = _read(self._file("done", index, rank))
            if len(done) == self.size:
                break
            if not self.alive():
                ended = (f"its launcher ended with exit code {self.process.returncode} while "
                         f"rank(s) {sorted(set(range(self.size)) - set(done))} ran the script")
                break
            now = time.monotonic()
            if now > deadline:
                hung = True
                ended = (f"the script did not end on rank(s) "
                         f"{sorted(set(range(self.size)) - set(results))} within {timeout} s "
                         "(each rank's stack is in its output)")
            elif first_failure is not None and now > first_failure + FAILURE_GRACE_SECONDS:
                ended = (f"rank(s) {sorted(r for r, v in results.items() if v['status'] != 'ok')}"
                         f" failed and rank(s) {sorted(set(range(self.size)) - set(done))} did not"
                         f" end within {FAILURE_GRACE_SECONDS:g} s after (each rank's stack is in "
                         "its output)")
            if ended:
                self.dump_stacks()
                time.sleep(1.0)
                self.end(ended)
                break
            time.sleep(0.01)
        failures = {}
        for rank in range(self.size):
            result = results.get(rank)
            if result is None:
                failures[rank] = "did not finish the script"
            elif result["status"] != "ok":
                failures[rank] = result["traceback"]
        outputs = []
        for rank in range(self.size):
            path = self._file("out", index, rank, "txt")
            text = ""
            if os.path.exists(path):
                with open(path, errors="replace") as f:
                    text = quiet(f.read())
            outputs.append(text)
        output = "".join(outputs)
        if ended:
            output += "\n--- launcher ---\n" + self.launcher_log()
        untidy = {r: d["untidy"] for r, d in done.items() if d.get("untidy")}
        threads = {r: d["threads"] for r, d in done.items() if d.get("threads")}
        notes = [f"rank {r} was left with threads the script started: {', '.join(names)}; "
                 "the world is ended, as a process of its own would not have exited"
                 for r, names in sorted(threads.items())]
        if (untidy or threads) and not ended:
            # What one script left behind must not reach the next.
            ended = "it could not be put back as it was before the script" if untidy else ""
            self.end()
        for rank, steps in sorted(untidy.items()):
            failures[rank] = "putting the rank back after the script failed:\n" + "\n".join(steps)
        return Outcome(returncode=1 if failures or ended else 0, output=output,
                       failures=failures, ended_world=ended, hung=hung, notes=notes)


# How long the other ranks may go on after one rank's script failed before the world is
# ended: ranks that fail alike end within moments; one left waiting for a collective would
# otherwise wait until the job's timeout.
FAILURE_GRACE_SECONDS = 20.0


def is_scripts_own(path, folders, tests, keep=()):
    """Whether a module loaded from `path` is a script's own, to be forgotten after it:
    it lies in the tests' folder or one of the script's `folders`, and neither in an
    installed library nor in a package folder of `keep` (kdist's), wherever the checkout
    and its environment live (a clone under /tmp keeps its virtual environment there)."""
    if not path:
        return False
    path = os.path.realpath(path)
    parts = path.split(os.sep)
    if "site-packages" in parts or "dist-packages" in parts:
        return False
    if any(_inside(path, package) for package in keep):
        return False
    return any(_inside(path, folder) for folder in [tests, *folders] if folder)


def _inside(path, folder):
    return path.startswith(os.path.realpath(folder).rstrip(os.sep) + os.sep)


def _read(path):
    with open(path) as f:
        return json.load(f)


def _differences(base, wanted):
    """The variables to set (or, as None, to remove) to turn `base` into `wanted`."""
    changes = {k: v for k, v in wanted.items() if base.get(k) != v}
    changes.update({k: None for k in base if k not in wanted
                    and not k.startswith(LAUNCHER_PREFIXES)})
    return changes


class Worlds:
    """The session's worlds, one per size, started when a test first asks for that size.

    Keeps at most `max_ranks` ranks alive (the least recently used world ends first), and
    remembers which test file a world hung in, so that the rest of that file is reported
    as not run instead of waiting out a timeout per test.
    """

    def __init__(self, environ, mpiexec=None, max_ranks=12):
        self.environ, self.mpiexec, self.max_ranks = dict(environ), mpiexec, max_ranks
        self._worlds = {}  # (size, launcher) -> World, least recently used first
        self.hung_in = {}  # test file -> the test whose job hung there
        self.started = []  # (size, launcher, seconds to start) of every world started
        self.start_cpu = []  # CPU seconds each rank spent before it was ready
        self.jobs = 0

    def get(self, size, launcher=True):
        key = (size, launcher)
        world = self._worlds.pop(key, None)
        if world is not None and not world.alive():
            world.end()
            world = None
        if world is None:
            self._make_room(size)
            world = World(size, self.environ, mpiexec=self.mpiexec, launcher=launcher)
            self.started.append((size, launcher, world.start_seconds))
            self.start_cpu += [r["cpu"] for r in world.ready.values()]
        self._worlds[key] = world
        return world

    def _make_room(self, size):
        while self._worlds and sum(w.size for w in self._worlds.values()) + size > self.max_ranks:
            oldest = next(iter(self._worlds))
            self._worlds.pop(oldest).stop()

    def run(self, test_file, test_name, size, script, launcher=True, **job):
        """Runs a job on the world of `size`; the `Outcome`, or None when the world hung
        earlier in `test_file` (then the caller reports this test as not run)."""
        if test_file in self.hung_in:
            return None
        world = self.get(size, launcher)
        self.jobs += 1
        outcome = world.run(script, **job)
        if outcome.ended_world or not world.alive():
            self._worlds.pop((size, launcher), None)
            if outcome.hung:
                self.hung_in[test_file] = test_name
        return outcome

    def mean_start_cpu(self):
        return sum(self.start_cpu) / len(self.start_cpu) if self.start_cpu else float("nan")

    def stop_all(self):
        for world in self._worlds.values():
            world.stop()
        self._worlds.clear()
