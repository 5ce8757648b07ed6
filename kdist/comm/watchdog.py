"""Failure handling: one rank's failure ends the whole job, with its reason.

MPI jobs hang when one rank stops taking part in collectives while the others
wait for it. kdist prevents that three ways:

- an exception that escapes on any rank aborts the job, naming the rank;
- every wait of kdist's (collectives in Python and in C++, parameter-server
  messages) is visible to a monitor thread. After `KDIST_STALL_WARNING`
  seconds (default 60; 0 turns it off) it asks the other ranks what they are
  doing and warns, naming the ranks that have not arrived;
- with `KDIST_COLLECTIVE_TIMEOUT` seconds set, a wait that lasts longer ends
  the job with the same report: which ranks are waiting where, and which do
  not answer at all (stopped, or dead).

The monitor asks on its own duplicate of the world communicator, so its
messages never meet the job's.
"""

import atexit
import contextlib
import logging
import os
import sys
import threading
import time
import traceback

logger = logging.getLogger(__name__)

_installed = False
_waits = {}  # thread id -> (description, since)
_waits_lock = threading.Lock()
_monitor = None


def _world():
    from kdist.comm import job

    return job._state.world


def abort(reason, code=1):
    """Prints `reason` with this rank's number and ends every rank of the job."""
    world = _world()
    rank = world.rank if world is not None else 0
    sys.stderr.write(f"[kdist rank {rank}] aborting the job: {reason}\n")
    sys.stderr.flush()
    if world is not None:
        from kdist.comm import ending

        if ending.fault_tolerant():
            # Once ranks have died, Open MPI's MPI_Abort can block for good in a
            # fault-tolerant job; an exit with an error status ends such a job too.
            aborting = threading.Thread(target=world.abort, args=(code,), daemon=True)
            aborting.start()
            aborting.join(10)
        else:
            world.abort(code)
    os._exit(code)


def _excepthook(kind, value, tb):
    world = _world()
    if world is None or world.size == 1:
        _previous_hook(kind, value, tb)
        return
    text = "".join(traceback.format_exception(kind, value, tb))
    prefix = f"[kdist rank {world.rank}] "
    sys.stderr.write("".join(prefix + line + "\n" for line in text.rstrip().splitlines()))
    abort(f"uncaught {kind.__name__} on rank {world.rank}: {value}")


_previous_hook = sys.excepthook


def install_failure_handlers():
    """Makes an uncaught exception on any rank abort the whole job."""
    global _installed, _previous_hook
    if _installed:
        return
    _installed = True
    _previous_hook = sys.excepthook
    sys.excepthook = _excepthook


@contextlib.contextmanager
def waiting(what):
    """Marks this thread as waiting for `what` (a collective or a message) meanwhile."""
    key = threading.get_ident()
    with _waits_lock:
        previous = _waits.get(key)
        _waits[key] = (what, time.monotonic())
    try:
        yield
    finally:
        with _waits_lock:
            if previous is None:
                _waits.pop(key, None)
            else:
                _waits[key] = previous


def current_wait():
    """`(description, seconds)` of this process's longest wait, or None."""
    now = time.monotonic()
    with _waits_lock:
        waits = [(what, now - since) for what, since in _waits.values()]
    from kdist.comm import native

    native_wait = native.current_wait()
    if native_wait is not None:
        waits.append(native_wait)
    return max(waits, key=lambda item: item[1]) if waits else None


def _seconds(name, default):
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        return max(0.0, float(value))
    except ValueError:
        raise ValueError(f"{name} must be a number of seconds; got {value!r}.") from None


def start_monitor(world, watch_comm):
    """Starts the monitor thread for this process (once), if the job has peers."""
    global _monitor
    if _monitor is not None or world.size == 1:
        return _monitor
    timeout = _seconds("KDIST_COLLECTIVE_TIMEOUT", 0.0)
    stall = _seconds("KDIST_STALL_WARNING", 60.0)
    if timeout == 0 and stall == 0:
        return None
    from kdist.comm.peers import PeerStatus

    peers = PeerStatus(watch_comm, world.rank) if watch_comm is not None else None
    _monitor = _Monitor(peers, timeout, stall)
    _monitor.start()
    atexit.register(stop_monitor)
    return _monitor


def stop_monitor():
    global _monitor
    monitor, _monitor = _monitor, None
    if monitor is not None:
        monitor.stop()


class _Monitor(threading.Thread):
    """Watches this process's waits; warns about stalls and ends stuck jobs."""

    def __init__(self, peers, timeout, stall_warning):
        super().__init__(name="kdist-watchdog", daemon=True)
        self.peers = peers
        self.timeout = timeout
        self.stall_warning = stall_warning
        limits = [t for t in (timeout, stall_warning) if t > 0]
        self.tick = max(0.05, min([1.0] + [t / 4 for t in limits]))
        self._halt = threading.Event()
        self._warned = {}

    def stop(self):
        self._halt.set()
        self.join(timeout=5)
        if self.peers is not None:
            self.peers.close()

    def run(self):
        while not self._halt.wait(self.tick):
            if self.peers is not None:
                self.peers.answer(self._status())
            wait = current_wait()
            if wait is None:
                self._warned.clear()
                continue
            what, seconds = wait
            if self.timeout and seconds > self.timeout:
                report = self._ask()
                abort(f"'{what}' has waited {seconds:.0f} s for the other ranks "
                      f"(KDIST_COLLECTIVE_TIMEOUT={self.timeout:g}). {report}")
            if self.stall_warning and seconds > self.stall_warning:
                due = self._warned.get(what, 0.0) + self.stall_warning
                if seconds >= due:
                    self._warned[what] = seconds
                    logger.warning("stall: '%s' has waited %.0f s for the other ranks. %s "
                                   "(KDIST_STALL_WARNING=%g; set KDIST_COLLECTIVE_TIMEOUT to "
                                   "end such a job)", what, seconds, self._ask(),
                                   self.stall_warning)

    def _status(self):
        wait = current_wait()
        if wait is None:
            return "is running, not in a kdist collective"
        return f"is waiting in '{wait[0]}' ({wait[1]:.0f} s)"

    def _ask(self):
        if self.peers is None:
            return ("The other ranks could not be asked (MPI does not allow calls from "
                    "several threads here).")
        answers = self.peers.ask(self._status)
        silent = [rank for rank, text in answers.items() if text is None]
        parts = [f"rank {rank} {text}" for rank, text in sorted(answers.items())
                 if text is not None]
        if silent:
            parts.append(f"rank(s) {silent} do not answer (stopped, hung outside Python, or "
                         "dead)")
        return "Other ranks: " + "; ".join(parts) + "." if parts else ""
