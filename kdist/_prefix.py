"""Runs one rank's command and prefixes each line of its output with the rank.

`kdist run` starts this file (by path, so that it imports nothing heavy) on
every rank: `python _prefix.py -- COMMAND ...`. The command inherits the MPI
launcher's environment, so it is the MPI process; this wrapper only relays its
output and its exit status (a rank killed by a signal still fails the job).
`kdist launch` relays its TensorFlow workers' output with `relay` too.

Rank 0's output passes through untagged, so that its progress bar redraws in
place; every other rank's lines start with `[rank] `. When `kdist run`'s own
output is not a terminal (KDIST_TTY=0: a log file, a pipe), colour codes
are removed, so that logs read as plain text.

TensorFlow's start-up lines (absl's notice, oneDNN, CUDA stubs, CPU
features), which every rank would print, are dropped unless KDIST_VERBOSE
is set (`kdist run -v`).

With KDIST_RUN_TOKEN set (by `kdist run`), the wrapper also writes one line
when the command starts and one when it ends, with the rank, the host and how
it ended; `kdist run` takes those lines out of the output and, from them,
tells which ranks ended cleanly (kdist/_rank_ends.py). A rank whose host
vanished writes no end line, whatever the launcher's exit status says.
Signals the launcher sends to end the job (SIGTERM, SIGINT, SIGHUP, SIGUSR1,
SIGUSR2) are passed on to the command, so that its end is still reported.
"""

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys

RANK_VARIABLES = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID")

# Whole lines only: anything else TensorFlow says (errors included) passes.
START_UP_NOISE = re.compile(
    rb"(WARNING: All log messages before absl::InitializeLog\(\) is called are written to "
    rb"STDERR"
    rb"|[IW]\d{4} [\d:.]+ +\d+ (port|cudart_stub|cpu_feature_guard|cuda_dnn|cuda_fft|cuda_blas"
    rb"|cuda_executor|computation_placer)\.cc:\d+\] .*"
    rb"|E\d{4} [\d:.]+ +\d+ cuda_platform\.cc:\d+\] failed call to cuInit: .*"
    rb"|To enable the following instructions: .* rebuild TensorFlow with the appropriate "
    rb"compiler flags\.)\r?\n")

# Select Graphic Rendition sequences only: colours and bold, as Keras's progress bar writes.
COLOUR = re.compile(rb"\x1b\[[0-9;]*m")
UNFINISHED_COLOUR = re.compile(rb"(\x1b(\[[0-9;]{0,16})?)?\Z")


def quiet():
    """The noise filter `relay` applies: START_UP_NOISE unless KDIST_VERBOSE is set."""
    return None if os.environ.get("KDIST_VERBOSE") else START_UP_NOISE


def relay(fd, tag, out, lock=None, drop=None, plain=False, untagged=None):
    """Copies everything readable from `fd` to `out`, with `tag` at each line start.

    With a `lock` (several relays writing to one `out`), only whole lines are
    written, so that two processes' lines never run into each other; a
    trailing partial line comes out when the stream ends. Whole lines that
    the regular expression `drop` matches are left out; with `plain`, colour
    codes are removed. Lines that start with `untagged` (the run's records,
    which `kdist run` takes out) get no tag.
    """
    start_of_line = True
    held = b""
    while True:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        chunk = held + chunk
        if lock is not None:
            whole = max(chunk.rfind(b"\n"), chunk.rfind(b"\r")) + 1
        elif plain:
            # Hold back a colour code the read cut in two, until its end arrives.
            whole = UNFINISHED_COLOUR.search(chunk).start()
        else:
            whole = len(chunk)
        chunk, held = chunk[:whole], chunk[whole:]
        start_of_line = _write(out, tag, chunk, start_of_line, lock, drop, plain, untagged)
    _write(out, tag, held, start_of_line, lock, drop, plain, untagged)


def _write(out, tag, chunk, start_of_line, lock, drop=None, plain=False, untagged=None):
    """Writes `chunk` tagged; returns whether the output now stands at a line start."""
    if plain:
        chunk = COLOUR.sub(b"", chunk)
    if not chunk:
        return start_of_line
    pieces = []
    # Progress bars redraw with '\r'; each redrawn line gets the tag too.
    for piece in chunk.splitlines(keepends=True):
        if start_of_line and drop is not None and drop.fullmatch(piece):
            continue
        # A bare carriage return (after backspaces, as Keras redraws a bar) only
        # moves the cursor: tagging it too would leave "[0] [0] ..." in logs.
        if (tag and start_of_line and (not piece.endswith(b"\r") or piece.strip(b"\r\x08"))
                and not (untagged and piece.startswith(untagged))):
            pieces.append(tag)
        pieces.append(piece)
        start_of_line = piece.endswith((b"\n", b"\r"))
    with lock or contextlib.nullcontext():
        out.write(b"".join(pieces))
        out.flush()
    return start_of_line


TOKEN_VARIABLE = "KDIST_RUN_TOKEN"
FORWARDED_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1", "SIGUSR2")


def record_marker(token):
    """What starts each of the wrapper's start and end lines for the run with `token`."""
    return f"\x1ekdist-run:{token}:".encode()


def _line(token, event, fields):
    text = " ".join([event] + [f"{name}={value}" for name, value in fields.items()])
    return record_marker(token) + text.encode()


def write_record(token, event, **fields):
    """One whole line, `<marker><event> name=value ...`, in a single write to standard output."""
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), _line(token, event, fields) + b"\n")


def record_text(event, **fields):
    """The line (without its end) `tell_run` would write now, for a process that writes it
    later; "" outside `kdist run`."""
    token = os.environ.get(TOKEN_VARIABLE)
    return _line(token, event, fields).decode() if token else ""


def launcher_rank(environ=None):
    """This process's rank as its launcher numbered it (a replacement's: the rank it
    took over, from KDIST_RANK_TAG), as a string; "0" outside a launcher."""
    environ = os.environ if environ is None else environ
    return next((environ[v] for v in ("KDIST_RANK_TAG",) + RANK_VARIABLES if v in environ),
                "0")


def tell_run(event, **fields):
    """Writes a record for `kdist run` from the rank's own process (the wrapper passes
    it on untagged); nothing outside `kdist run`."""
    token = os.environ.get(TOKEN_VARIABLE)
    if token:
        write_record(token, event, **fields)


def _pass_on_signals(process):
    def forward(number, frame):
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(number)

    for name in FORWARDED_SIGNALS:
        with contextlib.suppress(OSError, ValueError):
            signal.signal(getattr(signal, name), forward)


def main(argv):
    command = argv[1:] if argv and argv[0] == "--" else argv
    if not command:
        sys.stderr.write("usage: _prefix.py -- COMMAND [ARGS]\n")
        return 2
    # A rank spawned to replace a lost one is rank 0 of its own MPI job; its
    # rank in the job it joins comes in KDIST_RANK_TAG.
    rank = launcher_rank()
    # So that an elastic job can start its replacements through this wrapper too.
    env = dict(os.environ, KDIST_PREFIXER=os.path.abspath(__file__))
    # close_fds=False: the command inherits what the launcher handed this
    # process (MPICH's Hydra and srun's PMI-2 pass a socket in PMI_FD); the
    # descriptors Python opened itself are not inheritable anyway.
    token = os.environ.get(TOKEN_VARIABLE, "")
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               env=env, close_fds=False)
    host = socket.gethostname()
    if token:
        _pass_on_signals(process)
        write_record(token, "start", rank=rank, host=host, pid=process.pid)
    tag = b"" if rank == "0" else f"[{rank}] ".encode()
    relay(process.stdout.fileno(), tag, sys.stdout.buffer, drop=quiet(),
          plain=os.environ.get("KDIST_TTY") == "0",
          untagged=record_marker(token) if token else None)
    code = process.wait()
    if token:
        write_record(token, "end", rank=rank, host=host, pid=process.pid, code=code)
    if code < 0:
        # Die of the same signal: under fault tolerance the launcher then treats
        # this rank as failed and lets the others go on, whereas an exit status
        # of 128 + signal would end the job.
        with contextlib.suppress(OSError, ValueError):  # SIGKILL cannot be handled
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
