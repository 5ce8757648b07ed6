"""The process world: who we are, who else there is, and how to reach them.

Everything above `kdist.comm` talks to a `Communicator`, which wraps an MPI
communicator or, when the script was not started by an MPI launcher, stands
in for a world of one process so that the same script runs unchanged on a
laptop. kdist works on its own duplicate of the world communicator, so a
script's own MPI messages can never meet kdist's.
"""

import logging
import os
import socket
import sys

from kdist import _prefix
from kdist.comm import job as _job
from kdist.comm.communicator import (  # noqa: F401  (names re-exported)
    REDUCE_OPS,
    Adasum,
    Average,
    Communicator,
    Max,
    Min,
    Product,
    Sum,
)

from kdist.comm.job import (  # noqa: F401  (names re-exported)
    _state,
    cross,
    cross_rank,
    cross_size,
    is_initialized,
    joined_late,
    local,
    local_rank,
    local_size,
    rank,
    size,
    world,
    world_generation,
)

logger = logging.getLogger(__name__)

# Variables that MPI launchers (Open MPI, MPICH/Hydra, Intel MPI, PMIx, SLURM's
# srun with PMI) put in the environment of the processes they start.
_LAUNCHER_VARIABLES = (
    "OMPI_COMM_WORLD_SIZE",
    "PMIX_RANK",
    "PMI_SIZE",
    "PMI_RANK",
    "MPI_LOCALNRANKS",
    "HYDRA_CONTROL_FD",
    "MV2_COMM_WORLD_SIZE",
)

def launched_by_mpi(environ=None):
    """Returns True when an MPI launcher started this process.

    That is: `KDIST_FORCE_MPI` is set to something other than `""` or `"0"`; or one of
    the variables that Open MPI, MPICH/Hydra, Intel MPI, MVAPICH or PMIx give the
    processes they start is present; or SLURM's `srun` started more than one task
    (`SLURM_STEP_ID` is set and `SLURM_STEP_NUM_TASKS` is above 1). `kdist.init()` uses
    MPI only then.

    Args:
        environ: the environment to read; `os.environ` by default.

    Example:

        >>> from kdist.comm import launched_by_mpi
        >>> launched_by_mpi({}), launched_by_mpi({"OMPI_COMM_WORLD_SIZE": "4"})
        (False, True)
        >>> launched_by_mpi({"SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "8"})
        True
    """
    environ = os.environ if environ is None else environ
    if environ.get("KDIST_FORCE_MPI", "") not in ("", "0"):
        return True
    if any(name in environ for name in _LAUNCHER_VARIABLES):
        return True
    # srun sets SLURM_STEP_ID for every task; PMI variables are then present
    # too when MPI is used, but srun --mpi=none still gives one task per rank.
    return ("SLURM_STEP_ID" in environ
            and int(environ.get("SLURM_STEP_NUM_TASKS", "1") or 1) > 1)




def _mpi():
    from mpi4py import MPI

    return MPI


def _import_mpi():
    try:
        import mpi4py
    except ImportError as error:
        raise ImportError(
            "This process was started by an MPI launcher but mpi4py is not installed. "
            "Install kdist's MPI extra: pip install 'kdist[mpi]'."
        ) from error
    # TensorFlow runs py-function ops on its own threads, so MPI must accept
    # calls from any thread. kdist serialises them per communicator.
    mpi4py.rc.thread_level = "multiple"
    # kdist's only windows are shared-memory ones (the parameter server's
    # exchange buffers), which Open MPI's sm component serves; its UCX
    # component prints an error on every rank of a machine without UCX
    # devices. Set OMPI_MCA_osc to choose otherwise.
    os.environ.setdefault("OMPI_MCA_osc", "^ucx")
    # Under srun, a PMIx built without munge (the Open MPI wheel's) prints a
    # "Sorry!" box on every rank when SLURM offers munge; its native security
    # (the socket's peer credentials) is what such a rank uses anyway. Set
    # PMIX_MCA_psec to choose otherwise.
    if "SLURM_STEP_ID" in os.environ:
        os.environ.setdefault("PMIX_MCA_psec", "native")
    if _all_ranks_on_this_node():
        # Open MPI's libfabric transport probes its providers in MPI_Init even where no
        # rank will use it: on one node shared memory carries every message, and the
        # probe cost each rank 1.0 s of its 1.1 s MPI_Init here (benchmarks/startup.py).
        # Set OMPI_MCA_btl to choose otherwise.
        os.environ.setdefault("OMPI_MCA_btl", "^ofi")
    from mpi4py import MPI

    return MPI


def _all_ranks_on_this_node(environ=None):
    """Whether Open MPI's launcher put every rank of the job on this node.

    >>> _all_ranks_on_this_node({"OMPI_COMM_WORLD_SIZE": "4",
    ...                          "OMPI_COMM_WORLD_LOCAL_SIZE": "4"})
    True
    >>> _all_ranks_on_this_node({"OMPI_COMM_WORLD_SIZE": "4",
    ...                          "OMPI_COMM_WORLD_LOCAL_SIZE": "2"})
    False
    """
    environ = os.environ if environ is None else environ
    size = environ.get("OMPI_COMM_WORLD_SIZE")
    return size is not None and environ.get("OMPI_COMM_WORLD_LOCAL_SIZE") == size


def init(comm=None, process_sets=None):
    """Starts kdist on this process. Safe to call more than once.

    Calls after the first (including the one that any kdist function needing the
    process world makes implicitly) do nothing but register `process_sets`.

    If an MPI launcher started the process (see `kdist.comm.launched_by_mpi`; or
    `KDIST_FORCE_MPI=1`), the world is `MPI.COMM_WORLD`; otherwise it is a world of one
    process and MPI is not touched, so the same script runs unchanged on a laptop.
    kdist works on its own duplicate of the world communicator, so the script's own MPI
    messages never meet kdist's. `init` also:

    - splits the world into the ranks on this node (`local_rank`, `local_size`) and the
      ranks with the same local rank on the other nodes (`cross_rank`, `cross_size`);
    - makes an uncaught exception on any rank abort the whole job, naming the rank;
    - starts the watchdog (in a world of several ranks), which reports stalled
      collectives and ends a job that cannot go on (`KDIST_STALL_WARNING`,
      `KDIST_COLLECTIVE_TIMEOUT`; see "When something fails" in the data-parallel
      guide);
    - sets up logging: a `[kdist R]` prefix, and only rank 0 speaks at INFO unless
      `KDIST_LOG_LEVEL` says otherwise;
    - gives this rank its share of the node's cores (TensorFlow's intra-op threads;
      see `kdist.comm.devices.intra_op_threads`) and its own GPU (local rank modulo
      the node's GPUs), with memory growth on;
    - starts a timeline when `KDIST_TIMELINE` names a file (see `kdist.start_timeline`).

    In an MPI job, a start that takes longer than `KDIST_START_TIMEOUT` seconds
    (default 600; 0: no limit), because a rank died or a host cannot be reached,
    ends this rank instead of waiting for ever.

    kdist calls MPI from TensorFlow's threads, so it asks MPI for
    `MPI_THREAD_MULTIPLE`. If mpi4py already started MPI with `MPI_THREAD_SERIALIZED`,
    `init` warns and works, but its stall reports cannot ask the other ranks what they
    are doing; with a lower level it raises `RuntimeError`. Import kdist before
    `mpi4py.MPI`, or set `mpi4py.rc.thread_level = "multiple"` first.

    Args:
        comm: an `mpi4py.MPI.Comm` to use as the world instead of `MPI.COMM_WORLD`, or a
            list of world ranks, for programs that run kdist on a subset of their
            processes. With a list, every process of the job must call `init` (the
            communicator is created collectively); a process not in the list gets a
            `ValueError` saying so, and must not use kdist.
        process_sets: a list of `kdist.ProcessSet`s (or lists of ranks) to register, as
            `kdist.add_process_set` does; every rank passes the same list. Horovod's
            `"dynamic"` is accepted and changes nothing (`add_process_set` works at any
            time); any other string raises `ValueError`.

    Raises:
        ValueError: `comm` is given after kdist has started (explicitly, or implicitly
            by a collective or `kdist.precision.enable`): call `init(comm=...)` first.
        RuntimeError: SLURM's `srun` started several tasks but MPI gives this one a
            world of one process, because srun's PMI plugin does not match the MPI
            library. Run with `srun --mpi=pmix` for Open MPI or `srun --mpi=pmi2` for
            MPICH and the MPIs that share its ABI (the message names the one for the
            MPI in use; `srun --mpi=list` shows your site's), or with `mpiexec` inside
            the allocation. Also raised for too low an MPI thread level (above).
        ImportError: an MPI launcher started the process but mpi4py is not installed
            (`pip install 'kdist[mpi]'`).

    Example:

        >>> import kdist
        >>> kdist.init()
        >>> kdist.rank(), kdist.size()
        (0, 1)
    """
    starting = None
    if not _state.initialized and (comm is not None or launched_by_mpi()):
        starting = _StartDeadline()
    try:
        _init(comm, process_sets)
    except Exception as error:
        if starting is not None and _is_mpi_error(error):
            _end_a_failed_start(error)
        raise
    finally:
        if starting is not None:
            starting.cancel()


def _is_mpi_error(error):
    MPI = sys.modules.get("mpi4py.MPI")
    return MPI is not None and isinstance(error, MPI.Exception)


def _end_a_failed_start(error):
    """Ends the whole job when MPI failed while it started (another rank died in
    `MPI_Init`, say). Under fault tolerance the launcher would let the other ranks
    go on without this one, and this process's exit could wait in `MPI_Finalize`
    for the dead peer: the job would never end."""
    rank = _prefix.launcher_rank()
    sys.stderr.write(f"[kdist rank {rank}] kdist.init() failed while the job started "
                     f"({error}); another rank may have died as it started. Ending the "
                     "job with MPI_Abort.\n")
    sys.stderr.flush()
    _mpi().COMM_WORLD.Abort(1)


def _init(comm, process_sets):
    with _state.lock:
        if _state.initialized:
            if comm is not None:
                raise ValueError(
                    "kdist is already initialised (collectives and kdist.precision.enable "
                    "start it implicitly), so init(comm=...) cannot "
                    "change its world now. Call kdist.init(comm=...) first.")
            if process_sets:
                _register(process_sets)
            return
        mpi_comm = None
        joining = False
        if comm is not None or launched_by_mpi():
            # Before MPI starts: under fault tolerance, a rank that makes no MPI
            # call for a few seconds (TensorFlow's import takes that) is taken for dead.
            import tensorflow  # noqa: F401

            MPI = _import_mpi()
            joining = comm is None and _replacement_for_a_lost_rank(MPI)
            if joining:
                # Started by the survivors of an elastic job (see
                # kdist.comm.recovery.grow_world): their world and this process
                # become one, and this process takes the highest rank.
                mpi_comm = MPI.Comm.Get_parent().Merge(high=True)
            elif comm is None:
                mpi_comm = MPI.COMM_WORLD
            elif isinstance(comm, (list, tuple)):
                # Every process of the job must take part in creating the group.
                group = MPI.COMM_WORLD.Get_group().Incl(list(comm))
                mpi_comm = MPI.COMM_WORLD.Create(group)
                if mpi_comm == MPI.COMM_NULL:
                    raise ValueError(
                        f"This process (world rank {MPI.COMM_WORLD.Get_rank()}) is not in "
                        f"the ranks {list(comm)} given to kdist.init(comm=...); only those "
                        "processes may use kdist.")
            else:
                mpi_comm = comm
            if comm is None and not joining:
                _check_not_a_lonely_task(mpi_comm.Get_size())
            _state.thread_level = _check_thread_level()
            # kdist's own copy: its messages never match a script's own MPI traffic.
            mpi_comm = mpi_comm.Dup()
        world = Communicator(mpi_comm)
        if mpi_comm is None:
            local = Communicator(None)
            cross = Communicator(None)
        else:
            MPI = _mpi()
            local = Communicator(mpi_comm.Split_type(MPI.COMM_TYPE_SHARED, key=world.rank))
            cross = Communicator(mpi_comm.Split(local.rank, world.rank))
            if _state.thread_level == MPI.THREAD_MULTIPLE and world.size > 1:
                _state.watch = mpi_comm.Dup()
            _state.hosts = _host_names(mpi_comm)
        _state.world, _state.local, _state.cross = world, local, cross
        _state.initialized = True
    from kdist.comm import ending, watchdog

    watchdog.install_failure_handlers()
    if mpi_comm is not None:
        ending.install()
        if joining:
            ending.mark_joined()
            _state.generation = 1
            _state.joined_late = True
    _configure_logging()
    if world.size > 1:
        watchdog.start_monitor(world, _state.watch)
    if mpi_comm is not None and world.size > 1:
        from kdist.comm import leaving

        leaving.install()
    from kdist.comm import devices

    # The ranks this one replaces configured themselves long ago; they do not
    # take part in a second exchange of core sets.
    devices.configure(local, ask_others=not joining)
    if process_sets:
        _register(process_sets)
    from kdist.comm import timeline

    timeline.start_from_environment()
    if world.size > 1:
        logger.debug("kdist started: rank %d of %d (local %d of %d)",
                     world.rank, world.size, local.rank, local.size)


DEFAULT_START_TIMEOUT = 600.0


class _StartDeadline:
    """Ends this rank when starting kdist (MPI's start-up and kdist's first exchanges,
    which wait for every rank) takes longer than KDIST_START_TIMEOUT seconds (default
    600; 0: no limit). A rank that died or stopped while the job started, before
    kdist's watchdog runs, would otherwise leave the others waiting in MPI_Init for
    ever.

    A launcher ends the job once a rank is gone, except a fault-tolerant one, which lets
    the others go on: there the clock ends the job itself, through `kdist run` (a record
    that the job cannot start) or, under a plain `mpiexec`, by ending the launcher
    process above this rank (Open MPI's `prterun`, or its daemon `prted` on another host).

    The clock is a small process of its own: MPI_Init runs inside mpi4py's import,
    which holds the interpreter, so no thread of this one could act."""

    def __init__(self):
        from kdist.comm import _clock, ending

        text = os.environ.get("KDIST_START_TIMEOUT", "")
        try:
            self.seconds = float(text) if text.strip() else DEFAULT_START_TIMEOUT
        except ValueError:
            raise ValueError(f"KDIST_START_TIMEOUT must be a number of seconds; got {text!r}.")
        self._clock = None
        if self.seconds <= 0:
            return
        under_run = bool(os.environ.get(_prefix.TOKEN_VARIABLE))
        tolerant = ending.fault_tolerant()
        # kdist run ends the launcher itself; a fault-tolerant one would wait for ever, and
        # any other may wait for a host it cannot reach: it gets ending's grace.
        launcher = None if under_run else _clock.launcher_above(os.getpid())
        message = (f"[kdist rank {_prefix.launcher_rank()}] kdist.init() has waited "
                   f"{self.seconds:g} s for the job's other ranks to start "
                   "(KDIST_START_TIMEOUT): a rank that died or stopped while starting, "
                   "or a host that cannot be reached; ending this rank"
                   + (" and the job's launcher, which under fault tolerance would wait"
                      if launcher and tolerant else "") + ".")
        grace = 0.0 if tolerant else ending.LAUNCHER_GRACE
        later = "" if tolerant else (
            f"[kdist] The launcher (pid {launcher}) still waited {grace:g} s after a rank "
            "gave up starting (for a host it cannot reach); ending it.")
        record = _prefix.record_text("start-timeout", rank=_prefix.launcher_rank(),
                                     host=socket.gethostname(), pid=os.getpid())
        # It speaks on the rank's own output: the record must reach kdist run.
        self._clock = _clock.start(after=self.seconds, message=message, record=record,
                                   kill_parent=True, launcher=launcher, launcher_grace=grace,
                                   launcher_message=later, quiet=False)

    def cancel(self):
        if self._clock is not None:
            self._clock.kill()
            self._clock.wait()


REPLACEMENT_VARIABLE = "KDIST_ELASTIC_REPLACEMENT"


def _replacement_for_a_lost_rank(MPI, environ=None):
    """Whether survivors of an elastic job spawned this process to replace a lost rank."""
    environ = os.environ if environ is None else environ
    if environ.get(REPLACEMENT_VARIABLE, "") in ("", "0"):
        return False
    return MPI.Comm.Get_parent() != MPI.COMM_NULL


def _register(process_sets):
    from kdist.comm import process_sets as sets

    if isinstance(process_sets, str):
        if process_sets.lower() != "dynamic":
            raise ValueError(f"process_sets must be a list of kdist.ProcessSet or 'dynamic'; "
                             f"got {process_sets!r}.")
        return  # add_process_set works at any time
    for process_set in process_sets:
        sets.add_process_set(process_set)


def _check_not_a_lonely_task(world_size, environ=None):
    """Fails when srun started several tasks but MPI sees each as a world of one.

    That happens when srun's PMI plugin does not match the MPI library; the
    tasks would then train separate models without a word.
    """
    environ = os.environ if environ is None else environ
    tasks = int(environ.get("SLURM_STEP_NUM_TASKS", "1") or 1)
    if "SLURM_STEP_ID" in environ and tasks > 1 and world_size == 1:
        library = mpi_library()
        line = "" if library is None else library["library"]
        plugin = srun_plugin(mpi_family(line))
        raise RuntimeError(
            f"srun started {tasks} tasks but MPI sees a world of 1 on this one: srun's PMI "
            f"plugin does not match this MPI library ({line or 'unknown'}). Run with "
            f"`srun --mpi={plugin}` (or the plugin your site documents; `srun --mpi=list` "
            "lists them), or use `mpiexec` inside the allocation.")


def _check_thread_level():
    """Checks that MPI accepts calls from TensorFlow's threads; returns the level.

    kdist's collectives run on whichever thread TensorFlow picks and its
    watchdog asks the other ranks from a thread of its own, so it wants
    `MPI_THREAD_MULTIPLE`. With `MPI_THREAD_SERIALIZED` it still works (one
    collective at a time) but cannot name stalled ranks.
    """
    MPI = _mpi()
    level = MPI.Query_thread()
    if level == MPI.THREAD_MULTIPLE:
        return level
    names = {MPI.THREAD_SINGLE: "MPI_THREAD_SINGLE", MPI.THREAD_FUNNELED: "MPI_THREAD_FUNNELED",
             MPI.THREAD_SERIALIZED: "MPI_THREAD_SERIALIZED"}
    if level == MPI.THREAD_SERIALIZED:
        logger.warning("MPI was started with MPI_THREAD_SERIALIZED; kdist works, but its "
                       "watchdog cannot ask other ranks what they are doing. Import kdist "
                       "before mpi4py.MPI, or set mpi4py.rc.thread_level = 'multiple'.")
        return level
    raise RuntimeError(
        f"MPI was started with {names.get(level, level)}, but kdist calls MPI from "
        "TensorFlow's threads and needs MPI_THREAD_MULTIPLE (or at least SERIALIZED). "
        "Import kdist before mpi4py.MPI, or set mpi4py.rc.thread_level = 'multiple' before "
        "importing mpi4py.MPI; if your MPI library cannot provide it, rebuild it with thread "
        "support.")


def replace_world(mpi_comm):
    """Makes `mpi_comm` (the survivors, after ranks died) kdist's world.

    The world, local and cross `Communicator` objects keep their identity and
    take the new group; the watchdog starts again on a copy of it. Collective
    over the ranks of `mpi_comm`.
    """
    from kdist.comm import watchdog

    MPI = _mpi()
    watchdog.stop_monitor()
    with _state.lock:
        if not _state.initialized or _state.world.mpi is None:
            raise RuntimeError("kdist's world can be replaced only in a job started by an "
                               "MPI launcher, after kdist.init().")
        world = _state.world
        _state.generation += 1
        world.adopt(mpi_comm)
        _state.local.adopt(mpi_comm.Split_type(MPI.COMM_TYPE_SHARED, key=world.rank))
        _state.cross.adopt(mpi_comm.Split(_state.local.rank, world.rank))
        # The old copies may be revoked; they are left to the end of the process.
        _state.watch = None
        if _state.thread_level == MPI.THREAD_MULTIPLE and world.size > 1:
            _state.watch = mpi_comm.Dup()
        gathered = mpi_comm.allgather((socket.gethostname(), _prefix.launcher_rank()))
        _state.hosts = [host for host, _ in gathered]
    # Graphs traced before read the sizes and this rank from variables (`kdist.size_op`).
    from kdist.comm import process_ops

    process_ops.refresh()
    if world.rank == 0:
        # So that `kdist run` knows which ranks the job goes on with, and does not wait
        # for a launcher that waits for a lost host once these have ended.
        _prefix.tell_run("world", ranks=",".join(rank for _, rank in gathered))
    if world.size > 1:
        watchdog.start_monitor(world, _state.watch)


def _host_names(mpi_comm):
    """Every rank's host name, by rank (collective): so that a rank can name the host of a
    peer that stopped answering, which can no longer say it itself."""
    return list(mpi_comm.allgather(socket.gethostname()))


def shutdown():
    """Stops the watchdog and releases kdist's communicators and process sets.

    A timeline that `KDIST_TIMELINE` started is written first. MPI is not finalised.
    `init()` may be called again afterwards, and starts afresh: the global process set
    alone, settings read anew. Does nothing if kdist has not started.
    """
    from kdist.comm import process_ops, process_sets, timeline, watchdog

    with _state.lock:
        if not _state.initialized:
            watchdog.stop_monitor()
            return
    # What init started from the environment ends here, while the world still answers.
    timeline.stop_started_from_environment()
    watchdog.stop_monitor()
    process_sets.remove_all()
    process_ops.forget_world()
    with _state.lock:
        for comm in (_state.cross, _state.local, _state.world):
            if comm is not None:
                comm.free()
        if _state.watch is not None:
            _state.watch.Free()
        _state.world = _state.local = _state.cross = _state.watch = None
        _state.hosts = []
        _state.initialized = False


def mpi_enabled():
    """True when kdist runs over MPI, even with one rank (`mpiexec -n 1`,
    `KDIST_FORCE_MPI=1`); False in a world of one started without a launcher. Starts
    kdist on first use."""
    return world().mpi is not None


def mpi_threads_supported():
    """True when kdist runs over MPI and the MPI library accepts calls from several threads
    (`MPI_THREAD_MULTIPLE`). Starts kdist on first use."""
    if not mpi_enabled():
        return False
    MPI = _mpi()
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def mpi_built():
    """True when kdist can run over MPI here (mpi4py and an MPI library are installed)."""
    try:
        from mpi4py import MPI  # noqa: F401
    except ImportError:
        return False
    return True


def mpi_library():
    """`{"mpi4py": version, "library": the MPI library's first line}`, or None
    when mpi4py is not installed (what `kdist info` reports)."""
    try:
        import mpi4py
        from mpi4py import MPI
    except ImportError:
        return None
    # Open MPI ends its version string with a NUL byte.
    first_line = MPI.Get_library_version().replace("\0", "").strip().splitlines()[0]
    return {"mpi4py": mpi4py.__version__, "library": first_line.strip()}


def mpi_family(library_line=None):
    """`"openmpi"`, `"mpich"` (MPICH and the libraries that share its ABI: Intel MPI,
    MVAPICH, Cray MPICH) or `"other"`, from the MPI library's version line (the one
    mpi4py uses when not given)."""
    if library_line is None:
        library = mpi_library()
        library_line = "" if library is None else library["library"]
    text = library_line.lower()
    if "open mpi" in text:
        return "openmpi"
    if any(name in text for name in ("mpich", "intel(r) mpi", "intel mpi", "mvapich")):
        return "mpich"
    return "other"


def srun_plugin(family):
    """The `srun --mpi=` plugin an MPI library of `family` starts under."""
    return {"openmpi": "pmix", "mpich": "pmi2"}.get(family, "pmix")


class _RankFilter(logging.Filter):
    def filter(self, record):
        record.kdist_rank = _state.world.rank if _state.initialized else 0
        return True


def _configure_logging():
    """Gives kdist's loggers a rank prefix; only rank 0 speaks at INFO by default."""
    root = logging.getLogger("kdist")
    if not getattr(root, "_kdist_configured", False):
        root._kdist_configured = True
        handler = logging.StreamHandler(sys.stderr)
        handler.addFilter(_RankFilter())
        handler.setFormatter(logging.Formatter("[kdist %(kdist_rank)s] %(levelname)s "
                                               "%(message)s"))
        root.addHandler(handler)
        root.propagate = False
    # At every init: a world started again may give this process another rank.
    level = os.environ.get("KDIST_LOG_LEVEL")
    if level:
        root.setLevel(level.upper())
    else:
        root.setLevel(logging.INFO if rank() == 0 else logging.WARNING)


# The accessors in `job` start kdist on first use; they reach `init` through
# this hook, so that the modules below this one need not import it.
_job.initialize = init
