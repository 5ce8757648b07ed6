"""What a rank spends before its first line of work, and what kdist adds to it.

    python benchmarks/startup.py [--repeats 5] [--ranks 2] [--cases python,keras,...]

Cases, each run `--repeats` times in turn (alternating, so that a change of load hits
all of them alike), from the moment the launching process starts the command:

- `python`: the interpreter alone (`python -c pass`), the floor;
- `tensorflow`: `import tensorflow`;
- `keras`: `import keras`, the baseline kdist is compared with;
- `kdist`: `import kdist, keras; kdist.init()` in one process;
- `kdist_mpi`: the same on `--ranks` ranks under mpiexec (the slowest rank counts);
- `kdist_mpi_ofi`: the same with Open MPI's libfabric transport probed, as it is when
  `OMPI_MCA_btl` is set to its full list (what kdist's single-node default leaves out).

Per case: the median wall seconds to the end of the imports (and `kdist.init()`), the
median CPU seconds (user + system) of that process, and the median's ratio to `keras`.
Then `-X importtime` of the `kdist` case, summed by top-level package, with what kdist's
own modules cost, and what Keras imports at start-up that a rank does not use (its
scikit-learn wrappers and matplotlib's pyplot, which bring scikit-learn and SciPy's
stats along), each with its cumulative seconds.

Prints one JSON object per case, then the import breakdown.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

PROBE = """
import json, resource, sys, time
{imports}
usage = resource.getrusage(resource.RUSAGE_SELF)
rank = {rank}
print("STARTUP " + json.dumps({{"rank": rank, "done": time.time(),
                               "cpu": usage.ru_utime + usage.ru_stime}}), flush=True)
"""
CASES = {
    "python": ("pass", False),
    "tensorflow": ("import tensorflow", False),
    "keras": ("import keras", False),
    "kdist": ("import kdist, keras\nkdist.init()", False),
    "kdist_mpi": ("import kdist, keras\nkdist.init()", True),
    "kdist_mpi_ofi": ("import kdist, keras\nkdist.init()", True),
}
# Open MPI's whole list of BTLs in the mpi extra's build: naming it stops kdist's default.
ALL_BTLS = "self,sm,tcp,ofi,uct"
# What Keras imports at start-up for features a training rank does not use.
UNUSED_BY_A_RANK = {
    "keras.src.wrappers": "Keras's scikit-learn wrappers (they import scikit-learn)",
    "keras.src.visualization": "Keras's plotting helpers (they import matplotlib.pyplot)",
    "sklearn": "scikit-learn",
    "scipy.stats": "SciPy's stats (through scikit-learn)",
    "matplotlib.pyplot": "matplotlib's pyplot",
}


def environment():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    for name in list(env):
        if name.startswith(("OMPI_", "PMIX_", "PMI_")):
            env.pop(name)
    return env


def run_case(name, ranks):
    imports, mpi = CASES[name]
    rank = "kdist.rank()" if "kdist" in imports else "0"
    code = PROBE.format(imports=imports, rank=rank)
    command = [sys.executable, "-c", code]
    env = environment()
    if mpi:
        from kdist.cli import mpiexec_command

        command, env = mpiexec_command(ranks, command, extra=["-x", "OMPI_MCA_btl"]
                                       if name.endswith("_ofi") else [])
        env = {k: v for k, v in env.items() if not k.startswith(("PMIX_", "PMI_"))}
        env["TF_CPP_MIN_LOG_LEVEL"] = "3"
        if name.endswith("_ofi"):
            env["OMPI_MCA_btl"] = ALL_BTLS
    started = time.time()
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    reports = [json.loads(line.split(" ", 1)[1]) for line in done.stdout.splitlines()
               if line.startswith("STARTUP ")]
    return (max(r["done"] for r in reports) - started, max(r["cpu"] for r in reports))


def import_breakdown():
    """Self seconds by top-level package, and the cumulative seconds of chosen modules."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-c",
                           "import kdist, keras; kdist.init()"], env=environment(),
                          capture_output=True, text=True, timeout=600)
    by_package, cumulative = {}, {}
    for line in done.stderr.splitlines():
        match = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|\s*(\S+)", line)
        if not match:
            continue
        own, total, module = int(match.group(1)) / 1e6, int(match.group(2)) / 1e6, match.group(3)
        package = module.split(".")[0]
        by_package[package] = by_package.get(package, 0.0) + own
        cumulative[module] = total
    return by_package, cumulative


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--cases", default=",".join(CASES),
                        type=lambda s: [x for x in s.split(",") if x],
                        help="which cases to run (keras, the baseline, always runs)")
    args = parser.parse_args()
    unknown = set(args.cases) - set(CASES)
    if unknown:
        parser.error(f"unknown case(s) {sorted(unknown)}; choose from {', '.join(CASES)}")
    measured = {name: [] for name in CASES if name in args.cases or name == "keras"}
    for _ in range(args.repeats):
        for name in measured:
            measured[name].append(run_case(name, args.ranks))
    keras_wall = statistics.median(w for w, _ in measured["keras"])
    keras_cpu = statistics.median(c for _, c in measured["keras"])
    for name, runs in measured.items():
        wall = statistics.median(w for w, _ in runs)
        cpu = statistics.median(c for _, c in runs)
        print(json.dumps({"case": name, "wall_s": round(wall, 3), "cpu_s": round(cpu, 3),
                          "wall_vs_keras": round(wall / keras_wall, 3),
                          "cpu_vs_keras": round(cpu / keras_cpu, 3),
                          "repeats": args.repeats}))
    by_package, cumulative = import_breakdown()
    total = sum(by_package.values())
    top = sorted(by_package.items(), key=lambda item: -item[1])[:12]
    print(json.dumps({"imports_self_s": round(total, 3),
                      "by_package": {k: round(v, 3) for k, v in top},
                      "kdist_own_s": round(by_package.get("kdist", 0.0), 3),
                      "unused_by_a_rank_cumulative_s": {
                          module: round(cumulative[module], 3) for module in UNUSED_BY_A_RANK
                          if module in cumulative}}))


if __name__ == "__main__":
    main()
