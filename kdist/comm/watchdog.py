"""Failure handling: one rank's failure ends the whole job, with its reason.

MPI jobs hang when one rank stops taking part in collectives while the others
wait for it. kdist prevents that two ways: an exception that escapes on any
rank aborts the job (the launcher then stops every rank), and an optional
deadline on each collective (`KDIST_COLLECTIVE_TIMEOUT`, seconds) aborts a job
whose peers stopped answering without dying.
"""

import logging
import os
import sys
import threading
import time
import traceback

logger = logging.getLogger(__name__)

_installed = False


def _world():
    from kdist.comm import processes as world

    return world._state.world


def abort(reason, code=1):
    """Prints `reason` with this rank's number and ends every rank of the job."""
    world = _world()
    rank = world.rank if world is not None else 0
    sys.stderr.write(f"[kdist rank {rank}] aborting the job: {reason}\n")
    sys.stderr.flush()
    if world is not None:
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
    timeout = float(os.environ.get("KDIST_COLLECTIVE_TIMEOUT", "0") or 0)
    if timeout > 0:
        Deadline.start(timeout)


class Deadline:
    """Aborts the job when one collective stays unfinished past a time limit."""

    _instance = None

    def __init__(self, timeout):
        self.timeout = timeout
        self._started = {}
        self._lock = threading.Lock()
        thread = threading.Thread(target=self._watch, name="kdist-deadline", daemon=True)
        thread.start()

    @classmethod
    def start(cls, timeout):
        if cls._instance is None:
            cls._instance = cls(timeout)
        return cls._instance

    @classmethod
    def guard(cls, name):
        return _Guard(cls._instance, name)

    def _watch(self):
        while True:
            time.sleep(min(1.0, self.timeout / 4))
            now = time.monotonic()
            with self._lock:
                late = [(name, now - t) for name, t in self._started.items()
                        if now - t > self.timeout]
            if late:
                (name, _), waited = late[0]
                abort(f"collective '{name}' waited {waited:.0f} s for the other ranks "
                      f"(KDIST_COLLECTIVE_TIMEOUT={self.timeout:g}); a peer has stopped "
                      "taking part")


class _Guard:
    def __init__(self, deadline, name):
        self._deadline = deadline
        self._name = name

    def __enter__(self):
        if self._deadline is not None:
            with self._deadline._lock:
                self._deadline._started[(self._name, threading.get_ident())] = time.monotonic()
        return self

    def __exit__(self, *exc):
        if self._deadline is not None:
            with self._deadline._lock:
                self._deadline._started.pop((self._name, threading.get_ident()), None)
        return False
