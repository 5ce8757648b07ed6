"""A keras-tuner search spread over MPI ranks: one oracle, groups evaluating trials.

With `N = 1 + groups * folds_per_group * workers_per_fold` ranks:

- rank 0 runs the oracle behind keras-tuner's own oracle service (its gRPC
  `OracleServicer`), as keras-tuner's chief does;
- every group asks that service for trials through keras-tuner's
  `OracleClient` and evaluates one trial at a time; its first rank (the
  group's leader) talks to the oracle and hands each trial to the group over
  MPI;
- inside a group, `KFoldTuner` deals the folds to `folds_per_group` fold
  teams, and a fold team of `workers_per_fold` ranks trains data-parallel.

MPI sub-communicators form the groups and teams. Results go to the
oracle's directory, as in a one-process search, so a rerun of the same
command resumes with the finished trials kept. The directory must be shared
by all ranks.
"""

import contextlib
import logging
import os
import socket
import time
from concurrent import futures

import keras_tuner as kt

from kdist.comm import p2p, processes
from kdist.tune import storage

logger = logging.getLogger(__name__)

DONE_TAG, TRIAL_TAG = 7301, 7302
_ENVIRONMENT = ("KERASTUNER_ORACLE_IP", "KERASTUNER_ORACLE_PORT", "KERASTUNER_TUNER_ID")
_current = None


class Roles:
    """Which part of the search this rank plays, and the communicators it needs.

    Args:
        comm: the job's communicator (all N ranks).
        folds_per_group: fold teams per group (`KFoldTuner` only).
        workers_per_fold: data-parallel ranks per fold team.
    """

    def __init__(self, comm, folds_per_group=1, workers_per_fold=1):
        for name, value in (("folds_per_group", folds_per_group),
                            ("workers_per_fold", workers_per_fold)):
            if int(value) != value or value < 1:
                raise ValueError(f"{name} must be an integer >= 1; got {value}.")
        self.folds_per_group, self.workers_per_fold = int(folds_per_group), int(workers_per_fold)
        per_group = self.folds_per_group * self.workers_per_fold
        if comm.size < 1 + per_group or (comm.size - 1) % per_group:
            raise ValueError(
                f"A distributed search runs on N = 1 + groups x {self.folds_per_group} fold "
                f"team(s) x {self.workers_per_fold} worker(s) ranks: 1 for the oracle, and at "
                f"least one group of {per_group}. Got N = {comm.size}; use N = "
                f"{1 + per_group}, {1 + 2 * per_group}, ...")
        self.comm = comm
        self.groups = (comm.size - 1) // per_group
        self.is_master = comm.rank == 0
        local = (comm.rank - 1) % per_group if not self.is_master else 0
        self.group = (comm.rank - 1) // per_group if not self.is_master else -1
        self.fold_team = local // self.workers_per_fold
        self.worker = local % self.workers_per_fold
        self.is_leader = not self.is_master and local == 0
        self.group_comm = comm.split(self.group + 1)
        self.team_comm = comm.split(0 if self.is_master else
                                    1 + self.group * self.folds_per_group + self.fold_team)
        self.leaders = [1 + g * per_group for g in range(self.groups)]


def current_roles():
    """The `Roles` of the distributed search running now, or None."""
    return _current


def trial_comm():
    """The communicator a trial's data-parallel training should use.

    In a distributed search: this rank's fold team (pass it as
    `kdist.DistributedOptimizer(..., comm=kdist.tune.trial_comm())`).
    Otherwise the whole job's.
    """
    return _current.team_comm if _current is not None else processes.world()


def clear_project(directory, project_name):
    """Removes a search's project directory once for all ranks; returns `overwrite`.

    Every rank building a tuner with `overwrite=True` would delete the files
    the others are writing. Under MPI, rank 0 deletes the directory, every
    rank waits for it, and the tuners are then built with `overwrite=False`
    (what this returns). On one process it returns True and lets keras-tuner
    do it.
    """
    processes.init()
    if processes.size() == 1:
        return True
    if processes.rank() == 0:
        import shutil

        shutil.rmtree(os.path.join(str(directory), project_name), ignore_errors=True)
    processes.world().barrier()
    return False


def search(tuner, *fit_args, folds_per_group=1, workers_per_fold=1, comm=None, **fit_kwargs):
    """Runs `tuner.search(*fit_args, **fit_kwargs)` over all ranks of `comm`.

    Every rank calls this with the same tuner settings and arguments. On one
    process it is plain `tuner.search`. Build the tuner with `overwrite=False`
    on every rank (to start afresh, call `clear_project(directory,
    project_name)` first, on every rank): ranks that each delete the
    directory would delete each other's files. Afterwards every rank's tuner holds
    the finished search (`get_best_hyperparameters()` and friends work
    everywhere).

    Args:
        tuner: any `keras_tuner.Tuner`, built on every rank.
        folds_per_group: fold teams per group; needs a `KFoldTuner`.
        workers_per_fold: data-parallel ranks per trial (or per fold team).
            `KFoldTuner` sets them up itself; another tuner's model should
            use `kdist.DistributedOptimizer(..., comm=kdist.tune.trial_comm())`.
        comm: the ranks to use (default: all).
    """
    global _current
    if comm is None:
        processes.init()
        comm = processes.world()
    if comm.size == 1:
        return tuner.search(*fit_args, **fit_kwargs)
    from kdist.tune.kfold import KFoldTuner

    if folds_per_group > 1 and not isinstance(tuner, KFoldTuner):
        raise ValueError("folds_per_group > 1 needs a kdist.tune.KFoldTuner.")
    roles = Roles(comm, folds_per_group, workers_per_fold)
    storage.make_saves_whole(tuner)
    storage.order_trials(tuner.oracle)  # a resumed search reloaded them in listing order
    if isinstance(tuner, KFoldTuner) and roles.folds_per_group > tuner.folds:
        raise ValueError(f"folds_per_group ({roles.folds_per_group}) exceeds the tuner's "
                         f"{tuner.folds} folds.")
    # Every rank has built its tuner (and cleared an overwritten directory) before
    # the oracle writes anything.
    comm.barrier()
    address = _start_service(tuner, roles) if roles.is_master else None
    address = comm.bcast_object(address)
    _current = roles
    try:
        if roles.is_master:
            _serve(tuner, roles, *address)
        elif roles.is_leader:
            _lead(tuner, roles, address, fit_args, fit_kwargs)
        else:
            _follow(tuner, roles, fit_args, fit_kwargs)
    finally:
        _current = None
    comm.barrier()
    if not roles.is_master:
        tuner.oracle.reload()
        # Ties then rank alike here and on the master.
        storage.order_trials(tuner.oracle)
    return None


def _start_service(tuner, roles):
    import grpc
    from keras_tuner.src import protos
    from keras_tuner.src.distribute import oracle_chief

    local = processes.local_size() == roles.comm.size
    host = "127.0.0.1" if local else socket.gethostbyname(socket.gethostname())
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max(2, roles.groups)))
    protos.get_service_grpc().add_OracleServicer_to_server(
        oracle_chief.OracleServicer(tuner.oracle), server)
    port = server.add_insecure_port(f"{'127.0.0.1' if local else '0.0.0.0'}:0")
    if not port:
        raise RuntimeError("Could not open a port for keras-tuner's oracle service.")
    server.start()
    roles.server = server
    tuner.save()
    logger.info("oracle service on %s:%d for %d group(s) of %d rank(s)", host, port,
                roles.groups, roles.folds_per_group * roles.workers_per_fold)
    return host, port


def _serve(tuner, roles, host, port):
    started = time.perf_counter()
    waiting = set(roles.leaders)
    try:
        while waiting:
            leader, _ = p2p.poll_object(roles.comm, DONE_TAG)
            waiting.discard(leader)
    finally:
        roles.server.stop(grace=None)
    trials = tuner.oracle.trials.values()
    counts = {}
    for trial in trials:
        counts[trial.status] = counts.get(trial.status, 0) + 1
    logger.info("search done in %.1f s: %s", time.perf_counter() - started,
                ", ".join(f"{n} {s.lower()}" for s, n in sorted(counts.items())))


class _PatientClient:
    """keras-tuner's `OracleClient`, pausing when the oracle has no trial yet."""

    def __init__(self, oracle):
        from keras_tuner.src.distribute import oracle_client

        self._client = oracle_client.OracleClient(oracle)

    def __getattr__(self, name):
        return getattr(self._client, name)

    def create_trial(self, tuner_id):
        trial = self._client.create_trial(tuner_id)
        if trial.status == kt.engine.trial.TrialStatus.IDLE:
            # A generational oracle waits for other groups' trials.
            time.sleep(0.2)
        return trial


def _lead(tuner, roles, address, fit_args, fit_kwargs):
    saved_environment = {name: os.environ.get(name) for name in _ENVIRONMENT}
    os.environ.update(KERASTUNER_ORACLE_IP=address[0], KERASTUNER_ORACLE_PORT=str(address[1]),
                      KERASTUNER_TUNER_ID=f"group{roles.group}")
    oracle, run_trial = tuner.oracle, tuner.run_trial
    tuner.oracle = _PatientClient(oracle)
    tuner.tuner_id = f"group{roles.group}"

    def lead_trial(trial, *args, **kwargs):
        _tell_group(roles, ("trial", trial.get_state()))
        return _run_together(roles, run_trial, trial, args, kwargs)

    tuner.run_trial = lead_trial
    try:
        tuner.search(*fit_args, **fit_kwargs)
    finally:
        _tell_group(roles, ("stop", None))
        p2p.send_object(roles.comm, 0, roles.group, DONE_TAG)
        tuner.oracle, tuner.run_trial = oracle, run_trial
        del tuner.run_trial  # back to the class's method
        for name, value in saved_environment.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def _team_starts_alike(run_trial, roles):
    """Makes a stock tuner's data-parallel team train each trial from one set of weights.

    `KFoldTuner` broadcasts each fold's model itself; any other tuner's
    hypermodel builds one model per rank, with each rank's own random
    initialisation, so its `fit` gets a broadcast from the team's first rank.
    """
    from kdist.tune.kfold import KFoldTuner

    tuner = getattr(run_trial, "__self__", None)
    hypermodel = getattr(tuner, "hypermodel", None)
    if (roles.team_comm.size == 1 or isinstance(tuner, KFoldTuner) or hypermodel is None):
        yield
        return
    from kdist.callbacks.broadcast import BroadcastGlobalVariablesCallback

    fit, own = hypermodel.fit, vars(hypermodel).get("fit")

    def fit_from_one_start(hp, model, *args, **kwargs):
        callbacks = list(kwargs.pop("callbacks", None) or [])
        callbacks.insert(0, BroadcastGlobalVariablesCallback(0, comm=roles.team_comm))
        return fit(hp, model, *args, callbacks=callbacks, **kwargs)

    hypermodel.fit = fit_from_one_start
    try:
        yield
    finally:
        if own is None:
            del hypermodel.fit  # back to the class's method
        else:
            hypermodel.fit = own


def _tell_group(roles, message):
    for member in range(1, roles.group_comm.size):
        p2p.send_object(roles.group_comm, member, message, TRIAL_TAG)


def _follow(tuner, roles, fit_args, fit_kwargs):
    import shutil
    import tempfile

    # The leader saves the trial's checkpoint; this rank's copy goes elsewhere,
    # so that two ranks never write one file.
    private = tempfile.mkdtemp(prefix="kdist-tune-")
    tuner._get_checkpoint_fname = lambda trial_id: os.path.join(
        private, f"trial_{trial_id}.weights.h5")
    try:
        while True:
            # Polled, not a collective: the leader may wait long for the oracle.
            _, (kind, state) = p2p.poll_object(roles.group_comm, TRIAL_TAG)
            if kind == "stop":
                return
            trial = kt.engine.trial.Trial.from_state(state)
            _run_together(roles, tuner.run_trial, trial, fit_args, fit_kwargs)
    finally:
        del tuner._get_checkpoint_fname
        shutil.rmtree(private, ignore_errors=True)


def _run_together(roles, run_trial, trial, args, kwargs):
    """Runs the trial here, then lets every rank of the group know how it went."""
    result, error = None, None
    try:
        with _team_starts_alike(run_trial, roles):
            result = run_trial(trial, *args, **kwargs)
    except Exception as caught:  # reported to the oracle by the group's leader
        error = caught
    outcomes = roles.group_comm.allgather_object(
        None if error is None else f"{type(error).__name__}: {error}")
    failed = [(rank, message) for rank, message in enumerate(outcomes) if message]
    if failed and roles.is_leader:
        # keras-tuner's service does not carry a trial's message to the oracle.
        logger.warning("trial %s failed on rank %d of group %d: %s", trial.trial_id,
                       failed[0][0], roles.group, failed[0][1])
    if not roles.is_leader:
        return None  # the leader reports the trial, failed or not
    if error is not None:
        raise error
    if failed:
        rank, message = failed[0]
        raise RuntimeError(f"Trial {trial.trial_id} failed on rank {rank} of group "
                           f"{roles.group}: {message}")
    return result
