"""The oracle's side of a distributed search that outlives its groups.

keras-tuner's oracle service hands a trial to whichever group asks, and
waits for that group's report however long it takes: a group whose process
died, or that hangs, keeps its trial forever. `GroupWatch` stands between
the service and the oracle. It hears from every group (the group's leader
sends a heartbeat while it trains) and gives up on a group that has been
silent for `lost_after` seconds: its trial goes back to the oracle's retry
queue with its partial metrics cleared, and another group runs it. A trial
held for longer than `trial_timeout` ends as failed instead, since another
group would only stall on it again. A group given up on gets no more trials.

A report that arrives late still counts once: the first report that ends a
trial is kept, whichever group sent it, and later ones are dropped.
"""

import logging
import threading
import time

import keras_tuner as kt

from kdist.tune import compat

logger = logging.getLogger(__name__)

# A heartbeat travels as the trial id of keras-tuner's GetTrial call, which
# carries no tuner id of its own.
BEAT = "kdist-beat:"
_STATUS = kt.engine.trial.TrialStatus


def beat_id(tuner_id, trial_id):
    """The id a group's heartbeat asks the service for."""
    return f"{BEAT}{tuner_id}/{trial_id}"


def check_timeouts(lost_after, trial_timeout):
    """Validates the two settings of `kdist.tune.search`; returns them as floats."""
    if isinstance(lost_after, bool) or not isinstance(lost_after, (int, float)) \
            or not lost_after > 0:
        raise ValueError(f"lost_after must be a number of seconds > 0; got {lost_after!r}.")
    if trial_timeout is not None and (isinstance(trial_timeout, bool) or not isinstance(
            trial_timeout, (int, float)) or not trial_timeout > 0):
        raise ValueError("trial_timeout must be None or a number of seconds > 0; got "
                         f"{trial_timeout!r}.")
    return float(lost_after), None if trial_timeout is None else float(trial_timeout)


class GroupWatch:
    """The oracle, as keras-tuner's `OracleServicer` sees it, minus lost groups.

    Args:
        oracle: the search's oracle.
        lost_after: seconds of silence from a group that holds a trial after
            which it is given up on and its trial is run by another group.
        trial_timeout: seconds one group may hold one trial (None: no limit);
            past it the trial ends as failed and the group is given up on.
        clock: a function returning seconds (tests pass their own).

    Example:

        >>> import tempfile, keras_tuner as kt
        >>> from kdist.tune import compat
        >>> oracle = kt.oracles.RandomSearchOracle(kt.Objective("loss", "min"), max_trials=2)
        >>> compat.set_project_dir(oracle, tempfile.mkdtemp(), "watch")  # as a tuner would
        >>> oracle.verbose = 0
        >>> oracle.hyperparameters.Float("x", 0, 1)  # doctest: +ELLIPSIS
        0...
        >>> now = [0.0]
        >>> watch = GroupWatch(oracle, lost_after=10, clock=lambda: now[0])
        >>> first = watch.create_trial("group0")
        >>> now[0] = 11.0
        >>> watch.check()
        ['group0']
        >>> watch.create_trial("group1").trial_id == first.trial_id
        True
        >>> watch.create_trial("group0").status
        'STOPPED'
    """

    def __init__(self, oracle, lost_after=60.0, trial_timeout=None, clock=time.monotonic):
        self.oracle = oracle
        self.lost_after, self.trial_timeout = check_timeouts(lost_after, trial_timeout)
        self.lost = set()
        self._clock = clock
        self._lock = threading.RLock()
        self._heard = {}  # tuner id -> when it last spoke
        self._held = {}  # tuner id -> (trial id, when it got it)

    # What keras-tuner's OracleServicer calls.

    def get_space(self):
        return self.oracle.get_space()

    def update_space(self, hyperparameters):
        with self._lock:
            return self.oracle.update_space(hyperparameters)

    def get_best_trials(self, num_trials=1):
        with self._lock:
            return self.oracle.get_best_trials(num_trials)

    def create_trial(self, tuner_id):
        with self._lock:
            if tuner_id in self.lost:
                return kt.engine.trial.Trial(self.oracle.get_space(), status=_STATUS.STOPPED)
            now = self._clock()
            self._heard[tuner_id] = now
            trial = self.oracle.create_trial(tuner_id)
            if trial.status == _STATUS.STOPPED:
                del self._heard[tuner_id]  # done, not silent
            elif trial.status == _STATUS.RUNNING and \
                    self._held.get(tuner_id, (None,))[0] != trial.trial_id:
                self._held[tuner_id] = (trial.trial_id, now)
            return trial

    def update_trial(self, trial_id, metrics, step=0):
        with self._lock:
            self._hear_from_holder(trial_id)
            if not self._accepts(trial_id):
                return self.oracle.trials[trial_id]
            return self.oracle.update_trial(trial_id, metrics, step=step)

    def end_trial(self, trial):
        with self._lock:
            self._hear_from_holder(trial.trial_id)
            if not self._accepts(trial.trial_id):
                return None
            for tuner_id, (held, _) in list(self._held.items()):
                if held == trial.trial_id:
                    del self._held[tuner_id]
            return self.oracle.end_trial(trial)

    def get_trial(self, trial_id):
        if trial_id.startswith(BEAT):
            return self._beat(*trial_id[len(BEAT):].split("/", 1))
        with self._lock:
            return self.oracle.get_trial(trial_id)

    # The watch itself.

    def holds(self, tuner_id):
        """The id of the trial `tuner_id` runs now, or None."""
        with self._lock:
            return self._held.get(tuner_id, (None,))[0]

    def check(self):
        """Gives up on groups silent for too long or past the trial timeout;
        returns the tuner ids given up on now."""
        given_up = []
        with self._lock:
            now = self._clock()
            for tuner_id, heard in list(self._heard.items()):
                trial_id, since = self._held.get(tuner_id, (None, now))
                if self.trial_timeout is not None and now - since > self.trial_timeout:
                    self._fail(tuner_id, trial_id, now - since)
                elif now - heard > self.lost_after:
                    self.give_up(tuner_id, f"it sent nothing for {now - heard:.0f} s")
                else:
                    continue
                given_up.append(tuner_id)
        return given_up

    def give_up(self, tuner_id, reason):
        """Takes `tuner_id`'s trial back for another group to run; it gets no more trials."""
        with self._lock:
            held = self._drop(tuner_id)
            if held is None:
                logger.warning("giving up on %s: %s", tuner_id, reason)
                return
            trial = self.oracle.ongoing_trials.pop(tuner_id, None)
            trial = trial or self.oracle.trials[held[0]]
            trial.status = _STATUS.INVALID
            trial.message = f"{tuner_id} was given up on: {reason}"
            trial.metrics = compat.empty_metrics()
            # keras-tuner's queue pops from the end: this trial runs next.
            compat.retry_next(self.oracle, trial.trial_id)
            compat.save_trial(self.oracle, trial)
            self.oracle.save()
            logger.warning("giving up on %s (%s); trial %s goes back to the queue", tuner_id,
                           reason, trial.trial_id)

    def _drop(self, tuner_id):
        """Marks `tuner_id` lost; returns what it held, `(trial id, since)` or None."""
        self.lost.add(tuner_id)
        self._heard.pop(tuner_id, None)
        self.oracle.tuner_ids.discard(tuner_id)
        return self._held.pop(tuner_id, None)

    def _fail(self, tuner_id, trial_id, held_for):
        self._drop(tuner_id)
        trial = self.oracle.trials[trial_id]
        trial.status = _STATUS.FAILED
        trial.message = (f"{tuner_id} held it for {held_for:.0f} s, past trial_timeout="
                         f"{self.trial_timeout:g} s")
        logger.warning("trial %s failed: %s; giving up on %s", trial_id, trial.message,
                       tuner_id)
        self.oracle.end_trial(trial)

    def _beat(self, tuner_id, trial_id):
        with self._lock:
            held = self._held.get(tuner_id, (None,))[0]
            if tuner_id not in self.lost and held == trial_id:
                self._heard[tuner_id] = self._clock()
                return self.oracle.trials[trial_id]
            # The group learns that its trial was taken from it.
            return kt.engine.trial.Trial(self.oracle.get_space(), trial_id=trial_id,
                                         status=_STATUS.STOPPED)

    def _hear_from_holder(self, trial_id):
        for tuner_id, (held, _) in self._held.items():
            if held == trial_id:
                self._heard[tuner_id] = self._clock()

    def _accepts(self, trial_id):
        """Whether a report on `trial_id` counts: not once it has ended."""
        if trial_id in self.oracle.end_order:
            logger.info("a late report on trial %s, which has ended, is dropped", trial_id)
            return False
        # A group given up on may come back with it before anyone else took it.
        compat.unqueue_retry(self.oracle, trial_id)
        return True
