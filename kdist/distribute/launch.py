"""Starts N TensorFlow workers on this machine, each with its own TF_CONFIG.

`kdist launch -n N script.py` (the default `--backend tf`) uses this: worker
`i` runs the command with TF_CONFIG naming an N-worker cluster on free
localhost ports and task index `i`, so that
`tf.distribute.MultiWorkerMirroredStrategy` (or kdist's version of it) finds
its peers. Output lines are prefixed with the worker index, as `kdist run`
prefixes MPI ranks. If one worker fails, the others are stopped (SIGTERM, then
SIGKILL after a grace period) and the launch fails with that worker's exit
code; Ctrl-C or SIGTERM to the launcher stops every worker.

>>> import io, sys
>>> out = io.BytesIO()
>>> launch_tf(2, [sys.executable, "-c", "print('hello')"], out=out)
0
>>> sorted(out.getvalue().decode().splitlines())
['[0] hello', '[1] hello']
"""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from kdist._prefix import quiet, relay

GRACE_SECONDS = 3.0
_POLL_SECONDS = 0.05


def free_ports(count, host="localhost"):
    """`count` distinct TCP ports that were free a moment ago."""
    probes = []
    try:
        # Holding every probe open until all are bound keeps the ports distinct.
        for _ in range(count):
            probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            probes.append(probe)
            probe.bind((host, 0))
        return [probe.getsockname()[1] for probe in probes]
    finally:
        for probe in probes:
            probe.close()


def tf_config(addresses, index):
    """The TF_CONFIG string for worker `index` of a cluster of `addresses`.

    >>> tf_config(["a:1", "b:1"], 1)
    '{"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": 1}}'
    """
    if not 0 <= index < len(addresses):
        raise ValueError(f"Worker index {index} is outside a cluster of {len(addresses)}.")
    return json.dumps({"cluster": {"worker": list(addresses)},
                       "task": {"type": "worker", "index": index}})


class _Stop(Exception):
    """A signal asked the launcher to stop."""

    def __init__(self, signum):
        super().__init__(signum)
        self.signum = signum


def _signal_group(process, sig):
    # Each worker leads its own process group, so that a shell command's
    # children go down with it.
    try:
        os.killpg(process.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _stop_all(processes, grace):
    running = [p for p in processes if p.poll() is None]
    for process in running:
        _signal_group(process, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while any(p.poll() is None for p in running) and time.monotonic() < deadline:
        time.sleep(_POLL_SECONDS)
    for process in running:
        if process.poll() is None:
            _signal_group(process, signal.SIGKILL)
        process.wait()


def _exit_code(code):
    # A worker killed by a signal reports -signal; shells say 128 + signal.
    return code if code >= 0 else 128 - code


def _wait_for_first_failure(processes):
    while True:
        codes = [p.poll() for p in processes]
        failed = [i for i, code in enumerate(codes) if code not in (None, 0)]
        if failed:
            return failed[0], codes[failed[0]]
        if all(code == 0 for code in codes):
            return None, 0
        time.sleep(_POLL_SECONDS)


def launch_tf(nprocs, command, prefix=True, env=None, host="localhost", grace=GRACE_SECONDS,
              out=None):
    """Runs `command` as `nprocs` TensorFlow workers on this machine; returns the exit code.

    Args:
        nprocs: number of workers, at least 1.
        command: the argv every worker runs, e.g. [sys.executable, "train.py"].
        prefix: prefix each output line with "[i] ", i the worker index.
        env: environment for the workers (default: this process's), to which
            TF_CONFIG is added.
        host: the host name the workers reach each other by.
        grace: seconds between SIGTERM and SIGKILL when stopping workers.
        out: binary stream for the workers' output (default: stdout).
    """
    if not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"-n must be at least 1; got {nprocs}.")
    if not command:
        raise ValueError("launch_tf needs a command to run, e.g. [sys.executable, 'train.py'].")
    out = sys.stdout.buffer if out is None else out
    addresses = [f"{host}:{port}" for port in free_ports(nprocs)]
    base_env = dict(os.environ if env is None else env)
    base_env.setdefault("PYTHONUNBUFFERED", "1")
    processes, relays, lock = [], [], threading.Lock()
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _raise_stop)
    try:
        for index in range(nprocs):
            worker_env = dict(base_env, TF_CONFIG=tf_config(addresses, index))
            pipe = subprocess.PIPE if prefix else None
            process = subprocess.Popen(list(command), env=worker_env, stdout=pipe,
                                       stderr=subprocess.STDOUT if prefix else None,
                                       start_new_session=True)
            processes.append(process)
            if prefix:
                thread = threading.Thread(
                    target=relay, args=(process.stdout.fileno(), f"[{index}] ".encode(), out,
                                        lock, quiet()), daemon=True)
                thread.start()
                relays.append(thread)
        failed, code = _wait_for_first_failure(processes)
        if failed is not None:
            _stop_all(processes, grace)
        return _exit_code(code)
    except KeyboardInterrupt:
        _stop_all(processes, grace)
        return 128 + signal.SIGINT
    except _Stop as stop:
        _stop_all(processes, grace)
        return 128 + stop.signum
    except BaseException:
        _stop_all(processes, grace)
        raise
    finally:
        for thread in relays:
            # The pipes close when the workers are gone; a grandchild that
            # kept one open does not hold the launcher hostage.
            thread.join(timeout=grace)
        for process in processes:
            if process.stdout is not None:
                process.stdout.close()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _raise_stop(signum, frame):
    raise _Stop(signum)
