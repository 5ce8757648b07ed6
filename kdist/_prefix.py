"""Runs one rank's command and prefixes each line of its output with the rank.

`kdist run` starts this file (by path, so that it imports nothing heavy) on
every rank: `python _prefix.py -- COMMAND ...`. The command inherits the MPI
launcher's environment, so it is the MPI process; this wrapper only relays its
output and its exit status (a rank killed by a signal still fails the job).
`kdist launch` relays its TensorFlow workers' output with `relay` too.
"""

import contextlib
import os
import signal
import subprocess
import sys

RANK_VARIABLES = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID")


def relay(fd, tag, out, lock=None):
    """Copies everything readable from `fd` to `out`, with `tag` at each line start.

    With a `lock` (several relays writing to one `out`), only whole lines are
    written, so that two processes' lines never run into each other; a
    trailing partial line comes out when the stream ends.
    """
    start_of_line = True
    held = b""
    while True:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        if lock is not None:
            chunk = held + chunk
            whole = max(chunk.rfind(b"\n"), chunk.rfind(b"\r")) + 1
            chunk, held = chunk[:whole], chunk[whole:]
        _write(out, tag, chunk, start_of_line, lock)
        if chunk:
            start_of_line = chunk.endswith((b"\n", b"\r"))
    _write(out, tag, held, start_of_line, lock)


def _write(out, tag, chunk, start_of_line, lock):
    if not chunk:
        return
    pieces = []
    # Progress bars redraw with '\r'; each redrawn line gets the tag too.
    for piece in chunk.splitlines(keepends=True):
        if start_of_line:
            pieces.append(tag)
        pieces.append(piece)
        start_of_line = piece.endswith((b"\n", b"\r"))
    with lock or contextlib.nullcontext():
        out.write(b"".join(pieces))
        out.flush()


def main(argv):
    command = argv[1:] if argv and argv[0] == "--" else argv
    if not command:
        sys.stderr.write("usage: _prefix.py -- COMMAND [ARGS]\n")
        return 2
    # A rank spawned to replace a lost one is rank 0 of its own MPI job; its
    # rank in the job it joins comes in KDIST_RANK_TAG.
    rank = next((os.environ[v] for v in ("KDIST_RANK_TAG",) + RANK_VARIABLES
                 if v in os.environ), "0")
    # So that an elastic job can start its replacements through this wrapper too.
    env = dict(os.environ, KDIST_PREFIXER=os.path.abspath(__file__))
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               env=env)
    relay(process.stdout.fileno(), f"[{rank}] ".encode(), sys.stdout.buffer)
    code = process.wait()
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
