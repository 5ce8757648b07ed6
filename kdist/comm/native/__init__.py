"""kdist's C++ collectives: TensorFlow ops and their XLA lowerings, built on first use.

Calling MPI from a py-function op costs a trip through Python and the GIL in
every step, and XLA cannot compile a py-function at all. `KdistAllreduce`,
`KdistAllgather` and `KdistBroadcast` run kdist's collective engine
(engine.cc, the same wire protocol as `kdist.comm.protocol`) inside the
graph; xla.cc lowers them to XLA custom calls, so a train step compiled with
`jit_compile=True` keeps its collectives. `KdistAllreduceAsync` hands one
tensor to the fusion queue (fusion.cc), which fuses separate allreduces that a
`tf.function` issues close together.

Both libraries are compiled once per TensorFlow and MPI installation with the
MPI C++ compiler wrapper (`mpicxx`) into a cache directory (`KDIST_CACHE`, by
default `~/.cache/kdist`): the ops (about 15 s) when a collective first runs
in a graph, the XLA lowering (about a minute; XLA's headers are large) when a
function compiled with XLA first uses one. When the ops cannot be built (no
compiler, no MPI headers, another MPI library than mpi4py's) kdist says why
once and uses py-function ops, which XLA cannot compile. `KDIST_NATIVE_OPS=0`
turns the native ops off (read whenever a graph is built). Once loaded, the ops write
the crashing thread's native backtrace when the process crashes (engine.cc;
`KDIST_NATIVE_BACKTRACE=0` turns that off).

The op module that `load()` returns holds:

- `kdist_allreduce(tensors, comm, reduce_op=1, average=False, prescale=1.0,
  postscale=1.0, direct_bytes=262144, label="")`: one fused allreduce of a list of
  tensors of one dtype. `comm` is a `Communicator.fortran_handle`; `reduce_op` is 1
  (sum), 2 (min), 3 (max) or 4 (product); with `average` the sum is divided by the
  ranks that contributed. Tensors of `direct_bytes` or more are reduced in place, the
  others packed into one buffer.
- `kdist_allgather(tensor, comm, size=1, label="")`, `kdist_broadcast(tensor, comm,
  root=0, label="")`;
- `kdist_allreduce_async(tensor, comm, ...)`: one tensor through the fusion queue;
- `kdist_mpi_library()`: the MPI library version the ops were built against.
"""

import ctypes
import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import threading
import time

logger = logging.getLogger(__name__)

HERE = os.path.dirname(os.path.abspath(__file__))
OPS_SOURCES = ("engine.h", "engine.cc", "fusion.h", "fusion.cc", "ring.h", "ring.cc",
               "ops.cc")
XLA_SOURCES = ("xla.cc", "shim/farmhash.h", "shim/highwayhash/arch_specific.h",
               "shim/highwayhash/hh_types.h", "shim/highwayhash/highwayhash.h")

_lock = threading.Lock()
_ops = None
_ops_failure = None
_ops_library = None
_xla_loaded = False
_xla_failure = None
_wait_reader = None
_timeline_mode = 0


def _mpicxx():
    beside = os.path.join(os.path.dirname(sys.executable), "mpicxx")
    if os.access(beside, os.X_OK):
        return beside
    return shutil.which("mpicxx") or shutil.which("mpic++")


def _cache_dir():
    return os.environ.get("KDIST_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                         "kdist")


def _key(tf, compiler, flags, sources):
    digest = hashlib.sha256()
    for name in sources:
        with open(os.path.join(HERE, name), "rb") as f:
            digest.update(f.read())
    for part in (tf.__version__, compiler, " ".join(flags), sysconfig.get_platform()):
        digest.update(part.encode() + b"\0")
    return digest.hexdigest()[:16]


def _compile(library, command, what):
    """Runs `command` (which writes `partial`) unless `library` exists; one rank builds."""
    os.makedirs(os.path.dirname(library), exist_ok=True)
    with open(library + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.exists(library):
            return
        partial = f"{library}.{os.getpid()}.partial"
        logger.info("building %s (once per installation)", what)
        started = time.monotonic()
        done = subprocess.run(command + ["-o", partial], capture_output=True, text=True,
                              timeout=1800, cwd=HERE)
        if done.returncode != 0:
            raise RuntimeError(f"compiling {what} failed:\n" + done.stderr[-3000:])
        os.replace(partial, library)
        logger.info("built %s in %.0f s", what, time.monotonic() - started)


def _tf_flags(tf):
    # KDIST_NATIVE_CXXFLAGS: more compiler flags, such as a sanitizer's
    # (benchmarks/sanitizers.py); they are part of the cached library's key.
    extra = os.environ.get("KDIST_NATIVE_CXXFLAGS", "").split()
    return tf.sysconfig.get_compile_flags() + tf.sysconfig.get_link_flags() + extra


def _build_ops(tf):
    compiler = _mpicxx()
    if compiler is None:
        raise RuntimeError("no MPI C++ compiler wrapper (mpicxx) found")
    flags = _tf_flags(tf)
    key = _key(tf, compiler, flags, OPS_SOURCES)
    name = f"libkdist_ops_{key}.so"
    library = os.path.join(_cache_dir(), "ops", name)
    _compile(library, [compiler, "-O3", "-shared", "-fPIC", "-w", "engine.cc", "fusion.cc",
                       "ring.cc", "ops.cc", f"-Wl,-soname,{name}"] + flags,
             "kdist's collective ops")
    return library


def _build_xla(tf, ops_library):
    headers = os.path.join(tf.sysconfig.get_include(), "xla", "ffi", "api", "ffi.h")
    if not os.path.exists(headers):
        # XLA's typed FFI, which the lowering is written against, ships with
        # TensorFlow's headers from 2.20 on.
        raise RuntimeError(f"this TensorFlow ({tf.__version__}) ships no XLA FFI headers "
                           "(xla/ffi/api/ffi.h); kdist's XLA lowering needs TensorFlow 2.20 "
                           "or newer, the versions kdist supports (kdist info).")
    compiler = _mpicxx()
    flags = _tf_flags(tf)
    key = _key(tf, compiler, flags + [ops_library], XLA_SOURCES + OPS_SOURCES)
    library = os.path.join(_cache_dir(), "ops", f"libkdist_xla_{key}.so")
    tf_dir = os.path.dirname(tf.__file__)
    _compile(library, [compiler, "-O1", "-shared", "-fPIC", "-w", "-Ishim", "xla.cc",
                       ops_library, f"-Wl,-rpath,{os.path.dirname(ops_library)}"] + flags
             + [f"-L{tf_dir}", "-l:libtensorflow_cc.so.2"], "kdist's XLA lowering")
    return library


DISABLED = "disabled by KDIST_NATIVE_OPS"


def _disabled():
    """Read at each use, not once: a process may build graphs before and after a change."""
    return os.environ.get("KDIST_NATIVE_OPS", "1").lower() in ("0", "false", "no")


def load():
    """The op module, building it on first use (about 15 s); None when the ops cannot be
    used here.

    That is when there is no `mpicxx`, no MPI headers, the ops were built for another MPI
    library than mpi4py's, or `KDIST_NATIVE_OPS=0`; `failure()` then says why, and kdist
    logs it once. Ranks that start together wait for one build.
    """
    global _ops, _ops_failure, _ops_library
    if _disabled():
        return None
    if _ops is not None or _ops_failure is not None:
        return _ops
    with _lock:
        if _ops is not None or _ops_failure is not None:
            return _ops
        import tensorflow as tf

        try:
            library = _build_ops(tf)
            from mpi4py import MPI

            module = tf.load_op_library(library)
            built_for = _run_eagerly(tf, module.kdist_mpi_library).decode()
            if built_for.strip() != MPI.Get_library_version().strip():
                raise RuntimeError(f"the ops were built for {built_for.splitlines()[0]!r} but "
                                   f"mpi4py uses {MPI.Get_library_version().splitlines()[0]!r}")
            _ops, _ops_library = module, library
            if _timeline_mode:
                _timeline_function("kdist_timeline_record")(_timeline_mode)
        except Exception as error:  # any failure here only costs speed
            _ops_failure = str(error)
            logger.warning("kdist's C++ collectives are not available (%s); using py-function "
                           "ops, which are slower and cannot run under XLA.",
                           _ops_failure.splitlines()[0])
    return _ops


def _run_eagerly(tf, op):
    """The value of a no-input op, wherever load() is called from: while a train step is
    traced (init_scope leaves the function), or inside a TensorFlow 1 graph (where it
    does not reach eager mode, so a graph and session of its own run the op)."""
    with tf.init_scope():
        if tf.executing_eagerly():
            return op().numpy()
        with tf.Graph().as_default() as graph, tf.compat.v1.Session(graph=graph) as session:
            return session.run(op())


def load_xla():
    """Builds (about a minute, once per installation) and loads the XLA lowering.

    kdist calls it when it traces a collective inside a function compiled with XLA.
    Raises `RuntimeError`, saying why and to compile with `jit_compile=False`, when
    that is impossible here (the ops are not available, or the lowering does not
    build).
    """
    global _xla_loaded, _xla_failure
    if _xla_loaded:
        return
    if load() is None:
        raise RuntimeError(
            "kdist's collectives cannot run inside a function compiled with XLA here: its "
            f"C++ ops are not available ({failure()}). Compile the model with "
            "jit_compile=False, or install an MPI C++ compiler (mpicxx).")
    with _lock:
        if _xla_loaded:
            return
        if _xla_failure is None:
            import tensorflow as tf

            try:
                tf.load_op_library(_build_xla(tf, _ops_library))
                _xla_loaded = True
                return
            except Exception as error:
                _xla_failure = str(error)
        raise RuntimeError(
            "kdist could not build its XLA lowering, so its collectives cannot run inside a "
            "function compiled with XLA. Compile the model with jit_compile=False. Reason: "
            + _xla_failure)


def failure():
    """Why the native ops are not used, or None."""
    return DISABLED if _disabled() else _ops_failure


def library_path():
    return _ops_library


def current_wait():
    """`(description, seconds)` while a C++ collective waits in this process, else None."""
    global _wait_reader
    if _ops_library is None:
        return None
    if _wait_reader is None:
        function = ctypes.CDLL(_ops_library).kdist_native_wait
        function.restype = ctypes.c_int64
        function.argtypes = [ctypes.c_char_p, ctypes.c_int64]
        _wait_reader = function
    text = ctypes.create_string_buffer(512)
    since = _wait_reader(text, 512)
    if since == 0:
        return None
    seconds = time.clock_gettime_ns(time.CLOCK_MONOTONIC) - since
    return text.value.decode(errors="replace"), seconds / 1e9


def retire_fusion_queue(fortran_handle):
    """Ends the fusion queue of a communicator about to be freed (no-op without one).

    MPI hands a freed communicator's handle to the next one it creates; without this,
    a new world after `kdist.shutdown()` and `kdist.init()`, or a process set made
    after one was removed, would reach the old queue with its old size and settings.
    """
    if _ops_library is None or fortran_handle is None:
        return
    _c_function("kdist_fusion_retire", None, [ctypes.c_int64])(int(fortran_handle))


def rebind_communicator(old_handle, new_handle):
    """Makes the ops built with communicator `old_handle` run on `new_handle` from now on
    (a fault-tolerant job's world after ranks were lost): a traced step goes on with the
    survivors. A no-op before the ops load, when no op can hold the old handle."""
    if _ops_library is None or old_handle is None or new_handle is None:
        return
    _c_function("kdist_comm_rebind", None, [ctypes.c_int64, ctypes.c_int64])(
        int(old_handle), int(new_handle))


def forget_communicator(fortran_handle):
    """Drops what `rebind_communicator` recorded for a communicator about to be freed,
    whose handle MPI may give to the next one it creates."""
    if _ops_library is None or fortran_handle is None:
        return
    _c_function("kdist_comm_forget", None, [ctypes.c_int64])(int(fortran_handle))


def fusion_queue_count():
    """How many communicators have a live fusion queue in this process (0 before the ops load)."""
    if _ops_library is None:
        return 0
    return int(_c_function("kdist_fusion_queue_count", ctypes.c_int64, [])())


def _c_function(name, restype, argtypes):
    """One of the ops library's plain C functions, typed."""
    function = getattr(ctypes.CDLL(_ops_library), name)
    function.restype, function.argtypes = restype, argtypes
    return function


def _timeline_function(name):
    if name == "kdist_timeline_record":
        return _c_function(name, None, [ctypes.c_int64])
    return _c_function(name, ctypes.c_int64, [ctypes.c_char_p, ctypes.c_int64])


def set_timeline_mode(mode):
    """0: the C++ collectives record nothing; 1: they record their phases; 2: and cycles.

    Applies now if the ops are loaded, and when they load otherwise.
    """
    global _timeline_mode
    _timeline_mode = int(mode)
    if _ops_library is not None:
        _timeline_function("kdist_timeline_record")(_timeline_mode)


def take_timeline_lines():
    """The phases the C++ collectives recorded since the last call, as text lines."""
    if _ops_library is None:
        return ""
    take = _timeline_function("kdist_timeline_take")
    chunks = []
    while True:
        waiting = take(None, 0)
        if waiting <= 0:
            break
        buffer = ctypes.create_string_buffer(waiting)
        moved = take(buffer, waiting)
        chunks.append(buffer.raw[:moved].decode(errors="replace"))
        if moved == 0:
            break
    return "".join(chunks)
