"""The fault matrix across hosts: does every job end (or carry on), and does it say so?

    python benchmarks/host_faults.py [--hosts 2,3] [--faults link_down,...]
        [--launchers kdist_run,mpiexec] [--modes plain,elastic]
        [--at 12] [--epochs 20] [--timeout 180] [--logs DIR]

Needs root: the hosts are network namespaces on this machine (tests/emulated_hosts.py),
one rank each, joined by a switch; TCP is the only path between them, and ranks on the
other hosts are started through Open MPI's remote-shell agent, as on a cluster. Each job
trains `_fault_worker.py` (an MLP on the digits, `DistributedOptimizer`; `plain` with
`kdist.callbacks.Checkpoint` every epoch, `elastic` in `kdist.elastic.run`), and `--at`
seconds after its start the last host suffers one fault:

- link_down: its link goes down for good;
- link_flap: its link goes down and comes back 3 s later;
- slow_link: its link is limited to 10 Mbit/s each way (`tc ... tbf`): not a fault,
  the job must finish;
- stop_host: every process of its ranks is stopped (SIGSTOP): alive, silent;
- kill_daemon: the launcher's daemon there (`prted`) is killed; its ranks live;
- kill_rank: its rank is killed (SIGKILL).

Launchers: `kdist_run` (`kdist run`, with `--elastic` for elastic jobs) and `mpiexec`
(Open MPI's, with `--with-ft ulfm` for elastic jobs, as a user types it: without the
daemon keepalives `kdist run` adds), with the same settings; ranks get
`KDIST_PEER_TIMEOUT=30`, `KDIST_COLLECTIVE_TIMEOUT=60` and `KDIST_START_TIMEOUT=60`
(defaults: 120 s, none, 600 s), so that a cell takes a minute or two. Per cell: seconds
to end (or `--timeout`, ended by the benchmark: a hang), the exit status, the last
message that says why, the ranks that finished and whether their losses agree, and
checkpoint files that do not load.

Prints one JSON object per cell, then a Markdown table.
"""

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, HERE)

from faults import corrupt_checkpoints  # noqa: E402

WORKER = os.path.join(HERE, "_fault_worker.py")
FAULTS = ("link_down", "link_flap", "slow_link", "stop_host", "kill_daemon", "kill_rank")
SETTINGS = {"KDIST_PEER_TIMEOUT": "30", "KDIST_COLLECTIVE_TIMEOUT": "60",
            "KDIST_START_TIMEOUT": "60",
            "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONUNBUFFERED": "1"}
# Lines that say why a job ended, most telling first.
WHY = [re.compile(p) for p in (
    r"kdist run: exit status .*", r"The launcher \(pid \d+\) still waited .*",
    r"kdist\.init\(\) has waited .*", r"aborting the job: .*", r"lost communication .*",
    r"Ranks of this job were lost; ending it with MPI_Abort\(0\)",
    r"rank\(s\) lost; carrying on with \d+", r"answered none of kdist's questions.*",
    r"PRTE has lost communication.*", r"ULFM.*|MPI_ERR_PROC_FAILED.*")]


def namespace_pids(hosts, host):
    listed = subprocess.run(["ip", "netns", "pids", hosts.namespace(host)],
                            capture_output=True, text=True).stdout.split()
    return [int(pid) for pid in listed if pid.isdigit()]


def command_of(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as stream:
            return stream.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def inject(hosts, fault):
    """Does `fault` to the last host; returns a function that undoes what needs undoing."""
    victim = hosts.names[-1]
    index = len(hosts.names) - 1
    if fault in ("link_down", "link_flap"):
        hosts.set_link(index, False)
        if fault == "link_flap":
            time.sleep(3)
            hosts.set_link(index, True)
    elif fault == "slow_link":
        inside, outside = f"{hosts.prefix}e{index}", f"{hosts.prefix}p{index}"
        for namespace, device in ((hosts.namespace(victim), inside),
                                  (f"{hosts.prefix}sw", outside)):
            subprocess.run(["tc", "-n", namespace, "qdisc", "add", "dev", device, "root",
                            "tbf", "rate", "10mbit", "burst", "32kbit", "latency", "400ms"],
                           check=True, capture_output=True)
    elif fault == "stop_host":
        for pid in namespace_pids(hosts, victim):
            if "_fault_worker" in command_of(pid):
                os.kill(pid, signal.SIGSTOP)
    elif fault == "kill_daemon":
        for pid in namespace_pids(hosts, victim):
            if "prted" in command_of(pid).split(" ")[0]:
                os.kill(pid, signal.SIGKILL)
    elif fault == "kill_rank":
        for pid in namespace_pids(hosts, victim):
            command = command_of(pid)
            # The rank itself, not the output wrapper that runs it.
            if "_fault_worker" in command and "_prefix.py" not in command:
                os.kill(pid, signal.SIGKILL)
    else:
        raise ValueError(f"unknown fault {fault!r}")


def launcher_command(hosts, launcher, mode, out, checkpoints, epochs):
    from kdist.cli import DAEMON_KEEPALIVE_ARGS, mpiexec_command

    worker = [sys.executable, "-u", WORKER, "--out", out, "--epochs", str(epochs)]
    worker += ["--elastic"] if mode == "elastic" else ["--checkpoints", checkpoints]
    mpi_args = hosts.mpi_args(1, forward=sorted(SETTINGS) + ["PYTHONPATH"])
    if launcher == "kdist_run":
        argv = [sys.executable, "-m", "kdist.cli", "run", "-n", str(hosts.count),
                "--mpi-args", shlex.join(mpi_args)]
        argv += (["--elastic"] if mode == "elastic" else []) + ["--"] + worker
        env = dict(os.environ)
    else:
        argv, env = mpiexec_command(hosts.count, worker, extra=mpi_args,
                                    fault_tolerant=mode == "elastic")
        # As a user types it: without the daemon keepalives kdist run adds, Open MPI's
        # launcher takes 8 minutes to notice a host that went silent.
        argv = _without(argv, DAEMON_KEEPALIVE_ARGS)
    env.update(SETTINGS)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    return hosts.on_first_host(argv), env


def _without(argv, part):
    """`argv` without the run of arguments `part`, where it occurs."""
    part = list(part)
    for at in range(len(argv) - len(part) + 1):
        if argv[at:at + len(part)] == part:
            return argv[:at] + argv[at + len(part):]
    return list(argv)


def run_cell(count, fault, launcher, mode, args):
    import emulated_hosts

    out = tempfile.mkdtemp(prefix="kdist-host-fault-")
    checkpoints = tempfile.mkdtemp(prefix="kdist-host-checkpoints-")
    lines = []
    with emulated_hosts.EmulatedHosts(count) as hosts:
        argv, env = launcher_command(hosts, launcher, mode, out, checkpoints, args.epochs)
        started = time.monotonic()
        process = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, start_new_session=True)

        def read():
            for line in iter(process.stdout.readline, b""):
                lines.append(line.decode(errors="replace").rstrip())

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        timer = None
        if fault != "none":
            timer = threading.Timer(args.at, inject, (hosts, fault))
            timer.start()
        try:
            status = process.wait(timeout=args.timeout)
            hung = False
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            status = process.wait()
            hung = True
        seconds = time.monotonic() - started
        if timer is not None:
            timer.cancel()
        hosts.kill_processes()
        reader.join(5)
    reports = {}
    for name in os.listdir(out):
        if re.fullmatch(r"rank-\d+\.json", name):
            with open(os.path.join(out, name)) as stream:
                reports[int(name[5:-5])] = json.load(stream)
    corrupt = corrupt_checkpoints(checkpoints)
    saved = len(os.listdir(checkpoints))
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(checkpoints, ignore_errors=True)
    if args.logs:
        os.makedirs(args.logs, exist_ok=True)
        name = f"{count}-{fault}-{launcher}-{mode}.log"
        with open(os.path.join(args.logs, name), "w") as stream:
            stream.write("\n".join(lines) + "\n")
    losses = {round(r["loss"], 6) for r in reports.values()}
    return {"hosts": count, "fault": fault, "launcher": launcher, "mode": mode,
            "seconds": round(seconds, 1), "hung": hung, "exit_status": None if hung else status,
            "finished": sorted(reports), "ranks_agree": len(losses) <= 1,
            "checkpoints": saved, "corrupt_checkpoints": corrupt, "why": _why(lines)}


def _why(lines):
    for pattern in WHY:
        for line in reversed(lines):
            found = pattern.search(line)
            if found:
                return _printable(found.group(0))
    said = [line for line in lines if line.strip() and not NOISE.search(line)]
    return _printable(said[-1]) if said else ""


def _printable(text):
    return "".join(c for c in text if c.isprintable())[:240]


# TensorFlow's start-up lines, which a plain launcher passes on from every rank.
NOISE = re.compile(r"^(\[\d+\] )?([IW]\d{4} |WARNING: All log messages|To enable the following)")


def table(rows):
    head = ("| hosts | fault | launcher | mode | seconds | exit | finished | ranks agree | "
            "corrupt checkpoints | why |\n|---|---|---|---|---|---|---|---|---|---|\n")
    body = "".join(
        f"| {r['hosts']} | {r['fault']} | {r['launcher']} | {r['mode']} | "
        f"{'hung, ended at ' if r['hung'] else ''}{r['seconds']} | "
        f"{'-' if r['hung'] else r['exit_status']} | "
        f"{','.join(map(str, r['finished'])) or 'none'} | {'yes' if r['ranks_agree'] else 'NO'} | "
        f"{r['corrupt_checkpoints']} of {r['checkpoints']} | {r['why'].replace('|', '/')} |\n"
        for r in rows)
    return head + body


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", default="2,3")
    parser.add_argument("--faults", default=",".join(FAULTS))
    parser.add_argument("--launchers", default="kdist_run,mpiexec")
    parser.add_argument("--modes", default="plain,elastic")
    parser.add_argument("--at", type=float, default=12.0,
                        help="seconds after the launch at which the fault comes")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--timeout", type=float, default=180.0)
    parser.add_argument("--logs", default=None,
                        help="a directory to keep each cell's output in")
    args = parser.parse_args()
    import emulated_hosts

    why_not = emulated_hosts.available() or (
        None if shutil.which("tc") else "a slow link needs the `tc` command (iproute2)")
    if why_not:
        sys.exit(f"benchmarks/host_faults.py: {why_not}")
    faults = args.faults.split(",")
    unknown = sorted(set(faults) - set(FAULTS) - {"none"})
    if unknown:
        parser.error(f"unknown fault(s) {unknown}; choose from {', '.join(FAULTS)} or none")
    rows = []
    for count in [int(h) for h in args.hosts.split(",")]:
        for mode in args.modes.split(","):
            for launcher in args.launchers.split(","):
                for fault in faults:
                    row = run_cell(count, fault, launcher, mode, args)
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    print(table(rows))
    hung = [r for r in rows if r["hung"]]
    hidden = [r for r in rows if not r["hung"] and r["exit_status"] == 0 and not r["finished"]]
    print(json.dumps({"cells": len(rows), "hung": len(hung), "failed_but_exit_0": len(hidden),
                      "corrupt_checkpoints": sum(r["corrupt_checkpoints"] for r in rows),
                      "ranks_disagree": sum(not r["ranks_agree"] for r in rows)}))


if __name__ == "__main__":
    main()
