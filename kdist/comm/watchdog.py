"""Failure handling: one rank's failure ends the whole job, with its reason.

MPI jobs hang when one rank stops taking part in collectives while the others
wait for it. kdist prevents that four ways:

- an exception that escapes on any rank aborts the job, naming the rank;
- every wait of kdist's (collectives in Python and in C++, parameter-server
  messages) is visible to a monitor thread. After `KDIST_STALL_WARNING`
  seconds (default 60; 0 turns it off) it asks the other ranks what they are
  doing and warns, naming the ranks that have not arrived;
- a deadlock ends the job: once a wait for other ranks has lasted
  `KDIST_DEADLOCK_TIMEOUT` seconds (default 300; 0 turns it off), the monitor
  asks the others, and if none of them is running (each waits in a kdist wait
  of its own that has lasted a while too, or leaves the job, or does not
  answer: stopped, hung outside Python, or dead), twice in a row, nothing can
  end the wait and the job ends with the report. A rank that computes, or
  waits for something outside kdist, keeps the job alive however long it
  takes, and so do ranks moving a collective's data (a slow payload);
- a peer that stops answering ends the job: while this rank waits for the
  others, the monitor asks them every few seconds; a rank that has answered
  none of those questions for `KDIST_PEER_TIMEOUT` seconds (default 120; 0
  turns it off) is lost (its host or link is down, or it is stopped or
  dead), and the job ends naming it and its host. A rank that computes,
  compiles or writes a checkpoint still answers (its monitor thread runs
  beside the work), and so does a rank behind a slow link: only silence
  counts, however long the wait;
- with `KDIST_COLLECTIVE_TIMEOUT` seconds set, any wait that lasts longer ends
  the job with the same report: which ranks are waiting where, and which do
  not answer at all.

A rank that waits at exit for the others to end (`kdist.comm.leaving`) is
exempt from both timeouts: ranks may end at different times.

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

# What a wait is, as the monitor reports it to other ranks.
WAITING = "waiting"  # for other ranks to arrive (a collective's header, a message)
MOVING = "moving"  # a collective's data, every rank having arrived
LEAVING = "leaving"  # at exit, for the other ranks to end too

_installed = False
_waits = {}  # thread id -> (description, since, state)
_waits_lock = threading.Lock()
_monitor = None


def _world():
    from kdist.comm import job

    return job._state.world


def abort(reason, code=1):
    """Prints `reason` with this rank's number and ends every rank of the job.

    The line on standard error reads `[kdist rank R] aborting the job: reason`; then it
    ends every rank of the job with exit code `code` (`MPI_Abort` in an MPI job). If
    `MPI_Abort` has not ended the job after 10 seconds (a lost host), this process exits
    on its own, which ends the job too. In a fault-tolerant job whose ranks died, it
    exits at once with `code` instead, which ends such a job with that status.
    """
    world = _world()
    rank = world.rank if world is not None else 0
    sys.stderr.write(f"[kdist rank {rank}] aborting the job: {reason}\n")
    sys.stderr.flush()
    from kdist.comm import ending

    if world is not None and world.size > 1:
        # The launcher may wait for a host it cannot reach after the abort, for good.
        ending.watch_the_launcher("kdist aborted the job")
    if world is not None and ending.ranks_died():
        # After MPI_Abort(1) in a job that lost ranks, Open MPI's launcher has exited 0 or
        # waited for good (about 1 job in 10 under load); a rank's non-zero exit always
        # ends a fault-tolerant job with that status.
        logging.shutdown()
        os._exit(code)
    if world is not None:
        # MPI_Abort can block for good: in a fault-tolerant job once ranks have
        # died, or when a host has dropped off the network and the launcher
        # cannot reach its daemon. This process then exits with an error status
        # after ABORT_GRACE_SECONDS, which ends the job as well.
        aborting = threading.Thread(target=world.abort, args=(code,), daemon=True)
        aborting.start()
        aborting.join(ABORT_GRACE_SECONDS)
    os._exit(code)


# How long `abort` lets MPI_Abort try to end the job before this process exits alone.
ABORT_GRACE_SECONDS = 10.0


def _excepthook(kind, value, tb):
    world = _world()
    if world is None or world.size == 1:
        from kdist.comm import ending

        # A survivor alone in a shrunk world leaves through ending's exit, which must
        # not report this failure as a clean end.
        ending.mark_failed()
        _previous_hook(kind, value, tb)
        return
    text = "".join(traceback.format_exception(kind, value, tb))
    prefix = f"[kdist rank {world.rank}] "
    sys.stderr.write("".join(prefix + line + "\n" for line in text.rstrip().splitlines()))
    abort(f"uncaught {kind.__name__} on rank {world.rank}: {value}")


_previous_hook = sys.excepthook

# Every thread kdist starts is named with this prefix (the watchdog, the parameter
# server's master and shards, a search's progress and heartbeat threads).
THREAD_PREFIX = "kdist-"


def _thread_excepthook(args):
    """An uncaught exception in one of kdist's own threads ends the job as one in the
    main thread does: a dead watchdog or server thread would otherwise leave the others
    waiting. Other threads go to the hook that was there before."""
    thread = args.thread
    world = _world()
    if (thread is None or not thread.name.startswith(THREAD_PREFIX)
            or world is None or world.size == 1 or args.exc_type is SystemExit):
        _previous_thread_hook(args)
        return
    text = "".join(traceback.format_exception(args.exc_type, args.exc_value,
                                              args.exc_traceback))
    prefix = f"[kdist rank {world.rank}] "
    sys.stderr.write(prefix + f"in thread {thread.name}:\n")
    sys.stderr.write("".join(prefix + line + "\n" for line in text.rstrip().splitlines()))
    abort(f"uncaught {args.exc_type.__name__} in kdist's thread {thread.name} on rank "
          f"{world.rank}: {args.exc_value}")


_previous_thread_hook = threading.excepthook


def install_failure_handlers():
    """Makes an uncaught exception on any rank, in the main thread or in one of kdist's
    own threads, abort the whole job. Both hooks pass on to the ones they replace what
    is not theirs: a world of one process, and other threads."""
    global _installed, _previous_hook, _previous_thread_hook
    if _installed:
        return
    _installed = True
    _previous_hook = sys.excepthook
    sys.excepthook = _excepthook
    _previous_thread_hook = threading.excepthook
    threading.excepthook = _thread_excepthook


@contextlib.contextmanager
def waiting(what, state=WAITING):
    """Marks this thread as waiting for `what` (a collective or a message) meanwhile.

    `state`: `WAITING` for other ranks to arrive, `MOVING` a collective's data
    once they all have, `LEAVING` the job at exit.
    """
    key = threading.get_ident()
    with _waits_lock:
        previous = _waits.get(key)
        _waits[key] = (what, time.monotonic(), state)
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
    wait = current_wait_state()
    return None if wait is None else wait[:2]


def current_wait_state():
    """`(description, seconds, state)` of this process's longest wait, or None."""
    now = time.monotonic()
    with _waits_lock:
        waits = [(what, now - since, state) for what, since, state in _waits.values()]
    from kdist.comm import native

    native_wait = native.current_wait()
    if native_wait is not None:
        what, seconds = native_wait
        # The C++ engine names a payload's wait "..., moving data".
        waits.append((what, seconds, MOVING if what.endswith(", moving data") else WAITING))
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
    deadlock = _seconds("KDIST_DEADLOCK_TIMEOUT", DEFAULT_DEADLOCK_TIMEOUT)
    silence = _seconds("KDIST_PEER_TIMEOUT", DEFAULT_PEER_TIMEOUT)
    if timeout == 0 and stall == 0 and deadlock == 0 and silence == 0:
        return None
    from kdist.comm.peers import PeerStatus

    peers = PeerStatus(watch_comm, world.rank) if watch_comm is not None else None
    _monitor = _Monitor(peers, timeout, stall, deadlock, silence)
    _monitor.start()
    atexit.register(stop_monitor)
    return _monitor


DEFAULT_DEADLOCK_TIMEOUT = 300.0
DEFAULT_PEER_TIMEOUT = 120.0
# A peer counts as lost only after this many unanswered questions in a row too.
SILENT_QUESTIONS = 3


def stop_monitor():
    global _monitor
    monitor, _monitor = _monitor, None
    if monitor is not None:
        monitor.stop()


class _Monitor(threading.Thread):
    """Watches this process's waits; warns about stalls and ends stuck jobs."""

    def __init__(self, peers, timeout, stall_warning, deadlock=0.0, silence=0.0):
        super().__init__(name="kdist-watchdog", daemon=True)
        self.peers = peers
        self.timeout = timeout
        self.stall_warning = stall_warning
        self.deadlock = deadlock if peers is not None else 0.0
        self.silence = silence if peers is not None else 0.0
        # How often a waiting rank asks its peers whether they are still there.
        self.liveness_every = min(10.0, self.silence / 6)
        self._silent = {}  # rank -> (since when it has not answered, questions missed)
        self._next_liveness = 0.0
        limits = [t for t in (timeout, stall_warning, self.deadlock, self.silence) if t > 0]
        self.tick = max(0.05, min([1.0] + [t / 4 for t in limits]))
        # Another rank's wait counts as stuck once it has lasted this long.
        self.settle = min(self.deadlock, 30.0)
        self._halt = threading.Event()
        self._warned = {}
        self._suspect = None  # the wait that looked deadlocked at the last check
        self._next_check = 0.0

    def stop(self):
        self._halt.set()
        self.join(timeout=5)
        if self.peers is not None:
            self.peers.close()

    def run(self):
        while not self._halt.wait(self.tick):
            if self.peers is not None:
                self.peers.answer(self._status())
            wait = current_wait_state()
            if wait is None or wait[2] == LEAVING:
                # Ranks may end at different times: waiting for them at exit is no stall.
                self._warned.clear()
                self._suspect = None
                self._silent.clear()
                continue
            what, seconds, state = wait
            if self.silence and state == WAITING and seconds > self.liveness_every:
                self._check_liveness(what, seconds)
            if self.timeout and seconds > self.timeout:
                report = self._ask()
                abort(f"'{what}' has waited {seconds:.0f} s for the other ranks "
                      f"(KDIST_COLLECTIVE_TIMEOUT={self.timeout:g}). {report}")
            if self.deadlock and seconds > self.deadlock and state == WAITING:
                self._check_deadlock(what, seconds)
            else:
                self._suspect = None
            if self.stall_warning and seconds > self.stall_warning:
                due = self._warned.get(what, 0.0) + self.stall_warning
                if seconds >= due:
                    self._warned[what] = seconds
                    logger.warning("stall: '%s' has waited %.0f s for the other ranks. %s "
                                   "(KDIST_STALL_WARNING=%g; KDIST_DEADLOCK_TIMEOUT=%g ends "
                                   "the job once no rank can end the wait)", what, seconds,
                                   self._ask(), self.stall_warning, self.deadlock)

    def _check_deadlock(self, what, seconds):
        """Ends the job when no other rank can end this wait, seen twice in a row."""
        now = time.monotonic()
        if now < self._next_check:
            return
        answers = self.peers.ask(self._status)
        if not all(_stuck(answer, self.settle) for answer in answers.values()):
            self._suspect = None
            self._next_check = now + max(self.tick, min(self.deadlock / 2, 30.0))
            return
        if self._suspect != what:
            # Once more a moment later: a rank between two quick collectives is no deadlock.
            self._suspect = what
            self._next_check = now + max(self.tick, min(self.settle / 2, 10.0))
            return
        abort(f"'{what}' has waited {seconds:.0f} s for the other ranks, and none of them "
              f"can end the wait: a deadlock (KDIST_DEADLOCK_TIMEOUT={self.deadlock:g}). "
              f"{_describe(answers)}")

    def _heard(self, answers):
        """Notes who answered; returns the ranks silent for `silence` seconds and at least
        SILENT_QUESTIONS questions in a row."""
        now = time.monotonic()
        for rank, answer in answers.items():
            if answer is not None:
                self._silent.pop(rank, None)
            else:
                since, missed = self._silent.get(rank, (now, 0))
                self._silent[rank] = (since, missed + 1)
        return sorted(rank for rank, (since, missed) in self._silent.items()
                      if now - since >= self.silence and missed >= SILENT_QUESTIONS)

    def _check_liveness(self, what, seconds):
        """Ends the job when a peer has answered nothing for `silence` seconds."""
        now = time.monotonic()
        if now < self._next_liveness:
            return
        self._next_liveness = now + self.liveness_every
        answers = self.peers.ask(self._status)
        lost = self._heard(answers)
        if lost:
            from kdist.comm import job

            named = ", ".join(f"{rank} (host {job.host_of(rank)})" for rank in lost)
            hosts = sorted({job.host_of(rank) for rank in lost})
            abort(f"'{what}' has waited {seconds:.0f} s for the other ranks, and rank(s) "
                  f"{named} answered none of kdist's questions for {self.silence:g} s "
                  f"(KDIST_PEER_TIMEOUT): lost, with host(s) {', '.join(hosts)} down or "
                  f"unreachable, or the ranks stopped or dead. {_describe(answers)}")

    def _status(self):
        wait = current_wait_state()
        if wait is None:
            return {"state": "running"}
        return {"state": wait[2], "what": wait[0], "seconds": round(wait[1], 1)}

    def _ask(self):
        if self.peers is None:
            return ("The other ranks could not be asked (MPI does not allow calls from "
                    "several threads here).")
        return _describe(self.peers.ask(self._status))


def _stuck(answer, settle):
    """Whether another rank's answer says it cannot end a wait: no answer at all, or a
    wait for others (or at exit) that has lasted `settle` seconds."""
    if answer is None:
        return True
    if not isinstance(answer, dict):
        return False
    return answer.get("state") in (WAITING, LEAVING) and answer.get("seconds", 0) >= settle


def _words(answer):
    if not isinstance(answer, dict):
        return str(answer)
    state = answer.get("state")
    if state == "running":
        return "is running, not in a kdist collective"
    seconds = answer.get("seconds", 0)
    if state == LEAVING:
        return f"is leaving the job ({answer.get('what', '')}) ({seconds:.0f} s)"
    if state == MOVING:
        return f"is moving the data of '{answer.get('what', '')}' ({seconds:.0f} s)"
    return f"is waiting in '{answer.get('what', '')}' ({seconds:.0f} s)"


def _describe(answers):
    silent = [rank for rank, answer in answers.items() if answer is None]
    parts = [f"rank {rank} {_words(answer)}" for rank, answer in sorted(answers.items())
             if answer is not None]
    if silent:
        parts.append(f"rank(s) {silent} do not answer (stopped, hung outside Python, or "
                     "dead)")
    return "Other ranks: " + "; ".join(parts) + "." if parts else ""
