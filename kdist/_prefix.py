"""Runs one rank's command and prefixes each line of its output with the rank.

`kdist run` starts this file (by path, so that it imports nothing heavy) on
every rank: `python _prefix.py -- COMMAND ...`. The command inherits the MPI
launcher's environment, so it is the MPI process; this wrapper only relays its
output and its exit status (a rank killed by a signal still fails the job).
"""

import os
import subprocess
import sys

RANK_VARIABLES = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID")


def main(argv):
    command = argv[1:] if argv and argv[0] == "--" else argv
    if not command:
        sys.stderr.write("usage: _prefix.py -- COMMAND [ARGS]\n")
        return 2
    rank = next((os.environ[v] for v in RANK_VARIABLES if v in os.environ), "0")
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    tag = f"[{rank}] ".encode()
    start_of_line = True
    out = sys.stdout.buffer
    while True:
        chunk = os.read(process.stdout.fileno(), 65536)
        if not chunk:
            break
        pieces = []
        # Progress bars redraw with '\r'; each redrawn line gets the tag too.
        for piece in chunk.splitlines(keepends=True):
            if start_of_line:
                pieces.append(tag)
            pieces.append(piece)
            start_of_line = piece.endswith((b"\n", b"\r"))
        out.write(b"".join(pieces))
        out.flush()
    code = process.wait()
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
