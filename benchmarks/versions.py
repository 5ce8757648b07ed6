"""Which TensorFlow and Keras versions kdist works with: fresh environments, one core subset.

    python benchmarks/versions.py [--tensorflow 2.20.0,2.21.0] [--keras newest]
        [--keras-tuner newest] [--venvs ~/.cache/kdist/versions] [--reuse]

For each TensorFlow version it makes a virtual environment (under `--venvs`), installs
that TensorFlow, the Keras and keras-tuner asked for (`newest`: the newest the package
index offers that pip can install beside it) and kdist from this checkout with the
requirements of its MPI, tuning, tfmot and examples extras (kdist itself without them, so
that a TensorFlow outside kdist's declared range is tested too), then runs the core
subset of the suite there, with kdist's compiled ops built afresh for that TensorFlow
(`KDIST_CACHE` inside the environment). The subset, one test per feature:

- collectives: every collective on real ranks;
- optimizer: `DistributedOptimizer` on two ranks equals one process on the global batch;
- strategy: a `MirroredStrategy` script under `mpiexec` (`MPIStrategy`) equals one process;
- xla: `jit_compile=True` with kdist's collectives lowered into the compiled step;
- saving: optimizer state saved and loaded, training resumed exactly;
- tfmot: tfmot's pruning and quantization guides with the import changed to kdist;
- search: a stock keras-tuner tuner whose trials train data parallel.

Prints one JSON object per environment (the versions installed, each feature's outcome
and, for a feature that did not pass, the end of its pytest output), then a Markdown
table of them. Exits 1 when any feature failed. Needs the
package index (or a local mirror pip is configured for); each environment takes a few
minutes to install and ten or so to test.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FEATURES = {
    "collectives": ["tests/test_comm.py::test_collectives_on_real_ranks"],
    "optimizer": ["tests/test_data_parallel.py::"
                  "test_two_ranks_match_one_process_on_the_global_batch"],
    "strategy": ["tests/test_mpi_strategy.py::"
                 "test_mirrored_script_under_mpiexec_matches_one_process"],
    "xla": ["tests/test_xla.py::"
            "test_distributed_optimizer_under_xla_matches_one_process_without_it"],
    "saving": ["tests/test_saving.py::"
               "test_optimizer_state_round_trips_and_training_resumes_exactly"],
    "tfmot": ["tests/test_tfmot.py::test_the_pruning_guide_runs_with_the_import_changed",
              "tests/test_tfmot.py::test_the_quantization_guide_runs_with_the_import_changed"],
    "search": ["tests/test_tune_distributed.py::"
               "test_a_stock_tuner_trains_each_trial_data_parallel"],
}
REPORTED = ("tensorflow", "keras", "keras-tuner", "tf_keras", "numpy", "mpi4py")


def requirement(name, version):
    return name if version == "newest" else f"{name}=={version}"


def kdist_requirements(extras=("mpi", "tune", "tfmot", "examples")):
    """kdist's own requirements from pyproject.toml, less TensorFlow, Keras, keras-tuner,
    tf_keras and TensorBoard, which this script chooses."""
    import re
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    wanted = list(project["dependencies"])
    for extra in extras:
        wanted += project["optional-dependencies"][extra]
    chosen = {"tensorflow", "keras", "keras-tuner", "tf-keras", "tf_keras", "tensorboard"}
    return sorted({r for r in wanted
                   if re.split(r"[<>=!~\[ ]", r, maxsplit=1)[0].lower() not in chosen})


def make_environment(path, tensorflow, keras, keras_tuner, reuse):
    """A virtual environment at `path` with the versions asked for and kdist; returns
    its Python."""
    python = os.path.join(path, "bin", "python")
    if reuse and os.path.exists(python):
        return python
    shutil.rmtree(path, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", path], check=True)
    minor = ".".join(tensorflow.split(".")[:2])
    # tf_keras and TensorBoard come in one minor version per TensorFlow minor.
    packages = [f"tensorflow=={tensorflow}", f"tf_keras=={minor}.*", f"tensorboard=={minor}.*",
                requirement("keras", keras), requirement("keras-tuner", keras_tuner),
                "pytest>=8", "pytest-timeout>=2.3", *kdist_requirements()]
    # --upgrade: "newest" means the newest pip can install beside that TensorFlow, not
    # whatever the first requirement happened to pull in.
    subprocess.run([python, "-m", "pip", "install", "-q", "--upgrade", *packages],
                   check=True)
    # kdist itself without its dependencies: a TensorFlow outside the range kdist
    # declares is then still tested rather than replaced.
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "-e", ROOT],
                   check=True)
    return python


def installed_versions(python):
    code = ("import importlib.metadata as m, json; "
            f"print(json.dumps({{n: m.version(n) for n in {list(REPORTED)!r}}}))")
    done = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def run_feature(python, environment, tests, timeout):
    """("pass" | "fail" | "skip", the end of pytest's output when it did not pass) for
    one feature's tests, in a pytest run of their own (a test file that cannot even be
    collected there fails its feature alone)."""
    env = dict(os.environ, KDIST_CACHE=os.path.join(environment, "kdist-cache"),
               TF_CPP_MIN_LOG_LEVEL="3")
    env.pop("KDIST_TEST_WITHOUT_MPI", None)
    with tempfile.TemporaryDirectory() as scratch:
        report = os.path.join(scratch, "report.xml")
        try:
            done = subprocess.run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                   f"--junitxml={report}", *tests], cwd=ROOT, env=env,
                                  timeout=timeout, capture_output=True, text=True)
            output = done.stdout + done.stderr
        except subprocess.TimeoutExpired:
            return "fail", f"did not finish within {timeout:.0f} s"
        outcomes = []
        if os.path.exists(report):
            for case in ElementTree.parse(report).getroot().iter("testcase"):
                if case.find("failure") is not None or case.find("error") is not None:
                    outcomes.append("fail")
                else:
                    outcomes.append("skip" if case.find("skipped") is not None else "pass")
    if not outcomes or "fail" in outcomes:
        return "fail", output[-1500:]
    return ("skip" if "skip" in outcomes else "pass"), None


def run_subset(python, environment, timeout):
    """({feature: "pass" | "fail" | "skip"}, {feature: why it did not pass})."""
    results, why = {}, {}
    for feature, tests in FEATURES.items():
        results[feature], tail = run_feature(python, environment, tests, timeout)
        if tail:
            why[feature] = tail
    return results, why


def table(rows):
    header = ["TensorFlow", "Keras", "keras-tuner"] + list(FEATURES)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        v = row["versions"]
        cells = [v.get("tensorflow", "?"), v.get("keras", "?"), v.get("keras-tuner", "?")]
        lines.append("| " + " | ".join(cells + [row["features"].get(f, "fail")
                                              for f in FEATURES]) + " |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensorflow", default="2.20.0,2.21.0",
                        help="TensorFlow versions, comma-separated")
    parser.add_argument("--keras", default="newest")
    parser.add_argument("--keras-tuner", default="newest")
    parser.add_argument("--venvs", default=os.path.join(
        os.path.expanduser("~"), ".cache", "kdist", "versions"))
    parser.add_argument("--reuse", action="store_true",
                        help="use an environment already made for a version as it is")
    parser.add_argument("--timeout", type=float, default=1200,
                        help="seconds for one feature's tests")
    args = parser.parse_args()
    versions = [v.strip() for v in args.tensorflow.split(",") if v.strip()]
    if not versions or any(v.count(".") < 1 for v in versions):
        parser.error(f"--tensorflow takes versions such as 2.20.0; got {args.tensorflow!r}")
    rows = []
    for tensorflow in versions:
        environment = os.path.join(args.venvs, f"tf-{tensorflow}")
        row = {"benchmark": "versions", "requested": {
            "tensorflow": tensorflow, "keras": args.keras, "keras-tuner": args.keras_tuner}}
        try:
            python = make_environment(environment, tensorflow, args.keras,
                                      args.keras_tuner, args.reuse)
        except subprocess.CalledProcessError as error:
            row.update(versions={"tensorflow": tensorflow}, installed=False,
                       features={}, error=f"installing failed: {error}")
        else:
            features, why = run_subset(python, environment, args.timeout)
            row.update(versions=installed_versions(python), installed=True,
                       features=features, why=why)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(table(rows))
    return 0 if all(row["installed"] and set(row["features"].values()) <= {"pass"}
                    for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
