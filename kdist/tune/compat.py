"""Every use kdist makes of keras-tuner's private API, and the versions it is tested with.

kdist's oracles and tuners build on keras-tuner's public classes and hooks
(`populate_space`, `run_trial`, `save_model`, `get_state`). A few things
have no public form: an oracle's random and duplicate-free values, its
retry queue and file names, a tuner's checkpoint path, model building and
worker role (`_is_worker`), and the gRPC oracle service and client (built
here without its constructor, which reads `KERASTUNER_*` variables).
They are reached here and nowhere else, each through one small function or
mixin whose docstring names the internals it relies on. Those internals may
change in any release, so the packaging pins keras-tuner to
`TESTED_KERAS_TUNER`, importing `kdist.tune` with another version warns, and
`tests/test_tune_private.py` fails if another kdist module reaches past
keras-tuner's public API.
"""

import numbers
import os
import threading
import warnings
import zlib

import keras_tuner as kt
from packaging.specifiers import SpecifierSet
from packaging.version import Version

TESTED_KERAS_TUNER = ">=1.4.7,<1.5"
"""The keras-tuner versions kdist's search is tested with, as a version specifier.

kdist reaches a few of keras-tuner's private internals, which may change in any
release: the `tune` extra pins keras-tuner to these versions, and importing
`kdist.tune` with another one warns.
"""


def keras_tuner_is_tested(version=None):
    """Whether `version` (default: the installed one) is in the tested range."""
    return Version(version or kt.__version__) in SpecifierSet(TESTED_KERAS_TUNER)


def warn_if_untested():
    if not keras_tuner_is_tested():
        warnings.warn(f"kdist.tune is tested with keras-tuner {TESTED_KERAS_TUNER}; "
                      f"{kt.__version__} is installed. Install a tested version "
                      f"(pip install 'keras-tuner{TESTED_KERAS_TUNER}') if searches fail.",
                      stacklevel=3)


# Whoever imports this module is about to lean on the private API below.
warn_if_untested()


def keep_seed(oracle, seed):
    """Makes `seed=0` a seed: keras-tuner's Oracle replaces any false seed by a random one.

    Relies on `Oracle._seed_state`, the counter its random draws advance.
    """
    if seed is not None:
        if not isinstance(seed, numbers.Integral) or seed < 0:
            raise ValueError(f"seed must be a non-negative integer; got {seed!r}.")
        oracle.seed = int(seed)
        oracle._seed_state = int(seed)


def trial_number(trial_id):
    """A non-negative integer for a trial id: its count when it is one (keras-tuner's
    ids are zero-padded counts), otherwise a stable hash, so any id seeds the same way."""
    text = str(trial_id)
    return int(text) if text.isdigit() else zlib.crc32(text.encode())


# The oracle.

def random_values(oracle):
    """Random values no trial has had yet, or None when the space is exhausted.

    Relies on `Oracle._random_values`.
    """
    return oracle._random_values()


def is_duplicate(oracle, values):
    """Whether a trial of `oracle` already had `values`.

    Relies on `Oracle._duplicate` (which hashes through `_compute_values_hash`,
    see `ComparesValues`).
    """
    return oracle._duplicate(values)


def set_project_dir(oracle, directory, project_name):
    """Points an oracle used without a tuner at its directory, as a tuner would.

    Relies on `Oracle._set_project_dir`.
    """
    oracle._set_project_dir(directory, project_name)


def oracle_file(oracle):
    """The path of `oracle.json`. Relies on `Oracle._get_oracle_fname`."""
    return oracle._get_oracle_fname()


def trial_directory(oracle, trial_id):
    """The directory of one trial's files. Relies on `Oracle._get_trial_dir`."""
    return oracle._get_trial_dir(trial_id)


def save_trial(oracle, trial):
    """Writes one trial's `trial.json`. Relies on `Oracle._save_trial`."""
    oracle._save_trial(trial)


def retry_queue(oracle):
    """The ids of trials waiting to run again, the next one last (a copy).

    Relies on `Oracle._retry_queue`, which `create_trial` pops from its end.
    """
    return list(oracle._retry_queue)


def set_retry_queue(oracle, trial_ids):
    """Replaces the retry queue (the next trial last). Relies on `Oracle._retry_queue`."""
    oracle._retry_queue = list(trial_ids)


def retry_next(oracle, trial_id):
    """Queues `trial_id` to be the next trial handed out. Relies on `Oracle._retry_queue`."""
    oracle._retry_queue.append(trial_id)


def unqueue_retry(oracle, trial_id):
    """Takes `trial_id` out of the retry queue; whether it was there.

    Relies on `Oracle._retry_queue`.
    """
    if trial_id in oracle._retry_queue:
        oracle._retry_queue.remove(trial_id)
        return True
    return False


class SavesTrialsThrough:
    """Oracle mixin: every save of one trial goes through `self.write_trial(trial)`.

    Relies on `Oracle._save_trial`, which keras-tuner calls whenever a trial
    changes; the class using this mixin defines `write_trial`.
    """

    def _save_trial(self, trial):
        self.write_trial(trial)


class ComparesValues:
    """Oracle mixin: two trials are duplicates when `self.compared_values(values)` match.

    Relies on `Oracle._compute_values_hash`, which `_duplicate` and
    `create_trial` use to refuse repeated values; the class using this mixin
    defines `compared_values`.
    """

    def _compute_values_hash(self, values):
        return super()._compute_values_hash(self.compared_values(values))


def empty_metrics():
    """A trial's metrics with nothing recorded.

    Relies on `keras_tuner.src.engine.metrics_tracking.MetricsTracker`.
    """
    from keras_tuner.src.engine import metrics_tracking

    return metrics_tracking.MetricsTracker()


def save_json(path, obj):
    """keras-tuner's own JSON writer, which handles remote paths (`gs://...`).

    Relies on `keras_tuner.src.utils.save_json`.
    """
    from keras_tuner.src import utils

    return utils.save_json(path, obj)


# The tuner.

def build_model(tuner, hp):
    """A model of `hp` built the way keras-tuner's tuners build one (the Keras
    session cleared, invalid models retried, oversized ones refused).

    Relies on `Tuner._try_build`.
    """
    return tuner._try_build(hp)


def checkpoint_path(tuner, trial_id):
    """Where the tuner keeps a trial's weights. Relies on `Tuner._get_checkpoint_fname`."""
    return tuner._get_checkpoint_fname(trial_id)


def tuner_file(tuner):
    """The path of the tuner's own state file. Relies on `BaseTuner._get_tuner_fname`."""
    return tuner._get_tuner_fname()


def is_worker(tuner):
    """Whether the tuner is a worker of a distributed search, which leaves the oracle's
    files to the chief. Relies on `BaseTuner._is_worker`."""
    return tuner._is_worker()


# The distributed oracle service.

def serve_oracle(oracle, server):
    """Adds keras-tuner's gRPC oracle service, answering from `oracle`, to a
    `grpc.Server` (any object with the Oracle methods the service calls).

    Relies on `keras_tuner.src.protos` and
    `keras_tuner.src.distribute.oracle_chief.OracleServicer`.
    """
    from keras_tuner.src import protos
    from keras_tuner.src.distribute import oracle_chief

    protos.get_service_grpc().add_OracleServicer_to_server(
        oracle_chief.OracleServicer(oracle), server)


# Held while keras-tuner's client reads its settings from the environment.
_ENVIRONMENT_LOCK = threading.Lock()


def oracle_client(oracle, address, tuner_id):
    """keras-tuner's client of the oracle service at `address` (host, port),
    asking for trials as `tuner_id`, with `oracle` answering the few questions
    the client does not send (its objective, for one).

    keras-tuner's constructor reads the address and the id from the
    `KERASTUNER_*` environment variables only. They are set for the moment it
    runs and taken away at once, under a lock, so that the search leaves
    nothing in `os.environ` (keras-tuner's tuners read them when built).

    Relies on `keras_tuner.src.distribute.oracle_client.OracleClient`.
    """
    from keras_tuner.src.distribute import oracle_client as client_module

    values = {"KERASTUNER_ORACLE_IP": str(address[0]),
              "KERASTUNER_ORACLE_PORT": str(address[1]), "KERASTUNER_TUNER_ID": tuner_id}
    with _ENVIRONMENT_LOCK:
        before = {name: os.environ.get(name) for name in values}
        os.environ.update(values)
        try:
            return client_module.OracleClient(oracle)
        finally:
            for name, value in before.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def ask_for_trial(client, trial_id, timeout):
    """The service's answer to a `GetTrial` call for `trial_id`, waiting at most
    `timeout` seconds (keras-tuner's client would wait an hour).

    Relies on `OracleClient.stub`, `keras_tuner.src.protos` and `Trial.from_proto`.
    """
    from keras_tuner.src import protos

    request = protos.get_service().GetTrialRequest(trial_id=trial_id)
    response = client.stub.GetTrial(request, timeout=timeout)
    return kt.engine.trial.Trial.from_proto(response.trial)
