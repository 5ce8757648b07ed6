"""A TensorFlow op that allreduces gradients in C++, built on first use.

Calling MPI from a py-function op costs a trip through Python and the GIL in
every step. `KdistAllreduce` does the same work (and speaks the same protocol
as `FusedReducer` without compression, so `join` still works) inside the
graph. It is compiled once per TensorFlow and MPI installation with the MPI
C++ compiler wrapper (`mpicxx`) into a cache directory (`KDIST_CACHE`, by
default `~/.cache/kdist`). When that is not possible (no compiler, no MPI
headers, another MPI library than mpi4py's) kdist says why once and uses the
py-function path. `KDIST_NATIVE_OPS=0` turns it off.
"""

import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import sysconfig

logger = logging.getLogger(__name__)

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "allreduce_op.cc")

_loaded = None
_failure = None


def _mpicxx():
    beside = os.path.join(os.path.dirname(sys.executable), "mpicxx")
    if os.access(beside, os.X_OK):
        return beside
    return shutil.which("mpicxx") or shutil.which("mpic++")


def _cache_dir():
    return os.environ.get("KDIST_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                         "kdist")


def _build(tf):
    compiler = _mpicxx()
    if compiler is None:
        raise RuntimeError("no MPI C++ compiler wrapper (mpicxx) found")
    flags = tf.sysconfig.get_compile_flags() + tf.sysconfig.get_link_flags()
    with open(SOURCE, "rb") as f:
        source = f.read()
    key = hashlib.sha256(b"\0".join([source, tf.__version__.encode(), compiler.encode(),
                                     " ".join(flags).encode(),
                                     sysconfig.get_platform().encode()])).hexdigest()[:16]
    directory = os.path.join(_cache_dir(), "ops")
    os.makedirs(directory, exist_ok=True)
    library = os.path.join(directory, f"kdist_allreduce_{key}.so")
    # Several ranks may start at once: one builds, the others wait for it.
    with open(library + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(library):
            partial = f"{library}.{os.getpid()}.partial"
            command = [compiler, "-O3", "-shared", "-fPIC", "-w", SOURCE, "-o", partial] + flags
            logger.info("building kdist's allreduce op (once per installation)")
            done = subprocess.run(command, capture_output=True, text=True, timeout=600)
            if done.returncode != 0:
                raise RuntimeError("compiling the allreduce op failed:\n" + done.stderr[-2000:])
            os.replace(partial, library)
    return library


def load():
    """The loaded op module, or None when the native op cannot be used here."""
    global _loaded, _failure
    if _loaded is not None or _failure is not None:
        return _loaded
    if os.environ.get("KDIST_NATIVE_OPS", "1") in ("0", "false", "no"):
        _failure = "disabled by KDIST_NATIVE_OPS"
        return None
    import tensorflow as tf

    try:
        library = _build(tf)
        from mpi4py import MPI

        module = tf.load_op_library(library)
        with tf.init_scope():  # load() may be called while a train step is traced
            built_for = module.kdist_mpi_library().numpy().decode()
        if built_for.strip() != MPI.Get_library_version().strip():
            raise RuntimeError(f"the op was built for {built_for.splitlines()[0]!r} but "
                               f"mpi4py uses {MPI.Get_library_version().splitlines()[0]!r}")
        _loaded = module
    except Exception as error:  # any failure here only costs speed
        _failure = str(error)
        logger.warning("kdist's C++ allreduce op is not available (%s); using the "
                       "py-function path, which is slower.", _failure.splitlines()[0])
    return _loaded


def failure():
    """Why the native op is not used, or None."""
    return _failure
