"""The processes a launcher leaves behind when it exits, and ending them.

A launcher that exits does not always take everything it started with it. When a host
drops off the network, Open MPI's launcher may give up on the job and exit while the
remote-shell client it started for that host waits on a dead connection (as long as TCP
retries, 15 minutes), and it may leave one of its own host's ranks running. Both hold
`kdist run`'s output open, so a `kdist run ... | tee log` would wait for them, and a rank
left running takes a core that the next job expects to have.

`kdist run` makes itself the subreaper of what it starts (Linux's
PR_SET_CHILD_SUBREAPER): a process whose parent exits is then adopted by `kdist run`
rather than by init, so that once the launcher has exited, whatever is still below
`kdist run` is what the launcher left behind. Elsewhere only what `descendants` found
while the launcher still ran can be ended.
"""

import contextlib
import ctypes
import os
import signal
import sys
import time

_PR_SET_CHILD_SUBREAPER = 36


def become_subreaper():
    """Makes this process adopt the orphans among its descendants. Returns whether it
    could (Linux only)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _parents():
    """Each process's parent, from /proc (nothing where there is none)."""
    parents = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                # The parent is the second field after the command's closing parenthesis;
                # the state, the first, is Z for a process that ended and awaits its parent.
                state, parent = stat.read().rsplit(")", 1)[1].split()[:2]
        except (OSError, IndexError, ValueError):
            continue
        if state != "Z":
            parents[int(entry)] = int(parent)
    return parents


def descendants(pid):
    """The live processes below `pid`, parents before their children."""
    children = {}
    for child, parent in _parents().items():
        children.setdefault(parent, []).append(child)
    found, waiting = [], [pid]
    while waiting:
        for child in sorted(children.get(waiting.pop(0), [])):
            found.append(child)
            waiting.append(child)
    return found


def name(pid):
    """The program `pid` runs, as `ps` shows it; '?' once it has ended."""
    try:
        with open(f"/proc/{pid}/comm") as comm:
            return comm.read().strip() or "?"
    except OSError:
        return "?"


# kdist's own clocks (kdist/comm/_clock.py), which a rank leaves to watch its exit or its
# launcher and which end by themselves soon after: not worth a word when ended.
_CLOCK = os.path.realpath(os.path.join(os.path.dirname(__file__), "comm", "_clock.py"))


def is_kdist_clock(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            arguments = cmdline.read().decode(errors="replace").split("\0")
        working = os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return False
    return any(os.path.basename(a) == "_clock.py"
               and os.path.realpath(os.path.join(working, a)) == _CLOCK for a in arguments)


def end(pids, grace=3.0):
    """Ends `pids`: SIGTERM (a rank's wrapper passes it on, a remote shell closes), then
    SIGKILL for whatever still runs `grace` seconds later. Reaps those that are this
    process's children (adopted orphans), so that none is left a zombie."""
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while True:
        _reap(pids)
        alive = _alive(pids)
        if not alive or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    for pid in alive:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    time.sleep(0.1 if alive else 0)
    _reap(pids)


def _reap(pids):
    for pid in pids:
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, os.WNOHANG)


def _alive(pids):
    if os.path.isdir("/proc"):
        running = _parents()
        return [pid for pid in pids if pid in running]
    alive = []
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, 0)
            alive.append(pid)
    return alive
