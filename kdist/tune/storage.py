"""Search state on disk that survives a kill, and reads back the same everywhere.

keras-tuner writes `oracle.json`, each `trial.json` and the tuner's file by
truncating the file and then writing it, so a process killed in between
leaves an empty file and the search cannot be resumed. Here each file is
written to a temporary name next to it and renamed over it: a reader sees
the old state or the new one, never a part.

keras-tuner also reloads trials in the order the file system lists their
directories, and ranks trials with equal scores in that order; `order_trials`
puts them back in the order they were created, so every process (and a
resumed search) names the same best trial. And its last save lists the last
finished trial as running, so a reloaded search would train it again;
`forget_finished_retries` drops it.

kdist's own oracles and tuners save this way (`WholeSaves`,
`WholeTunerSaves`); keras-tuner's own classes keep keras-tuner's writer.
"""

import json
import os

import numpy as np

from kdist._files import write_atomically
from kdist.tune import compat


def write_json(path, obj):
    """Writes `obj` as JSON to `path` whole or not at all (local paths).

    Paths with a scheme (`gs://...`) go through keras-tuner's own writer.
    """
    path = os.fspath(path)
    if "://" in path:
        return compat.save_json(path, obj)
    text = json.dumps(obj, default=_plain)
    write_atomically(path, lambda stream: stream.write(text), binary=False, suffix=".json")
    return text


def _plain(value):
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def trial_order(trial_id):
    """Sort key: trial ids are counts (zero-padded by keras-tuner), compared as numbers."""
    return (len(trial_id), trial_id)


def order_trials(oracle):
    """Puts `oracle.trials` back in the order the trials were created."""
    oracle.trials = dict(sorted(oracle.trials.items(), key=lambda item: trial_order(item[0])))


def save_oracle(oracle):
    write_json(compat.oracle_file(oracle), oracle.get_state())


def save_trial(oracle, trial):
    write_json(os.path.join(compat.trial_directory(oracle, trial.trial_id), "trial.json"),
               trial.get_state())


class WholeTunerSaves:
    """Mixin for a `keras_tuner.Tuner`: its file, and its oracle's, saved whole."""

    def save(self):
        if not compat.is_worker(self):
            self.oracle.save()
        write_json(compat.tuner_file(self), self.get_state())


class WholeSaves(compat.SavesTrialsThrough):
    """Mixin for a `keras_tuner.Oracle`: whole-file saves, creation-ordered reloads."""

    def save(self):
        save_oracle(self)

    def write_trial(self, trial):
        save_trial(self, trial)

    def reload(self):
        super().reload()
        order_trials(self)
        forget_finished_retries(self)
        requeue_orphans(self)


def forget_finished_retries(oracle):
    """Takes finished trials out of the retry queue of a reloaded oracle.

    keras-tuner saves the oracle inside `end_trial` before it lets the trial
    go, so the last state on disk lists the last finished trial as still
    running; reloading queues it for a retry and the resumed search trains it
    again. Trials that crashed and have retries left are INVALID, not
    finished, and stay queued.
    """
    finished = ("COMPLETED", "FAILED")
    queue = []
    for trial_id in compat.retry_queue(oracle):
        trial = oracle.trials.get(trial_id)
        if trial is not None and trial.status not in finished and trial_id not in queue:
            queue.append(trial_id)
    compat.set_retry_queue(oracle, queue)


def requeue_orphans(oracle):
    """Queues the reloaded trials that are still running but that no queue holds.

    `create_trial` writes the new trial's file before the oracle's, so a kill
    in between reloads a running trial that is neither ongoing nor queued.
    Returns their ids, oldest first.
    """
    queue = compat.retry_queue(oracle)
    held = set(queue) | {trial.trial_id for trial in oracle.ongoing_trials.values()}
    orphans = [trial_id for trial_id, trial in oracle.trials.items()
               if trial.status == "RUNNING" and trial_id not in held]
    # The queue hands out its last entry first: the oldest orphan runs first.
    compat.set_retry_queue(oracle, list(reversed(orphans)) + queue)
    return orphans
