"""kdist's C++ engine under AddressSanitizer and ThreadSanitizer, alone and inside TensorFlow.

    python benchmarks/sanitizers.py [--sanitizers address,thread] [--ranks 2,3,4]
        [--rounds 3] [--with-tensorflow] [--launches 1] [--keep DIR]

Two kinds of case, each printed as one JSON object:

A report counts as kdist's (`kdist_reports`) when a frame of kdist's sources is in an
AddressSanitizer error's stack, or on both sides of a ThreadSanitizer race.

- `engine`: tests/native/engine_test.cc (every collective of engine.h with exact
  values, the fusion queue fed from several threads, the ring, a watchdog-like
  reader and the timeline on threads of their own) compiled with the sanitizer and
  run under mpiexec on each number of ranks; a plain build runs first, as the control.
- `tensorflow` (with `--with-tensorflow`): kdist's TensorFlow ops built with the
  sanitizer (`KDIST_NATIVE_CXXFLAGS`) into a cache of their own, the sanitizer's
  runtime preloaded into Python, and the path that crashed in CI run on 4 ranks:
  MPIStrategy fit, evaluate and predict with uneven prediction batches
  (tests/workers/strategy.py).

Per case: `exit` (the job's status), `ok_ranks` (ranks that finished), `reports`
(sanitizer reports in all) and `kdist_reports`, the first kdist report's opening lines,
and the seconds it took.

Open MPI's UCX component intercepts memory calls (libucm) in a way ThreadSanitizer's
runtime cannot follow (a fault inside `ucm_madvise` as a thread ends), and PMIx's
shared-memory store wants a fixed address that TSan's layout takes; TSan cases therefore
run with UCX off (`pml=ob1`, `btl=self,sm`) and PMIx's hash store, which changes nothing
kdist does.
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NATIVE = os.path.join(ROOT, "kdist", "comm", "native")
ENGINE_TEST = os.path.join(ROOT, "tests", "native", "engine_test.cc")
SUPPRESSIONS = os.path.join(ROOT, "tests", "native", "lsan.supp")
STRATEGY_WORKER = os.path.join(ROOT, "tests", "workers", "strategy.py")
SOURCES = ("engine.cc", "fusion.cc", "ring.cc")
FLAGS = {"none": [], "address": ["-fsanitize=address", "-fno-omit-frame-pointer"],
         "thread": ["-fsanitize=thread"]}
RUNTIME = {"address": "libasan.so", "thread": "libtsan.so", "stdc++": "libstdc++.so"}
REPORT = re.compile(r"^(==\d+==ERROR: AddressSanitizer|==\d+==ERROR: LeakSanitizer|"
                    r"WARNING: ThreadSanitizer)", re.M)
THREAD_SANITIZER_MPI = {"OMPI_MCA_pml": "ob1", "OMPI_MCA_btl": "self,sm",
                        "OMPI_MCA_osc": "^ucx", "UCX_MEM_EVENTS": "no",
                        "PMIX_MCA_gds": "hash"}


def mpicxx():
    beside = os.path.join(os.path.dirname(sys.executable), "mpicxx")
    compiler = beside if os.access(beside, os.X_OK) else shutil.which("mpicxx")
    if compiler is None:
        sys.exit("sanitizers.py needs MPI's C++ compiler wrapper (mpicxx)")
    return compiler


def tensorflow_include():
    done = subprocess.run([sys.executable, "-c",
                           "import tensorflow as tf; print(tf.sysconfig.get_include())"],
                          capture_output=True, text=True, check=True,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    return done.stdout.strip().splitlines()[-1]


def build_engine_test(sanitizer, directory, include):
    binary = os.path.join(directory, f"engine_test_{sanitizer}")
    command = [mpicxx(), "-std=c++17", "-O1", "-g", "-w", *FLAGS[sanitizer], "-I", NATIVE,
               "-I", include, *[os.path.join(NATIVE, s) for s in SOURCES], ENGINE_TEST,
               "-o", binary]
    started = time.monotonic()
    subprocess.run(command, check=True, capture_output=True, text=True)
    return binary, time.monotonic() - started


def sanitizer_environment(sanitizer):
    env = {"ASAN_OPTIONS": "detect_leaks=1:abort_on_error=0:halt_on_error=0",
           "LSAN_OPTIONS": f"suppressions={SUPPRESSIONS}",
           "TSAN_OPTIONS": "halt_on_error=0:report_signal_unsafe=0:second_deadlock_stack=1"}
    if sanitizer == "thread":
        env.update(THREAD_SANITIZER_MPI)
    return env


def launch(ranks, command, env, timeout):
    from kdist.cli import mpiexec_command

    argv, full_env = mpiexec_command(ranks, command, extra=["--oversubscribe"] + [
        arg for name in sorted(env) for arg in ("-x", name)])
    full_env.update(env)
    started = time.monotonic()
    try:
        done = subprocess.run(argv, env=full_env, capture_output=True, text=True,
                              timeout=timeout)
        return done.returncode, done.stdout + done.stderr, time.monotonic() - started
    except subprocess.TimeoutExpired as error:
        out = (error.stdout or b"") + (error.stderr or b"")
        out = out.decode(errors="replace") if isinstance(out, bytes) else out
        return None, out, time.monotonic() - started


def _kdist_on_both_sides(report):
    """Whether a report is about kdist's code: an ASan error with a kdist frame in its
    stack, or a TSan race whose access and previous access both have one. A race with a
    kdist frame on one side only is TensorFlow handing kdist a tensor through
    synchronization TSan cannot see (TensorFlow is not built with it)."""
    ours = "/kdist/comm/native/"
    if "ThreadSanitizer" not in report.splitlines()[0]:
        return ours in report
    sections = report.split("\n\n")
    previous = [s for s in sections if s.lstrip().startswith("Previous")]
    return ours in sections[0] and bool(previous) and ours in previous[0]


def summarize(kind, sanitizer, ranks, code, output, seconds, verdict):
    reports = [m.start() for m in REPORT.finditer(output)]
    pieces = [output[start:(reports[i + 1] if i + 1 < len(reports) else len(output))]
              for i, start in enumerate(reports)]
    ours = [p for p in pieces if _kdist_on_both_sides(p)]
    first = ""
    if ours:
        first = "\n".join(line for line in ours[0].splitlines()[:14])
    return {"case": kind, "sanitizer": sanitizer, "ranks": ranks, "exit": code,
            "ok_ranks": len(re.findall(verdict, output)), "reports": len(pieces),
            "kdist_reports": len(ours), "first_kdist_report": first,
            "seconds": round(seconds, 1)}


def engine_cases(args, directory, include):
    for sanitizer in ["none"] + args.sanitizers:
        binary, built = build_engine_test(sanitizer, directory, include)
        for ranks in args.ranks:
            for launch_index in range(args.launches):
                code, output, seconds = launch(ranks, [binary, str(args.rounds)],
                                               sanitizer_environment(sanitizer), args.timeout)
                row = summarize("engine", sanitizer, ranks, code, output, seconds,
                                r"engine_test: ok rank")
                row["build_seconds"] = round(built, 1)
                row["runtime_linked"] = runtime_linked(binary, sanitizer)
                row["launch"] = launch_index
                keep_log(args.keep, f"engine-{sanitizer}-{ranks}-{launch_index}.log", output, row)
                yield row


def keep_log(directory, name, output, row):
    """Writes a launch's output into `directory` (when given) and names it in `row`."""
    if directory:
        path = os.path.join(directory, name)
        with open(path, "w") as f:
            f.write(output)
        row["log"] = path


def runtime_linked(binary, sanitizer):
    """Whether the binary loads the sanitizer's runtime (None for the plain build)."""
    if sanitizer == "none":
        return None
    done = subprocess.run(["ldd", binary], capture_output=True, text=True)
    return RUNTIME[sanitizer].split(".")[0] in done.stdout


def runtime_library(sanitizer):
    done = subprocess.run(["gcc", f"-print-file-name={RUNTIME[sanitizer]}"],
                          capture_output=True, text=True, check=True)
    path = done.stdout.strip()
    return os.path.realpath(path) if os.path.isabs(path) else None


def tensorflow_cases(args, directory):
    for sanitizer in args.sanitizers:
        library = runtime_library(sanitizer)
        if library is None:
            yield {"case": "tensorflow", "sanitizer": sanitizer,
                   "error": f"gcc has no {RUNTIME[sanitizer]}"}
            continue
        cache = os.path.join(directory, f"cache-{sanitizer}")
        env = sanitizer_environment(sanitizer)
        # Python does not load libstdc++ itself: preloaded too, AddressSanitizer can
        # intercept its exception throwing (TensorFlow's extensions throw and catch).
        preload = " ".join([library] + ([runtime_library("stdc++")] if sanitizer == "address"
                                         else []))
        env.update({"KDIST_CACHE": cache, "LD_PRELOAD": preload,
                    "KDIST_NATIVE_CXXFLAGS": " ".join(FLAGS[sanitizer] + ["-g"]),
                    "TF_CPP_MIN_LOG_LEVEL": "3", "KDIST_TEST_REPORTS": directory,
                    "PYTHONPATH": os.path.join(ROOT, "tests")})
        # Python and TensorFlow are not built with the sanitizer: their own
        # allocations would drown what is kdist's.
        env["ASAN_OPTIONS"] = env["ASAN_OPTIONS"].replace("detect_leaks=1", "detect_leaks=0")
        for launch_index in range(args.launches):
            code, output, seconds = launch(
                4, [sys.executable, "-u", STRATEGY_WORKER, "--strategy", "mpi"], env,
                args.timeout * 4)
            row = summarize("tensorflow", sanitizer, 4, code, output, seconds,
                            r"(?!x)x")  # the worker reports by file
            row["ok_ranks"] = len([n for n in os.listdir(directory)
                                   if n.startswith("rank-") and n.endswith(".json")])
            for name in os.listdir(directory):
                if name.startswith("rank-"):
                    os.remove(os.path.join(directory, name))
            row["native_library_built"] = os.path.isdir(os.path.join(cache, "ops")) and any(
                n.endswith(".so") for n in os.listdir(os.path.join(cache, "ops")))
            row["tail"] = "\n".join(output.strip().splitlines()[-6:]) if code else ""
            row["launch"] = launch_index
            keep_log(args.keep, f"tensorflow-{sanitizer}-{launch_index}.log", output, row)
            yield row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sanitizers", default="address,thread",
                        type=lambda s: [x for x in s.split(",") if x])
    parser.add_argument("--ranks", default="2,3,4", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--launches", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--with-tensorflow", action="store_true")
    parser.add_argument("--keep", help="write each job's whole output into this directory")
    args = parser.parse_args()
    unknown = set(args.sanitizers) - {"address", "thread"}
    if unknown:
        parser.error(f"unknown sanitizer(s) {sorted(unknown)}; choose address, thread")
    if args.keep:
        os.makedirs(args.keep, exist_ok=True)
    directory = tempfile.mkdtemp(prefix="kdist-sanitizers-")
    clean = True
    try:
        include = tensorflow_include()
        cases = list(engine_cases(args, directory, include))
        if args.with_tensorflow:
            cases += list(tensorflow_cases(args, directory))
        for row in cases:
            print(json.dumps(row), flush=True)
            clean = clean and row.get("exit") == 0 and row.get("kdist_reports", 1) == 0
        print(json.dumps({"summary": True, "cases": len(cases), "clean": clean}))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
