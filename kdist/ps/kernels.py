"""Fused loops for the master's EASGD and GEM rules, compiled on first use.

`kernels.cc` is built once per installation into kdist's cache (like the
collective ops, `kdist.comm.native`) and called through ctypes on numpy
buffers. Where it cannot be built (no compiler), the rules fall back to
their numpy forms in `kdist.ps.algorithms`, which give the same values and
stream the model through memory several times more; kdist says so once.
`KDIST_NATIVE_KERNELS=0` turns the loops off.
"""

import ctypes
import hashlib
import logging
import os
import threading

import numpy as np

logger = logging.getLogger(__name__)

_SOURCE = "kernels.cc"
_FLAGS = ["-O3", "-fno-math-errno", "-fopenmp-simd", "-shared", "-fPIC"]
_lock = threading.Lock()
_loops = None
_failure = None


def _build():
    from kdist.comm import native

    compiler = native._mpicxx()
    if compiler is None:
        raise RuntimeError("no C++ compiler wrapper (mpicxx) found")
    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, _SOURCE), "rb") as f:
        key = hashlib.sha256(f.read() + " ".join([compiler] + _FLAGS).encode())
    path = os.path.join(native._cache_dir(), "ops", f"libkdist_ps_{key.hexdigest()[:16]}.so")
    native._compile(path, [compiler] + _FLAGS + [os.path.join(here, _SOURCE)],
                    "kdist's parameter-server loops")
    loops = ctypes.CDLL(path)
    pointer, size, single = ctypes.c_void_p, ctypes.c_long, ctypes.c_float
    loops.kdist_easgd.argtypes = [pointer, pointer, pointer, size, single]
    loops.kdist_easgd.restype = None
    loops.kdist_gem.argtypes = [pointer] * 5 + [size] + [single] * 5
    loops.kdist_gem.restype = ctypes.c_float
    return loops


def compiled():
    """The loaded loops, or None (then use numpy)."""
    global _loops, _failure
    if _loops is not None or _failure is not None:
        return _loops
    with _lock:
        if _loops is None and _failure is None:
            if os.environ.get("KDIST_NATIVE_KERNELS", "1").lower() in ("0", "false", "no"):
                _failure = "disabled by KDIST_NATIVE_KERNELS"
            else:
                try:
                    _loops = _build()
                except Exception as error:  # any build problem: numpy still works
                    _failure = str(error)
                    logger.warning("The parameter server's fused update loops are not "
                                   "available (%s); using numpy, which is slower.",
                                   _failure.splitlines()[0])
    return _loops


def _address(array, name):
    if array.dtype != np.float32 or not array.flags.c_contiguous:
        raise ValueError(f"{name} must be a contiguous float32 array.")
    return array.ctypes.data


def easgd(worker, center, reply, elastic_force):
    """`center += a (worker - center)`, `reply = worker - a (worker - center)`, one pass."""
    n = center.shape[0]
    _loops.kdist_easgd(_address(worker, "worker"), _address(center, "center"),
                         _address(reply, "reply"), n, elastic_force)


def gem(center, update, momentum, pulled, out, kappa, mu, scale, eps, max_scale):
    """GEM's momentum, factor and step in one pass; returns the mean factor."""
    n = center.shape[0]
    total = _loops.kdist_gem(_address(center, "center"), _address(update, "update"),
                               _address(momentum, "momentum"), _address(pulled, "pulled"),
                               _address(out, "out"), n, kappa, mu, scale, eps, max_scale)
    return total / n if n else 1.0
