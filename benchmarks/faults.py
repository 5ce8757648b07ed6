"""The fault-injection matrix: does every job end or carry on, and what does a fault cost?

    python benchmarks/faults.py [--ranks 2,3,4] [--faults kill,stop,...]
        [--modes plain,elastic,replace]
        [--epochs 3] [--timeout 240] [--seed 0]

For each fault, number of ranks and mode (`plain`: `DistributedOptimizer` with
`kdist.callbacks.Checkpoint`, launched as usual; `elastic`: inside
`kdist.elastic.run`, launched with `kdist run --elastic`; `replace`: the same
with `--max-np` equal to the ranks, so lost ranks are replaced), one job of
`_fault_worker.py` runs with the fault injected on a random rank at a random
batch (both drawn from `--seed`), next to a fault-free job of the same
configuration. A plain job that a fault ended is then run again with the same
command, which resumes from its newest checkpoint. Per case:

- `ended`: every process of every launch exited within `--timeout` (no hang);
- `outcome`: `finished`, `finished after a rerun`, or `ended` (the job stopped,
  as it must for a bug on one rank);
- `corrupt_checkpoints`: checkpoint files that do not load (atomic writes: 0);
- `batches_lost`: batches rank 0 ran that the final model does not contain
  (run again after a restore, or after a resume from the last checkpoint);
- `loss_gap`: final loss minus the fault-free job's (an elastic job ends on
  fewer ranks, with a different global batch, so it need not be 0);
- `final_size`: the ranks that finished (a `replace` job should end whole).

Prints one JSON object per case, then a summary line.
"""

import argparse
import glob
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "_fault_worker.py")
FAULTS = ("kill", "stop", "raise", "leave", "overflow", "uneven", "kill_in_checkpoint",
          "kill_in_commit")
# What a fault does in each mode; a fault missing from a mode does not apply there.
APPLIES = {"plain": {"kill", "stop", "raise", "overflow", "uneven", "kill_in_checkpoint"},
           "elastic": {"kill", "stop", "raise", "leave", "overflow", "uneven",
                       "kill_in_commit"}}
APPLIES["replace"] = APPLIES["elastic"]
STEPS_PER_EPOCH_ONE_RANK = 113  # 1797 digits in batches of 16


def launch(ranks, mode, fault, victim, step, epochs, checkpoints, timeout):
    """Runs one job; returns (exited in time, seconds, each rank's report)."""
    from kdist.cli import mpiexec_command

    out = tempfile.mkdtemp(prefix="kdist-fault-")
    command = [sys.executable, "-u", WORKER, "--out", out, "--fault", fault, "--victim",
               str(victim), "--step", str(step), "--epochs", str(epochs)]
    extra = []
    if mode in ("elastic", "replace"):
        command.append("--elastic")
    elif checkpoints:
        command += ["--checkpoints", checkpoints]
    if mode == "replace":
        extra = ["--oversubscribe", "-x", "KDIST_ELASTIC_MAX_NP"]  # a dead rank keeps its slot
    argv, env = mpiexec_command(ranks, command, extra=extra, fault_tolerant=mode != "plain")
    if mode == "replace":
        env["KDIST_ELASTIC_MAX_NP"] = str(ranks)
    env.update({"TF_CPP_MIN_LOG_LEVEL": "3", "KDIST_COLLECTIVE_TIMEOUT": "20",
                "PYTHONPATH": os.pathsep.join([os.path.dirname(HERE),
                                              env.get("PYTHONPATH", "")])})
    start = time.monotonic()
    process = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        process.wait(timeout=timeout)
        in_time = True
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, 9)
        process.wait()
        in_time = False
    reports = {}
    for path in glob.glob(os.path.join(out, "rank-*.json")):
        with open(path) as stream:
            reports[int(os.path.basename(path)[5:-5])] = json.load(stream)
    shutil.rmtree(out, ignore_errors=True)
    return in_time, time.monotonic() - start, reports


def corrupt_checkpoints(directory):
    bad = 0
    for path in glob.glob(os.path.join(directory, "epoch-*.npz")):
        try:
            with np.load(path) as data:
                json.loads(bytes(data["meta"]).decode())
                for name in data.files:
                    data[name]
        except Exception:  # noqa: BLE001  (any failure to read is corruption)
            bad += 1
    return bad


def run_case(ranks, mode, fault, rng, args, reference):
    victim = rng.randrange(ranks)
    steps_per_epoch = -(-STEPS_PER_EPOCH_ONE_RANK // ranks)
    step = rng.randrange(steps_per_epoch // 2, args.epochs * steps_per_epoch - steps_per_epoch)
    if fault == "kill_in_checkpoint":
        victim, step = 0, rng.randrange(1, steps_per_epoch)  # rank 0 writes, at epoch ends
    checkpoints = tempfile.mkdtemp(prefix="kdist-checkpoints-")
    in_time, seconds, reports = launch(ranks, mode, fault, victim, step, args.epochs,
                                       checkpoints, args.timeout)
    ended, outcome, runs = in_time, "finished" if reports else "ended", [reports]
    corrupt = corrupt_checkpoints(checkpoints)
    if not reports and mode == "plain":
        again_in_time, more, reports = launch(ranks, mode, "none", 0, 0, args.epochs,
                                              checkpoints, args.timeout)
        ended, seconds = ended and again_in_time, seconds + more
        corrupt += corrupt_checkpoints(checkpoints)
        runs.append(reports)
        outcome = "finished after a rerun" if reports else "ended"
    shutil.rmtree(checkpoints, ignore_errors=True)
    result = {"ranks": ranks, "mode": mode, "fault": fault, "victim": victim, "at_batch": step,
              "ended": ended, "outcome": outcome, "corrupt_checkpoints": corrupt,
              "seconds": round(seconds, 1)}
    if reports:
        first = reports[min(reports)]
        ran = first["batches_run"]
        if len(runs) == 2:
            # The first launch ran in step with the victim until the fault: `step`
            # batches, or to the end of that epoch when the checkpoint write failed.
            if fault == "kill_in_checkpoint":
                step = -(-step // steps_per_epoch) * steps_per_epoch
            ran += step
        result.update({"final_size": first["size"], "batches_lost": max(0, ran - first["updates"]),
                       "loss": round(first["loss"], 4),
                       "loss_gap": round(first["loss"] - reference["loss"], 4)})
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="2,3,4")
    parser.add_argument("--faults", default=",".join(FAULTS))
    parser.add_argument("--modes", default="plain,elastic,replace")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=240)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    ranks = [int(r) for r in args.ranks.split(",") if r]
    faults = [f for f in args.faults.split(",") if f]
    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(faults) - set(FAULTS)) + sorted(set(modes) - set(APPLIES))
    if unknown or not ranks or min(ranks) < 2 or args.epochs < 2:
        parser.error(f"--ranks of 2 or more, --epochs of 2 or more, faults from {FAULTS}, "
                     f"modes from {sorted(APPLIES)}; unknown: {unknown}")
    rng = random.Random(args.seed)
    cases = []
    for n in ranks:
        for mode in modes:
            references = {}
            for fault in faults:
                if fault not in APPLIES[mode]:
                    continue
                precision = "float16" if fault == "overflow" else "float32"
                if precision not in references:
                    _, _, reports = launch(n, mode, "overflow" if precision == "float16"
                                           else "none", -1, 0, args.epochs, None, args.timeout)
                    if 0 not in reports:
                        raise SystemExit(f"the fault-free {mode} job on {n} ranks did not "
                                         "finish")
                    references[precision] = reports[0]
                case = run_case(n, mode, fault, rng, args, references[precision])
                cases.append(case)
                print(json.dumps(case), flush=True)
    print(json.dumps({
        "benchmark": "faults", "cases": len(cases),
        "hangs": sum(not c["ended"] for c in cases),
        "corrupt_checkpoints": sum(c["corrupt_checkpoints"] for c in cases),
        "finished": sum(c["outcome"] != "ended" for c in cases),
    }), flush=True)


if __name__ == "__main__":
    main()
