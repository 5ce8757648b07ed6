"""Files written whole or not at all."""

import os
import tempfile


def write_atomically(path, write, binary=True, suffix=""):
    """Calls `write(stream)` on a temporary file beside `path`, then puts it in
    `path`'s place: a crash mid-write leaves the previous file, never a torn one."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=".kdist-partial-", suffix=suffix, dir=directory)
    try:
        with os.fdopen(handle, "wb" if binary else "w") as stream:
            write(stream)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise
