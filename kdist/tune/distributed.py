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

A group's leader sends the oracle a heartbeat while it trains. The oracle
gives up on a group that has been silent for `lost_after` seconds (its
process died, or it hangs) and has another group run its trial
(`kdist.tune.watch`); under MPI's fault tolerance (`kdist run
--fault-tolerant`) the search then finishes on the groups that are left.

How a trial travels (gRPC between the leaders and rank 0, MPI messages
inside a group and to rank 0)::

    rank 0: oracle + GroupWatch behind keras-tuner's oracle service
       ^  |         ^                   ^
       |  | trial   | heartbeat         | DONE (MPI, when the group stops)
       |  v         | (every few s)     |
    group leader (each group's first rank): tuner.search as a keras-tuner worker
       |   asks for a trial, reports its metrics and its end
       |
       | TRIAL: the trial's state, or "stop" (MPI)
       v
    followers: run_trial on the same trial, no oracle of their own
       |
       +--> allgather of every rank's outcome; the leader reports it

    rank 0, once every group is done or given up on:
       FINISHED (MPI) --> every rank, which then reloads the finished search

The leader's part goes through keras-tuner's own seam, the tuner's `oracle`:
while the search runs, the leader's tuner holds a `_LeaderOracle` (rank 0's
oracle through the service, with the group told each trial and heard from
before the trial's end is reported) and the group's `tuner_id`. A follower's
tuner runs `run_trial` with its `directory` pointed at a scratch directory, so
that its checkpoints never meet the leader's. Both are given back when the
search ends, however it ends; the tuner's class and the environment are never
changed.
"""

import contextlib
import logging
import os
import socket
import time
from concurrent import futures

import keras_tuner as kt

from kdist._args import whole_number
from kdist.comm import p2p, processes
from kdist.tune import compat, storage, watch

logger = logging.getLogger(__name__)

DONE_TAG, TRIAL_TAG, FINISHED_TAG = 7301, 7302, 7303
_current = None


class Roles:
    """Which part of the search this rank plays, and the communicators it needs.

    `current_roles()` gives this rank's during a distributed search.

    Args:
        comm: the job's communicator (all N ranks).
        folds_per_group: fold teams per group (`KFoldTuner` only).
        workers_per_fold: data-parallel ranks per fold team.

    Attributes:
        groups: the number of groups, `(N - 1) / (folds_per_group *
            workers_per_fold)`.
        group: this rank's group (-1 on rank 0).
        fold_team: this rank's fold team within its group.
        worker: this rank's place within its fold team.
        is_master: whether this rank runs the oracle (rank 0).
        is_leader: whether this rank is its group's first, which talks to the
            oracle.
        group_comm: the communicator of this rank's group.
        team_comm: the communicator of this rank's fold team (what
            `trial_comm()` returns).

    Raises:
        ValueError: N is not `1 + groups * folds_per_group * workers_per_fold`
            with at least one group.
    """

    def __init__(self, comm, folds_per_group=1, workers_per_fold=1):
        self.folds_per_group = whole_number(folds_per_group, "folds_per_group", minimum=1)
        self.workers_per_fold = whole_number(workers_per_fold, "workers_per_fold", minimum=1)
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
        self.project_dir = None  # the tuner's project folder, which every rank shares
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


def search(tuner, *fit_args, folds_per_group=1, workers_per_fold=1, comm=None,
           lost_after=60.0, trial_timeout=None, **fit_kwargs):
    """Runs `tuner.search(*fit_args, **fit_kwargs)` over all ranks of `comm`.

    With `N = 1 + groups * folds_per_group * workers_per_fold` ranks, rank 0
    serves the oracle through keras-tuner's own oracle service (gRPC), and
    each group of `folds_per_group x workers_per_fold` ranks asks it for
    trials and evaluates one at a time: the group's first rank talks to the
    oracle and hands each trial to the others over MPI. Inside a group,
    `KFoldTuner` deals the folds to the fold teams, and a fold team trains
    data-parallel. Results go to the oracle's directory, which all ranks
    must share, so the same command run again resumes the search with the
    finished trials kept.

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
        lost_after: seconds a group may go without a heartbeat while it holds
            a trial; then the oracle gives up on it and another group runs
            the trial from the start. Groups given up on get no more trials.
        trial_timeout: seconds a group may hold one trial (default: no
            limit); past it the trial ends as `FAILED` and the group is given
            up on. It has no effect on one process.

    A group that dies only leaves the others running when MPI runs with
    fault tolerance (`kdist run --fault-tolerant`); otherwise MPI ends the
    job, and the same command run again resumes the search.

    Raises:
        ValueError: `lost_after` or `trial_timeout` is not a number of seconds
            > 0 (on every rank, before anything starts); `KERASTUNER_*`
            variables are set (keras-tuner's own distributed tuning: unset
            them); `folds_per_group > 1` without a `KFoldTuner`, or more fold
            teams than folds; a number of ranks that does not split into groups
            (see `Roles`).
    """
    global _current
    lost_after, trial_timeout = watch.check_timeouts(lost_after, trial_timeout)
    if comm is None:
        processes.init()
        comm = processes.world()
    if comm.size == 1:
        if trial_timeout is not None:
            logger.warning("trial_timeout has no effect in a search on one process")
        return tuner.search(*fit_args, **fit_kwargs)
    ours = sorted(name for name in os.environ if name.startswith("KERASTUNER_"))
    if ours:
        raise ValueError(f"{', '.join(ours)} set: that is keras-tuner's own distributed "
                         "tuning, in which the tuner's oracle is a client of another "
                         "process's. kdist's search runs the oracle service on rank 0 itself; "
                         "unset them.")
    if folds_per_group > 1 and not getattr(tuner, "trains_folds", False):
        raise ValueError("folds_per_group > 1 needs a kdist.tune.KFoldTuner.")
    roles = Roles(comm, folds_per_group, workers_per_fold)
    # The folder every rank shares, read by a follower whose own directory is scratch.
    roles.project_dir = tuner.project_dir
    storage.order_trials(tuner.oracle)  # a resumed search reloaded them in listing order
    if getattr(tuner, "trains_folds", False) and roles.folds_per_group > tuner.folds:
        raise ValueError(f"folds_per_group ({roles.folds_per_group}) exceeds the tuner's "
                         f"{tuner.folds} folds.")
    # Every rank has built its tuner (and cleared an overwritten directory) before
    # the oracle writes anything.
    comm.barrier()
    address = (_start_service(tuner, roles, lost_after, trial_timeout) if roles.is_master
               else None)
    address = comm.bcast_object(address)
    _current = roles
    try:
        if roles.is_master:
            _serve(tuner, roles, *address)
        elif roles.is_leader:
            with _progressing(roles.comm):
                _lead(tuner, roles, address, lost_after, fit_args, fit_kwargs)
        else:
            with _progressing(roles.comm):
                _follow(tuner, roles, fit_args, fit_kwargs)
    finally:
        _current = None
    # Not a barrier: ranks of lost groups may be dead or hung.
    if not roles.is_master:
        _wait_for(roles.comm, 0, FINISHED_TAG)
        tuner.oracle.reload()
        # Ties then rank alike here and on the master.
        storage.order_trials(tuner.oracle)
    return None


def _start_service(tuner, roles, lost_after, trial_timeout):
    import grpc

    local = processes.local_size() == roles.comm.size
    host = "127.0.0.1" if local else socket.gethostbyname(socket.gethostname())
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max(2, roles.groups)))
    roles.watch = watch.GroupWatch(tuner.oracle, lost_after, trial_timeout)
    compat.serve_oracle(roles.watch, server)
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
    waiting = {f"group{g}": leader for g, leader in enumerate(roles.leaders)}
    try:
        while waiting:
            for tuner_id, leader in list(waiting.items()):
                try:
                    done, _ = p2p.try_recv_object(roles.comm, leader, DONE_TAG)
                except p2p.PeerFailed:
                    roles.watch.give_up(tuner_id, f"its leader, rank {leader}, died")
                    done = True
                if done and roles.watch.holds(tuner_id) is not None:
                    roles.watch.give_up(tuner_id, "it lost a rank during its trial")
                if done:
                    del waiting[tuner_id]
            for tuner_id in roles.watch.check():
                waiting.pop(tuner_id, None)
            time.sleep(0.05)
        # Before the service closes: a group given up on that is still running
        # then stops asking it (see _PatientClient).
        _tell_everyone_finished(roles)
        time.sleep(0.5)
    finally:
        roles.server.stop(grace=None)
    trials = tuner.oracle.trials.values()
    counts = {}
    for trial in trials:
        counts[trial.status] = counts.get(trial.status, 0) + 1
    lost = sorted(roles.watch.lost)
    logger.info("search done in %.1f s: %s%s", time.perf_counter() - started,
                ", ".join(f"{n} {s.lower()}" for s, n in sorted(counts.items())),
                f"; lost {', '.join(lost)}" if lost else "")


def _tell_everyone_finished(roles):
    for rank in range(1, roles.comm.size):
        try:
            p2p.send_object(roles.comm, rank, None, FINISHED_TAG)
        except Exception as error:  # noqa: BLE001  (a dead rank, under fault tolerance)
            logger.debug("rank %d did not hear the end of the search: %s", rank, error)


def _wait_for(comm, source, tag):
    while not p2p.try_recv_object(comm, source, tag)[0]:
        time.sleep(0.05)


class _PatientClient:
    """keras-tuner's `OracleClient`, pausing when the oracle has no trial yet,
    and silent once the search is over.

    A group the oracle gave up on may still be running when the other groups
    finish and the service closes; keras-tuner's client would then wait an
    hour for it. So each call first checks whether the master has announced
    the end (which it does before it closes the service).
    """

    def __init__(self, oracle, comm, address, tuner_id):
        self._client = compat.oracle_client(oracle, address, tuner_id)
        self._local, self._comm = oracle, comm

    def __getattr__(self, name):
        return getattr(self._client, name)

    def _over(self):
        return self._comm.mpi.Iprobe(source=0, tag=FINISHED_TAG)

    def _unserved(self, trial_id=None, status=kt.engine.trial.TrialStatus.RUNNING):
        return kt.engine.trial.Trial(self._local.get_space(), trial_id=trial_id, status=status)

    def update_trial(self, trial_id, metrics, step=0):
        if self._over():
            return self._unserved(trial_id)
        return self._client.update_trial(trial_id, metrics, step=step)

    def end_trial(self, trial):
        if self._over():
            logger.warning("trial %s ended after the search did; its result is dropped",
                           trial.trial_id)
            return None
        return self._client.end_trial(trial)

    def get_trial(self, trial_id):
        return self._unserved(trial_id) if self._over() else self._client.get_trial(trial_id)

    def create_trial(self, tuner_id):
        if self._over():
            return self._unserved(status=kt.engine.trial.TrialStatus.STOPPED)
        trial = self._client.create_trial(tuner_id)
        if trial.status == kt.engine.trial.TrialStatus.IDLE:
            # A generational oracle waits for other groups' trials.
            time.sleep(0.2)
        return trial

    def beat(self, tuner_id, trial_id, timeout):
        """Tells the oracle this group still runs `trial_id`; False if the
        oracle has given the trial to another group meanwhile."""
        trial = compat.ask_for_trial(self._client, watch.beat_id(tuner_id, trial_id), timeout)
        return trial.status != kt.engine.trial.TrialStatus.STOPPED


class _GroupBroken(kt.errors.FatalError):
    """A rank of this group died: the group leaves the search, its trial unreported."""


def _lost_a_rank(error):
    from kdist.comm import recovery

    return isinstance(error, p2p.PeerFailed) or recovery.caused_by_lost_ranks(error)


@contextlib.contextmanager
def _every(seconds, action, name):
    """Calls `action()` from a thread every `seconds` while the block runs,
    until it returns False."""
    import threading

    stop = threading.Event()

    def repeat():
        while not stop.wait(seconds) and action() is not False:
            pass

    thread = threading.Thread(target=repeat, name=name, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


@contextlib.contextmanager
def _progressing(comm, every=0.1):
    """Keeps MPI's progress engine turning from a thread while the block runs.

    Under fault tolerance Open MPI's failure detector sends this process's
    heartbeats only from inside MPI calls; a group that trains for seconds
    without one would be declared dead by the others.
    """
    if not processes.mpi_threads_supported():
        yield  # MPI calls from a second thread are not allowed here
        return

    def turn():
        try:
            comm.mpi.Iprobe(source=0, tag=FINISHED_TAG)
        except Exception:  # noqa: BLE001  (the master died: the job ends anyway)
            return False
        return True

    with _every(every, turn, "kdist-mpi-progress"):
        yield


def _beating(client, tuner_id, trial_id, lost_after):
    """Sends heartbeats for the trial from a thread for as long as the block runs.

    From a thread, so that a long step does not silence the group; a process
    that dies or is stopped goes silent.
    """
    interval = max(0.2, min(5.0, lost_after / 6))
    warned = []

    def beat():
        try:
            held = client.beat(tuner_id, trial_id, timeout=interval)
        except Exception as error:  # noqa: BLE001  (the next beat tries again)
            logger.debug("heartbeat for trial %s: %s", trial_id, error)
            return True
        if not held and not warned:
            warned.append(trial_id)
            logger.warning("the oracle has given trial %s to another group; this group "
                           "finishes it, and the first result to arrive counts", trial_id)
        return True

    return _every(interval, beat, f"kdist-beat-{tuner_id}")


class _LeaderOracle:
    """A group leader's tuner's oracle while the search runs: rank 0's oracle, reached
    through keras-tuner's service, with the group's part played around it.

    keras-tuner's seam for a distributed search is the tuner's `oracle`: the
    leader's tuner runs its own `search` with this in its place. Each trial it
    hands out is also sent to the group's other ranks, a heartbeat goes to the
    oracle while the trial runs, and before the trial's end is reported every
    rank of the group says how its run went. The oracle's files are rank 0's,
    so `save` writes nothing here.
    """

    def __init__(self, client, roles, tuner_id, lost_after):
        self._client, self._roles = client, roles
        self._tuner_id, self._lost_after = tuner_id, lost_after
        self._running = None  # (trial id, the heartbeat's context) of the trial in hand

    def __getattr__(self, name):
        return getattr(self._client, name)

    def save(self):
        pass

    def reload(self):
        pass

    def create_trial(self, tuner_id):
        trial = self._client.create_trial(tuner_id)
        if trial.status == kt.engine.trial.TrialStatus.RUNNING:
            self._guard(lambda: _tell_group(self._roles, ("trial", trial.get_state())),
                        trial.trial_id)
            beating = _beating(self._client, self._tuner_id, trial.trial_id, self._lost_after)
            beating.__enter__()
            self._running = (trial.trial_id, beating)
        return trial

    def end_trial(self, trial):
        unsuccessful = trial.status in (kt.engine.trial.TrialStatus.FAILED,
                                        kt.engine.trial.TrialStatus.INVALID)
        failed = self.finish_trial(trial.message if unsuccessful else None)
        if failed and not unsuccessful:
            # As keras-tuner marks a trial whose run raised: another try may do better.
            trial.status = kt.engine.trial.TrialStatus.INVALID
            trial.message = failed
        return self._client.end_trial(trial)

    def finish_trial(self, error):
        """Gathers every rank's outcome of the trial in hand (this rank's: `error`, a
        message or None) and stops its heartbeat. Returns the first other rank's failure,
        as a message, or None. Nothing to do without a trial in hand."""
        if self._running is None:
            return None
        trial_id, beating = self._running
        self._running = None
        try:
            outcomes = self._guard(lambda: self._roles.group_comm.allgather_object(error),
                                   trial_id)
        finally:
            beating.__exit__(None, None, None)
        failed = [(rank, message) for rank, message in enumerate(outcomes) if message]
        if failed:
            rank, message = failed[0]
            # keras-tuner's service does not carry a trial's message to the oracle.
            logger.warning("trial %s failed on rank %d of group %d: %s", trial_id, rank,
                           self._roles.group, message)
            if rank != 0:
                return (f"Trial {trial_id} failed on rank {rank} of group "
                        f"{self._roles.group}: {message}")
        return None

    def _guard(self, action, trial_id):
        try:
            return action()
        except Exception as error:
            if _lost_a_rank(error):
                raise _GroupBroken(f"group {self._roles.group} lost a rank during trial "
                                   f"{trial_id}: {error}") from error
            raise


@contextlib.contextmanager
def _standing_in(tuner, **values):
    """Sets public attributes of `tuner` (its `oracle`, `tuner_id`, `directory`) while
    the block runs, and gives the old values back afterwards, however it ends."""
    before = {name: getattr(tuner, name) for name in values}
    for name, value in values.items():
        setattr(tuner, name, value)
    try:
        yield tuner
    finally:
        for name, value in before.items():
            setattr(tuner, name, value)


def _lead(tuner, roles, address, lost_after, fit_args, fit_kwargs):
    tuner_id = f"group{roles.group}"
    oracle = _LeaderOracle(_PatientClient(tuner.oracle, roles.comm, address, tuner_id),
                           roles, tuner_id, lost_after)
    try:
        with _standing_in(tuner, oracle=oracle, tuner_id=tuner_id):
            try:
                tuner.search(*fit_args, **_with_team_start(roles, tuner, fit_kwargs))
            except BaseException as error:
                # The search stopped with a trial in hand: the group still hears how
                # this rank's run went, before it hears to stop.
                oracle.finish_trial(f"{type(error).__name__}: {error}")
                raise
    except _GroupBroken as error:
        # The oracle hears of it by this group's end while it holds a trial.
        logger.warning("%s; the group leaves the search, and its trial goes to another "
                       "group", error)
    finally:
        _tell_group(roles, ("stop", None))
        p2p.send_object(roles.comm, 0, roles.group, DONE_TAG)


def _with_team_start(roles, tuner, kwargs):
    """`run_trial`'s keyword arguments, with a broadcast from the team's first
    rank in front of the `callbacks` keras-tuner passes on to `fit`.

    `KFoldTuner` broadcasts each fold's model itself; any other tuner's
    hypermodel builds one model per rank, each with its own random
    initialisation, so a data-parallel team would not start alike.
    """
    if roles.team_comm.size == 1 or getattr(tuner, "trains_folds", False):
        return kwargs
    kwargs = dict(kwargs)
    kwargs["callbacks"] = [_team_broadcast(roles.team_comm)] + list(
        kwargs.get("callbacks") or [])
    return kwargs


def _team_broadcast(comm):
    from kdist.callbacks.broadcast import BroadcastGlobalVariablesCallback
    from kdist.coordination import team

    class TeamBroadcast(BroadcastGlobalVariablesCallback):
        # keras-tuner deep-copies a search's callbacks for every execution; the
        # copy must keep the team's communicator, not duplicate it.
        def __deepcopy__(self, memo):
            return TeamBroadcast(self.root_rank, comm=comm)

        def on_train_begin(self, logs=None):
            # Without it each rank would train alone on its own batches, and the
            # team's ranks drift apart while the search reports one of them.
            reducing = team.comm_of(self.model) if team.trained_together(self.model) \
                else None
            if reducing is None or reducing.size != comm.size:
                raise ValueError(
                    f"workers_per_fold={comm.size} trains each trial on {comm.size} ranks, "
                    "but this model's optimizer does not average gradients over them: "
                    "build it with kdist.DistributedOptimizer(optimizer, "
                    "comm=kdist.tune.trial_comm()).")
            super().on_train_begin(logs)

    return TeamBroadcast(0, comm=comm)


def _tell_group(roles, message):
    for member in range(1, roles.group_comm.size):
        try:
            p2p.send_object(roles.group_comm, member, message, TRIAL_TAG)
        except Exception as error:
            # A dead member need not hear that the group stops; the others do.
            if message[0] == "trial" or not _lost_a_rank(error):
                raise


def _follow(tuner, roles, fit_args, fit_kwargs):
    import shutil
    import tempfile

    # A follower's checkpoints go to a directory of its own, so that two ranks never
    # write one file (the leader's copy is the trial's).
    scratch = tempfile.mkdtemp(prefix="kdist-tune-")
    try:
        with _standing_in(tuner, directory=scratch):
            while True:
                # Polled, not a collective: the leader may wait long for the oracle.
                found, message = p2p.try_recv_object(roles.group_comm, 0, TRIAL_TAG)
                if not found:
                    time.sleep(0.05)
                    continue
                kind, state = message
                if kind == "stop":
                    return
                _run_with_the_group(roles, tuner, kt.engine.trial.Trial.from_state(state),
                                    fit_args, fit_kwargs)
    except Exception as error:
        if not _lost_a_rank(error):
            raise
        logger.warning("group %d lost a rank (%s); this rank leaves the search", roles.group,
                       error)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _run_with_the_group(roles, tuner, trial, args, kwargs):
    """Runs the trial on this follower, then tells the group's leader how it went."""
    error = None
    try:
        tuner.run_trial(trial, *args, **_with_team_start(roles, tuner, kwargs))
    except Exception as caught:  # reported to the oracle by the group's leader
        error = f"{type(caught).__name__}: {caught}"
    roles.group_comm.allgather_object(error)
