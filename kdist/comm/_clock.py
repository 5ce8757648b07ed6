"""A small process that ends a rank, or the job's launcher, when they outstay their time.

A rank starts it by path (`python -I _clock.py ...`, so that it imports nothing of
kdist's and runs while the rank itself is stuck in MPI or has already left):

- the start-up clock (`kdist.comm.processes`): after `--after` seconds, unless its
  parent has gone (kdist.init() done, the clock cancelled), it writes `--message` to
  standard error and `--record` to standard output (for `kdist run`), kills the rank
  (`--kill-parent`) and, under a plain fault-tolerant launcher, ends the launcher.
- the end of an elastic job that lost ranks (`kdist.comm.ending`): the survivors end
  the job with MPI_Abort(0), and Open MPI's launcher then waits for a daemon on a host
  it cannot reach; this clock gives it `--launcher-grace` seconds to end on its own.
- the end of any fault-tolerant rank (`kdist.comm.ending`): it kills the rank if its
  exit (MPI_Finalize) outlasts `--after` seconds.

Ending a launcher: SIGTERM, and SIGKILL 10 s later if it is still there (told to end,
Open MPI's launcher still waits for a daemon it cannot reach).
"""

import argparse
import os
import signal
import sys
import time

LAUNCHERS = ("prterun", "prted", "mpirun", "mpiexec", "orterun", "orted")
HEAD_LAUNCHERS = ("prterun", "mpirun", "mpiexec", "orterun")


def launcher_above(pid, names=LAUNCHERS):
    """The launcher process above `pid` (Linux's /proc), or None: the job's head launcher
    (`prterun`, `mpirun`, ...) if it is an ancestor, else the nearest of `names` (the
    host's daemon, `prted`). Ending the head ends the job even when a daemon it waits
    for cannot be reached; ending a daemon leaves that to the head."""
    found = []
    while pid > 1:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                # The parent is the second field after the command's closing parenthesis.
                pid = int(stat.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/comm") as comm:
                name = comm.read().strip()
        except (OSError, IndexError, ValueError):
            break
        if name in HEAD_LAUNCHERS and name in names:
            return pid
        if name in names:
            found.append(pid)
    return found[0] if found else None


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _wait_gone(pid, seconds):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.2)
    return not _alive(pid)


def _say(text, to=None):
    """Writes `text` on standard error, or on that of process `to` (a clock that must not
    hold the rank's output open: the launcher waits for it to close)."""
    if not text:
        return
    try:
        if to is None:
            sys.stderr.write(text + "\n")
            sys.stderr.flush()
        else:
            with open(f"/proc/{to}/fd/2", "a") as stream:
                stream.write(text + "\n")
    except OSError:  # nobody reads it any more; the clock's work goes on
        pass


def start(after=0.0, message="", record="", kill_parent=False, launcher=None,
          launcher_grace=0.0, launcher_message="", speak_through_parent=False, quiet=True,
          own_session=False):
    """Starts a clock for the calling process (see the module's text); returns its Popen.

    `quiet`: the clock holds none of the caller's output (it writes only through
    `speak_through_parent` or to the launcher's); `own_session`: the launcher's end of
    the caller's process group does not reach it."""
    import subprocess

    argv = [sys.executable, "-I", os.path.abspath(__file__), "--parent", str(os.getpid()),
            "--after", str(after), "--message", message, "--record", record,
            "--launcher", str(launcher or 0), "--launcher-grace", str(launcher_grace),
            "--launcher-message", launcher_message]
    argv += ["--kill-parent"] if kill_parent else []
    argv += ["--speak-through-parent"] if speak_through_parent else []
    output = subprocess.DEVNULL if quiet else None
    return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=output, stderr=output,
                            start_new_session=own_session)


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--parent", type=int, required=True)
    parser.add_argument("--after", type=float, default=0.0)
    parser.add_argument("--message", default="")
    parser.add_argument("--record", default="")
    parser.add_argument("--kill-parent", action="store_true")
    parser.add_argument("--launcher", type=int, default=0)
    parser.add_argument("--launcher-grace", type=float, default=0.0)
    parser.add_argument("--launcher-message", default="")
    parser.add_argument("--speak-through-parent", action="store_true")
    args = parser.parse_args(argv)
    deadline = time.monotonic() + args.after
    while time.monotonic() < deadline:
        time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
        if os.getppid() != args.parent:
            return 0  # the rank went on (cancelled) or is gone
    _say(args.message, to=args.parent if args.speak_through_parent else None)
    if args.record:
        os.write(1, args.record.encode() + b"\n")
    # Let go of the rank's output: its launcher waits for that to close before it ends
    # the job, and the clock may outlive the rank by the launcher's grace.
    sys.stdout.flush()
    sys.stderr.flush()
    quiet = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(quiet, fd)
    if args.kill_parent:
        try:
            os.kill(args.parent, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if not args.launcher or _wait_gone(args.launcher, args.launcher_grace):
        return 0
    _say(args.launcher_message, to=args.launcher)
    try:
        os.kill(args.launcher, signal.SIGTERM)
        if not _wait_gone(args.launcher, 10.0):
            os.kill(args.launcher, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
