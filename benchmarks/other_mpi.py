"""The core of the MPI test tier under another MPI library than the Open MPI wheel.

    python benchmarks/other_mpi.py [--wheel mpich] [--venv DIR] [--tests NODEID ...]

Makes (once) a virtual environment at `--venv` (default `~/.cache/kdist/mpi-<wheel>`)
that sees this environment's packages (TensorFlow, kdist, mpi4py) through a `.pth`
file and has only the MPI wheel `--wheel` (`mpich`; `impi-rt` for Intel MPI's runtime)
installed itself. mpi4py's wheel loads the MPI library of the environment whose Python
runs it, so that environment's Python, its `mpiexec` and its `mpicxx` (kdist's C++ ops
are built with it) all belong to the other MPI. It then runs the test suite's core
multi-process tests with that Python: collectives, `DistributedOptimizer` and
`MPIStrategy` against one process, README's quickstart, a parameter-server fit and a
distributed search, and `kdist run` with `kdist info`.

Prints one JSON object: the MPI library, then each test's outcome.
Installing the wheel needs the package index; nothing else does.
"""

import argparse
import json
import os
import subprocess
import sys
import sysconfig
import xml.etree.ElementTree as ElementTree

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CORE_TESTS = [
    "tests/test_comm.py::test_collectives_on_real_ranks",
    "tests/test_data_parallel.py::test_two_ranks_match_one_process_on_the_global_batch",
    "tests/test_mpi_strategy.py::test_mirrored_script_under_mpiexec_matches_one_process",
    "tests/test_examples.py::test_quickstart_under_kdist_run_trains_and_prints_cleanly",
    "tests/test_examples.py::test_parameter_server_example_learns_and_saves_the_central_model",
    "tests/test_tune_distributed.py::test_a_stock_tuner_trains_each_trial_data_parallel",
    "tests/test_cli.py::test_run_prefixes_each_rank_and_reports_info",
    "tests/test_tf2_core.py::test_separate_allreduces_in_a_function_are_fused_and_reduce_correctly",
]


def make_environment(venv, wheel):
    python = os.path.join(venv, "bin", "python")
    if not os.path.exists(python):
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
        subprocess.run([sys.executable, "-m", "pip", "--python", python, "install", "--quiet",
                        wheel], check=True)
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()"
                           "['purelib'])"], check=True, capture_output=True,
                          text=True).stdout.strip()
    with open(os.path.join(site, "kdist-parent.pth"), "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")
    return python


def outcomes(junit_path):
    tree = ElementTree.parse(junit_path)
    result = {}
    for case in tree.iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        state = "passed"
        for tag in ("failure", "error", "skipped"):
            element = case.find(tag)
            if element is not None:
                state = tag if tag == "skipped" else "failed"
                message = (element.get("message") or "").splitlines()
                if message:
                    state = f"{state}: {message[0][:200]}"
        result[name] = state
    return result


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--wheel", default="mpich")
    parser.add_argument("--venv", default=None)
    parser.add_argument("--tests", nargs="*", default=CORE_TESTS)
    args = parser.parse_args()
    venv = args.venv or os.path.join(os.path.expanduser("~"), ".cache", "kdist",
                                     f"mpi-{args.wheel}")
    python = make_environment(venv, args.wheel)
    library = subprocess.run([python, "-c", "from mpi4py import MPI; "
                              "print(MPI.Get_library_version().splitlines()[0])"],
                             capture_output=True, text=True).stdout.strip()
    junit = os.path.join(venv, "junit.xml")
    env = dict(os.environ, PATH=os.path.join(venv, "bin") + os.pathsep + os.environ["PATH"],
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           f"--junitxml={junit}", *args.tests], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    print(json.dumps({"wheel": args.wheel, "library": library,
                      "pytest_exit": done.returncode, "tests": outcomes(junit)}, indent=1))
    return 0 if done.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
