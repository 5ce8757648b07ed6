"""One rank of a shared test world: runs the scripts the tests hand it, one after another.

Started by `shared_world.World` as `mpiexec -n N python world_rank.py CONTROL_DIR` (or as
one plain process, without a launcher, for single-process references). Each rank pays
for TensorFlow's import once and then runs job after job, as Horovod's and mpi4py's
suites run every test of a file in one launch.

The control directory holds, per job K (written by the controller, read by every rank):

- `job-K.json`: the script, its arguments, the environment it changes, the directory
  to run in; or `{"stop": true}`, which ends the world;
- `out-K-R.txt`: rank R's standard output and error while it runs job K (file
  descriptors 1 and 2 are redirected, so native code's output lands there too);
- `result-K-R.json`: how the script ended on rank R (`ok`, or the traceback), written
  as soon as it ended, before the rank tidies up;
- `done-K-R.json`: written once the rank has tidied up and is ready for job K + 1.

Between jobs a rank puts back everything a script may have changed that the next one
could see: kdist's communicators and process sets, Keras's session and settings,
TensorFlow's switches, environment variables, the working directory, `sys.argv` and
`sys.path`, modules the script imported from its own folder, logging handlers, signal
handlers, and the random generators (seeded afresh, as a new process would be).
"""

import faulthandler
import gc
import json
import logging
import os
import random
import resource
import signal
import sys
import threading
import time
import traceback

import shared_world

CONTROL = sys.argv[1]
HERE = os.path.dirname(os.path.abspath(__file__))
# The signal on which every thread's Python stack is written to the job's output.
DUMP_SIGNAL = signal.SIGUSR1


def _rank_and_size():
    for rank_name, size_name in (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
                                 ("PMI_RANK", "PMI_SIZE"), ("PMIX_RANK", None)):
        if rank_name in os.environ:
            return int(os.environ[rank_name]), int(os.environ.get(size_name or "", "0") or 0)
    return 0, 1


RANK, SIZE = _rank_and_size()
# Package folders whose modules stay loaded whatever folder the checkout is in.
KEEP = []


def _write_json(path, obj):
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f)
    os.replace(path + ".tmp", path)


def _path(kind, job, ext="json"):
    return os.path.join(CONTROL, f"{kind}-{job}-{RANK}.{ext}")


def _wait_for_job(index):
    """The job's description once the controller has written it; polls gently."""
    path = os.path.join(CONTROL, f"job-{index}.json")
    pause = 0.005
    while not os.path.exists(path):
        time.sleep(pause)
        pause = min(0.05, pause * 1.5)
        if os.getppid() == 1:
            # The launcher is gone (killed with the controller): nobody will write more.
            os._exit(3)
    with open(path) as f:
        return json.load(f)


class _Redirected:
    """Points file descriptors 1 and 2 at `path` while a job runs."""

    def __init__(self, path):
        self.path = path

    def __enter__(self):
        sys.stdout.flush()
        sys.stderr.flush()
        self.saved = (os.dup(1), os.dup(2))
        target = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, 1)
        os.dup2(target, 2)
        os.close(target)
        return self

    def __exit__(self, *exc):
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, saved in zip((1, 2), self.saved):
            os.dup2(saved, fd)
            os.close(saved)


class _Snapshot:
    """What a script can change in this process, taken before it runs."""

    SIGNALS = tuple(s for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGALRM,
                                signal.SIGUSR2, signal.SIGCHLD) if s is not None)

    def __init__(self):
        import keras
        import tensorflow as tf

        self.environ = dict(os.environ)
        self.cwd = os.getcwd()
        self.argv = list(sys.argv)
        self.path = list(sys.path)
        self.modules = set(sys.modules)
        self.handlers = {s: signal.getsignal(s) for s in self.SIGNALS}
        root = logging.getLogger()
        self.root_logging = (list(root.handlers), root.level)
        self.threads = {t.ident for t in threading.enumerate()}
        self.keras = {
            "floatx": keras.config.floatx(),
            "epsilon": keras.config.epsilon(),
            "image_data_format": keras.config.image_data_format(),
        }
        self.tensorflow = {"eager": tf.config.functions_run_eagerly(),
                           "jit": tf.config.optimizer.get_jit(),
                           "determinism": _op_determinism().is_op_determinism_enabled()}
        self.excepthooks = (sys.excepthook, threading.excepthook)
        self.script_folders = []


def _restore(snapshot):
    """Puts back what `snapshot` recorded; returns what could not be put back.

    Each step on its own, so that one that fails leaves the others done.
    """
    failed = []
    for step in (_end_kdist, _restore_keras_and_tensorflow, _restore_process,
                 _restore_modules, _reseed):
        try:
            step(snapshot)
        except BaseException:  # noqa: BLE001  (reported: the controller ends this world)
            failed.append(f"{step.__name__} failed:\n{traceback.format_exc()}")
            sys.stderr.write(failed[-1])
    return failed


def _restore_keras_and_tensorflow(snapshot):
    import keras
    import tensorflow as tf

    keras.backend.clear_session()
    keras.config.set_dtype_policy("float32")
    keras.config.set_floatx(snapshot.keras["floatx"])
    keras.config.set_epsilon(snapshot.keras["epsilon"])
    keras.config.set_image_data_format(snapshot.keras["image_data_format"])
    tf.config.run_functions_eagerly(snapshot.tensorflow["eager"])
    tf.config.optimizer.set_jit(snapshot.tensorflow["jit"])
    determinism = _op_determinism()
    if determinism.is_op_determinism_enabled() and not snapshot.tensorflow["determinism"]:
        determinism.disable_op_determinism()


def _op_determinism():
    """TensorFlow's switch of `tf.config.experimental.enable_op_determinism`, which has no
    public way to read it or turn it off again (tests/workers/resume.py turns it on)."""
    from tensorflow.python.framework import config

    return config


def _restore_process(snapshot):
    os.environ.clear()
    os.environ.update(snapshot.environ)
    os.chdir(snapshot.cwd)
    sys.argv[:] = snapshot.argv
    sys.path[:] = snapshot.path
    sys.excepthook, threading.excepthook = snapshot.excepthooks
    for sig, handler in snapshot.handlers.items():
        if signal.getsignal(sig) is not handler and handler is not None:
            signal.signal(sig, handler)
    root = logging.getLogger()
    root.handlers[:] = snapshot.root_logging[0]
    root.setLevel(snapshot.root_logging[1])


def _restore_modules(snapshot):
    for name in set(sys.modules) - snapshot.modules:
        path = getattr(sys.modules.get(name), "__file__", None)
        if shared_world.is_scripts_own(path, snapshot.script_folders, HERE, keep=KEEP):
            del sys.modules[name]


def _reseed(snapshot):
    """A new process starts with no global seed and unseeded generators."""
    import numpy as np
    import tensorflow as tf

    tf.random.set_seed(None)
    random.seed()
    np.random.seed()
    # What is still alive now (TensorFlow's and Keras's caches) need not be walked by
    # every later gc.collect(): Keras's clear_session and keras-tuner's trials call it.
    gc.collect()
    gc.freeze()


def _threads_left(snapshot):
    return sorted(t.name for t in threading.enumerate()
                  if t.ident not in snapshot.threads and t.is_alive() and not t.daemon)


def _end_kdist(snapshot):
    """What the end of a script's process does for kdist, then a fresh start for the next.

    A rank whose script ended announces it as kdist does at exit: when every rank has
    ended, that meets the others' announcement; when another rank still waits in a
    collective, both fail with kdist's report and kdist ends the world, as it would end
    a job. Then kdist lets go of its communicators, process sets and monitor.
    """
    if "kdist" not in sys.modules:
        return
    from kdist.comm import job, leaving, processes

    if job.is_initialized():
        leaving.leave()
        processes.shutdown()


def _run_script(job):
    """Runs the job's script as `python script args` would; returns its result."""
    import runpy

    script = job["script"]
    sys.argv[:] = [script] + list(job["args"])
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    started = time.monotonic()
    try:
        runpy.run_path(script, run_name="__main__")
        status, text = "ok", ""
    except SystemExit as stop:
        code = stop.code
        if code in (None, 0):
            status, text = "ok", ""
        else:
            status = "failed"
            text = f"SystemExit({code!r})"
            if not isinstance(code, int):
                print(code, file=sys.stderr)
    except BaseException:  # noqa: BLE001  (the verdict is the job's, the world goes on)
        status, text = "failed", traceback.format_exc()
        sys.stderr.write(text)
    return {"status": status, "traceback": text, "seconds": time.monotonic() - started}


def _apply_environment(changes):
    for name, value in changes.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def _rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _serve():
    index = 0
    while True:
        job = _wait_for_job(index)
        if job.get("stop"):
            return
        if RANK >= job["n"]:
            _write_json(_path("done", index), {"idle": True})
            index += 1
            continue
        snapshot = _Snapshot()
        with _Redirected(_path("out", index, "txt")):
            _apply_environment(job.get("environment", {}))
            os.chdir(job["cwd"])
            result = _run_script(job)
            _write_json(_path("result", index), result)
            # Where the script's own modules come from: its folder and what it put on the path.
            snapshot.script_folders = [os.path.dirname(os.path.abspath(job["script"]))] + [
                p for p in sys.path if p not in snapshot.path and isinstance(p, str)]
            failed = _restore(snapshot)
        _write_json(_path("done", index), {"untidy": failed, "threads": _threads_left(snapshot),
                                           "rss_mb": _rss_mb()})
        index += 1


def main():
    started = time.monotonic()
    faulthandler.enable(all_threads=True)
    faulthandler.register(DUMP_SIGNAL, all_threads=True, chain=False)
    # MPI itself starts with the first script's kdist.init() (or its own mpi4py import),
    # as it would in a job of its own.
    import keras  # noqa: F401
    import tensorflow  # noqa: F401

    import kdist

    KEEP.append(os.path.dirname(os.path.abspath(kdist.__file__)))

    # What the imports made lives as long as the process; the collector need not walk it.
    gc.collect()
    gc.freeze()
    _write_json(os.path.join(CONTROL, f"ready-{RANK}.json"),
                {"pid": os.getpid(), "seconds": time.monotonic() - started,
                 "cpu": time.process_time()})
    _serve()


if __name__ == "__main__":
    main()
