"""Launch one multi-rank job many times, with load beside it, and count how each ended.

    python benchmarks/stress.py [--ranks 4] [--launches 50] [--load 2] [--timeout 300]
        [--keep DIR] [-- SCRIPT ARGS...]

By default the job is the one whose rank once died with SIGSEGV in CI:
`tests/workers/strategy.py --strategy mpi` (MPIStrategy's fit, evaluate and predict,
the last with prediction batches that do not split evenly over 4 ranks). Each launch is a
fresh `mpiexec` job; `--load` processes spin on the CPU for the whole run, so that ranks
are preempted at arbitrary points, as on a loaded CI machine. Every rank runs with
Python's faulthandler on and kdist's native backtrace (both write to the job's output).

Prints one JSON object per launch (exit status, seconds, the signal if a rank died of
one), then a summary: launches, how many ended well, failed, hung (killed at
`--timeout`) or crashed, and, with `--keep`, where each bad launch's output is.
"""

import argparse
import json
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT = [os.path.join(ROOT, "tests", "workers", "strategy.py"), "--strategy", "mpi"]
SIGNAL = re.compile(r"exited on\s+signal (\d+)")


def spin(stop):
    while not stop.is_set():
        sum(i * i for i in range(10000))


def launch(ranks, command, timeout, reports):
    from kdist.cli import mpiexec_command

    argv, env = mpiexec_command(ranks, [sys.executable, "-u", *command])
    env.update({"PYTHONFAULTHANDLER": "1", "TF_CPP_MIN_LOG_LEVEL": "3",
                "KDIST_TEST_REPORTS": reports, "PYTHONUNBUFFERED": "1",
                "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "tests"),
                                               env.get("PYTHONPATH", "")])})
    started = time.monotonic()
    try:
        done = subprocess.run(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=timeout)
        return done.returncode, done.stdout, time.monotonic() - started
    except subprocess.TimeoutExpired as error:
        out = error.stdout or ""
        return None, out if isinstance(out, str) else out.decode(errors="replace"), timeout


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--launches", type=int, default=50)
    parser.add_argument("--load", type=int, default=2, help="processes spinning beside it")
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--keep", help="write each bad launch's output into this directory")
    parser.add_argument("command", nargs="*", help="script and arguments (after --)")
    args = parser.parse_args()
    command = args.command or DEFAULT
    if args.keep:
        os.makedirs(args.keep, exist_ok=True)
    stop = multiprocessing.Event()
    spinners = [multiprocessing.Process(target=spin, args=(stop,), daemon=True)
                for _ in range(args.load)]
    for spinner in spinners:
        spinner.start()
    counts = {"ok": 0, "failed": 0, "hung": 0, "crashed": 0}
    kept = []
    try:
        for index in range(args.launches):
            with tempfile.TemporaryDirectory(prefix="kdist-stress-") as reports:
                code, output, seconds = launch(args.ranks, command, args.timeout, reports)
            died = SIGNAL.search(output)
            kind = ("hung" if code is None else "ok" if code == 0 else
                    "crashed" if died or (code or 0) < 0 or code >= 128 else "failed")
            counts[kind] += 1
            row = {"launch": index, "outcome": kind, "exit": code, "seconds": round(seconds, 1),
                   "signal": int(died.group(1)) if died else None}
            if kind != "ok" and args.keep:
                path = os.path.join(args.keep, f"launch-{index}-{kind}.log")
                with open(path, "w") as f:
                    f.write(output)
                row["log"] = path
                kept.append(path)
            print(json.dumps(row), flush=True)
    finally:
        stop.set()
        for spinner in spinners:
            spinner.join(5)
    print(json.dumps({"summary": True, "command": command, "ranks": args.ranks,
                      "load": args.load, "launches": args.launches, **counts, "logs": kept}))
    return 0 if counts["ok"] == args.launches else 1


if __name__ == "__main__":
    sys.exit(main())
