"""Whether TensorFlow runs oneDNN's CPU kernels, and whether it should.

TensorFlow's Linux x86 wheels contain two sets of CPU kernels: TensorFlow's own
and oneDNN's. They choose oneDNN's by default only on CPUs with the features
meant for neural networks (AVX512_VNNI, AVX512_BF16, AVX_VNNI, AMX: Intel
Cascade Lake and newer). On other x86 CPUs that oneDNN runs well on (AVX2 or
AVX-512 without those: AMD EPYC Rome and Milan, Intel Haswell to Skylake, the
nodes of many clusters) they keep TensorFlow's own kernels unless
`TF_ENABLE_ONEDNN_OPTS=1` is set, and convolutions, 3D ones most, run several
times slower (docs/speed.md has the measured table).

`kdist run` sets `TF_ENABLE_ONEDNN_OPTS=1` for its ranks on such CPUs unless the
variable is set already or `KDIST_ONEDNN=0`; `kdist info` says which kernels
each rank runs and why. TensorFlow reads the variable once, when it first
needs it, so it must be in the environment before the script starts (for a
plain `mpiexec` or `srun`, export it in the job script). oneDNN's kernels may
round differently from TensorFlow's (the last bits of float32 results).

Nothing here imports TensorFlow except `enabled()`.
"""

import os
import platform

# CPU features (as /proc/cpuinfo names them) with which TensorFlow turns oneDNN on itself.
TENSORFLOW_TURNS_ON = ("avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile", "amx_bf16",
                       "amx_int8")
# Features with which oneDNN's kernels beat TensorFlow's own (which use AVX only).
ONEDNN_RUNS_WELL = ("avx2", "avx512f")


def cpu_flags(path="/proc/cpuinfo"):
    """The CPU's feature flags, as a set of lower-case names (empty where unknown)."""
    try:
        with open(path) as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def decide(flags, environ=None, machine=None, system=None):
    """Whether TensorFlow runs oneDNN's kernels on this CPU, and what to do about it.

    Args:
        flags: the CPU's feature flags (`cpu_flags()`).
        environ: the environment (default `os.environ`).
        machine, system: `platform.machine()` and `platform.system()` by default.

    Returns:
        A dict: `default` (whether TensorFlow turns oneDNN on by itself here, or
        None off Linux x86-64, where kdist does not know), `setting` (the value of
        `TF_ENABLE_ONEDNN_OPTS`, or None), `turn_on` (whether `kdist run` should set
        it to 1) and `why` (one sentence).
    """
    environ = os.environ if environ is None else environ
    verdict = _by_cpu(flags, environ, platform.machine() if machine is None else machine,
                      platform.system() if system is None else system)
    if verdict["setting"] is not None:  # the user's choice decides, whatever the CPU
        verdict["why"] = (f"TF_ENABLE_ONEDNN_OPTS={verdict['setting']} is set; without it: "
                          f"{verdict['why']}")
    return verdict


def _by_cpu(flags, environ, machine, system):
    setting = environ.get("TF_ENABLE_ONEDNN_OPTS")
    verdict = {"default": None, "setting": setting, "turn_on": False}
    if system != "Linux" or machine not in ("x86_64", "AMD64"):
        verdict["why"] = f"TensorFlow chooses its CPU kernels itself on {system} {machine}"
        return verdict
    if not flags:
        verdict["why"] = "the CPU's features are unknown (no /proc/cpuinfo flags)"
        return verdict
    own = sorted(set(TENSORFLOW_TURNS_ON) & flags)
    verdict["default"] = bool(own)
    if own:
        verdict["why"] = f"the CPU has {', '.join(own)}: TensorFlow turns oneDNN on itself"
        return verdict
    able = sorted(set(ONEDNN_RUNS_WELL) & flags)
    if not able:
        verdict["why"] = "the CPU has neither AVX2 nor AVX-512: TensorFlow's own kernels"
        return verdict
    verdict["why"] = (f"the CPU has {', '.join(able)} but none of {', '.join(TENSORFLOW_TURNS_ON)}"
                      ": TensorFlow leaves oneDNN off unless TF_ENABLE_ONEDNN_OPTS=1")
    verdict["turn_on"] = setting is None and environ.get("KDIST_ONEDNN", "1") != "0"
    return verdict


def environment_for_ranks(environ=None, flags=None):
    """The variables `kdist run` adds to its ranks' environment for their CPU kernels."""
    verdict = decide(cpu_flags() if flags is None else flags, environ)
    return {"TF_ENABLE_ONEDNN_OPTS": "1"} if verdict["turn_on"] else {}


def enabled():
    """Whether this process's TensorFlow runs oneDNN's kernels (imports TensorFlow)."""
    from kdist import _tf_private

    return _tf_private.onednn_enabled()
