"""Ranks that agree at every epoch's end: one set of metrics, one decision to stop, no drift.

Keras's `fit` runs callbacks on each rank with that rank's own logs. Without
`MetricAverageCallback`, `EarlyStopping` on one rank may stop its `fit` while
the others train on (and wait for it in the next gradient allreduce), and
`ReduceLROnPlateau` may lower one rank's learning rate alone, so that the
ranks drift apart without a word. `Agreement` keeps them together:

- a callback placed first averages the epoch's numeric logs over the ranks
  (after `kdist.join`, as every epoch-end collective of kdist's does), so
  every later callback (`EarlyStopping`, `ReduceLROnPlateau`,
  `ModelCheckpoint`, `History`, the progress bar) decides on the same numbers;
- small sentinels after each callback note which one set
  `model.stop_training`;
- a callback placed last runs one small collective: each rank's decision to
  stop (and who made it), its learning rate(s) and, every `check_every`
  epochs, a digest of each variable of the model and its optimizer. If some
  ranks stop, every rank stops with them, with a warning naming the ranks
  and callbacks; if learning rates or variables differ, every rank raises
  `ValueError` naming the ranks, the first variable that differs and the
  epoch;
- at the start of `fit`, the first callback tells every rank which files
  the ranks' saving callbacks write, and Keras's own `ModelCheckpoint` and
  `BackupAndRestore` are run through `kdist.callbacks.writing_once`, so that
  one rank writes each file (see `kdist.callbacks.saving`).

Keras offers no hook through which a library could add callbacks to every
`fit`, so the agreement is asked for: pass `Agreement().around(callbacks)` as
fit's callbacks. Horovod-style scripts that put `MetricAverageCallback` before
their deciding callbacks and save on rank 0 only need nothing more; the
agreement adds the checks (who stopped, learning rates, variables) and lets
every rank keep its saving callbacks.
"""

import logging

import keras
import numpy as np

from kdist import _args
from kdist.callbacks import saving
from kdist.coordination import joins, team
from kdist.coordination.logs import average_logs
from kdist.coordination.model_state import learning_rates, state_digests

logger = logging.getLogger(__name__)

# Callbacks whose decisions follow a monitored value (when logs are not averaged,
# the ranks' values are compared at the first epoch).
_MONITORING = ("EarlyStopping", "ReduceLROnPlateau", "ModelCheckpoint")


class Agreement:
    """Keeps the ranks of a data-parallel `fit` in agreement at each epoch's end.

    Keras runs callbacks on each rank with that rank's own logs: without
    help, `EarlyStopping` on one rank may stop its `fit` while the others
    train on (and wait for it in the next gradient reduction), and
    `ReduceLROnPlateau` may lower one rank's learning rate alone, so that the
    ranks drift apart without a word. Keras offers no hook through which a
    library could add callbacks to every `fit`, so the agreement is asked
    for: pass `Agreement().around(callbacks)` as the callbacks of a `fit`
    whose model several ranks train in step (its optimizer is a kdist
    `DistributedOptimizer`, or its strategy is `kdist.distribute.MPIStrategy`):

    ```python
    model.fit(x, y, epochs=10, callbacks=kdist.callbacks.Agreement().around([
        keras.callbacks.EarlyStopping(patience=3),
        keras.callbacks.ModelCheckpoint("best.keras", save_best_only=True),
    ]))
    ```

    The list it returns holds:

    - a callback first, which joins the ranks at each epoch's end (see this
      package's description) and averages the epoch's numeric logs over them,
      so that every later callback (`EarlyStopping`, `ReduceLROnPlateau`,
      `ModelCheckpoint`, `History`, the progress bar) sees the same numbers on
      every rank;
    - your callbacks, each followed by a small sentinel that notes whether it
      set `model.stop_training`;
    - a callback last, which runs one small collective per epoch. If some
      ranks stopped training, every rank stops with them, with a warning
      naming the ranks and the callbacks that stopped them. If the ranks'
      learning rates differ (compared every epoch), or, every `check_every`
      epochs, a digest of the model's trainable variables and its
      optimizer's variables differs, every rank raises `ValueError` naming
      the ranks, the rates or the first variable that differs, and the epoch.
      Left out of the digest: the variables each rank keeps to itself
      (`local_variables`, `register_local_var`), gradient accumulators and
      the model's non-trainable variables (batch normalisation's moving
      statistics). The variables of a model whose ranks hold different parts
      of it (pipeline stages) are not compared.

    At the start of `fit`, the first callback also tells every rank which
    paths the ranks' saving callbacks write (one small collective), and
    Keras's own `ModelCheckpoint` and `BackupAndRestore` in the list are run
    through `writing_once`: one rank writes each file (see this package's
    description). A checkpoint callback that only rank 0 holds, as in
    Horovod's scripts, then needs nothing from the other ranks. On one rank,
    or for a model trained apart, the agreement's callbacks run no collective
    and only note who stopped training.

    Horovod-style scripts that put `MetricAverageCallback` before their
    deciding callbacks and save on rank 0 only need nothing more; the
    agreement adds the checks (who stopped, learning rates, variables) and
    lets every rank keep its saving callbacks. See the Reliability guide
    (docs/reliability.md, "A rank that leaves early").

    Args:
        average_logs: average the epoch's numeric logs over the ranks before
            any other callback reads them. Without it, the values that
            `EarlyStopping`, `ReduceLROnPlateau` and
            `ModelCheckpoint(save_best_only=True)` monitor are compared at the
            first epoch, with a warning naming the callback, the key and each
            rank's value when they differ.
        check_every: compare a digest of the variables every this many epochs,
            from the first epoch of each `fit` (0: never). The learning rates
            are compared at every epoch.

    Raises:
        ValueError: at an epoch's end, on every rank, when the ranks' learning
            rates or variables differ, or when they report different metric
            names (with `average_logs`); at once, a fractional `check_every`.
        TypeError: `check_every` is not a number; `around` is given a
            `keras.callbacks.CallbackList` instead of a list.

    Example:

        >>> import keras, kdist
        >>> agreement = kdist.callbacks.Agreement(check_every=5)
        >>> callbacks = agreement.around([keras.callbacks.EarlyStopping(patience=2)])
        >>> [type(c).__name__ for c in callbacks][:2]
        ['_Front', 'EarlyStopping']
    """

    def __init__(self, average_logs=True, check_every=1):
        self.average_logs = bool(average_logs)
        self.check_every = _args.whole_number(check_every, "check_every")
        self._watch = _Watch()

    def around(self, callbacks=None):
        """`callbacks` (a list, or None) with this agreement's callbacks around them:
        the list to pass to `fit`. Keras's `ModelCheckpoint` and
        `BackupAndRestore` in it are replaced by `writing_once(callback)`."""
        if isinstance(callbacks, keras.callbacks.CallbackList):
            raise TypeError("Agreement.around takes a list of callbacks, not a CallbackList.")
        callbacks = list(callbacks or [])
        front = _Front(self)
        wrapped = [front]
        for callback in callbacks:
            name = type(callback).__name__
            if saving.writes_on_every_rank(callback):
                # Left as it is, it would write the same file on every rank at once.
                callback = saving.writing_once(callback)
            wrapped += [callback, _Sentinel(self._watch, name)]
        front.callbacks = wrapped
        return wrapped + [_Back(self, callbacks)]

    @property
    def stopped_by(self):
        """Who set `stop_training` in the last `fit` ("EarlyStopping", "rank 1's
        EarlyStopping"), or None."""
        return self._watch.stopper


class _Watch:
    """Which callback first set `model.stop_training`, read by the sentinels."""

    def __init__(self):
        self.model = None
        self.stopper = None
        self.seen = False

    def reset(self, model):
        self.model = model
        self.stopper = None
        self.seen = bool(getattr(model, "stop_training", False))

    def look(self, name):
        if not self.seen and self.model is not None and self.model.stop_training:
            self.seen = True
            self.stopper = name


class _Sentinel(keras.callbacks.Callback):
    """Placed after a callback: notes whether that callback set `stop_training`."""

    async_safe = True  # it only reads an attribute

    def __init__(self, watch, name):
        super().__init__()
        self._watch = watch
        self._name = name

    def on_train_batch_end(self, batch, logs=None):
        self._watch.look(self._name)

    def on_epoch_end(self, epoch, logs=None):
        self._watch.look(self._name)


class _Front(keras.callbacks.Callback):
    """First in fit's list: joins, then averages the epoch's logs over the ranks."""

    async_safe = True

    def __init__(self, agreement):
        super().__init__()
        self._agreement = agreement
        self._names = None
        self.callbacks = []

    def on_train_begin(self, logs=None):
        self._agreement._watch.reset(self.model)
        self._names = None
        joins.forget(self.model)
        saving.forget_paths(self.model)
        team.under_agreement(self.model)
        comm = _team_comm(self.model)
        if comm is not None:
            # Before the saving callbacks start: who writes which file.
            saving.share_paths(self.model, self.callbacks, comm)

    def on_train_batch_end(self, batch, logs=None):
        # Set before any callback ran: the model's own step stopped training.
        self._agreement._watch.look("the model's train step")

    def on_epoch_end(self, epoch, logs=None):
        comm = _team_comm(self.model)
        if comm is None:
            return
        joins.join_once(self.model, epoch)
        if self._agreement.average_logs and logs is not None:
            self._names = average_logs(logs, comm, self._names, "kdist.callbacks.Agreement")
            joins.mark_averaged(self.model, epoch)


class _Back(keras.callbacks.Callback):
    """Last in fit's list: one collective to agree on stopping, learning rates and state."""

    def __init__(self, agreement, callbacks):
        super().__init__()
        self._agreement = agreement
        self._callbacks = callbacks
        self._first_epoch = None

    def on_train_begin(self, logs=None):
        self._first_epoch = None
        self._epochs = (self.params or {}).get("epochs")
        self._last_epoch = None

    def on_train_end(self, logs=None):
        saving.forget_paths(self.model)
        if _team_comm(self.model) is not None:
            joins.note_ending(self.model, self._last_epoch, self._epochs,
                              self._agreement.stopped_by)

    def on_epoch_end(self, epoch, logs=None):
        self._last_epoch = epoch
        agreement = self._agreement
        comm = _team_comm(self.model)
        if comm is None:
            return
        first = self._first_epoch is None
        if first:
            self._first_epoch = epoch
        watch = agreement._watch
        every = agreement.check_every
        check = every > 0 and (epoch - self._first_epoch) % every == 0
        digests = state_digests(self.model) if check else None
        mine = {
            "stop": bool(self.model.stop_training),
            "by": watch.stopper,
            "rates": learning_rates(self.model),
            "digests": None if digests is None else [d for _, d in digests],
            "monitored": (self._monitored(logs) if first and not agreement.average_logs
                          else None),
        }
        everyone = comm.allgather_object(mine)
        number = epoch + 1  # as Keras's progress bar counts
        _compare_rates(everyone, number)
        if digests is not None:
            _compare_digests(everyone, [name for name, _ in digests], number)
        if mine["monitored"] is not None:
            _compare_monitored(everyone, number)
        stopped = [rank for rank, theirs in enumerate(everyone) if theirs["stop"]]
        if stopped and len(stopped) < len(everyone):
            reasons = ", ".join(
                f"rank {rank} stopped training after epoch {number} "
                f"({everyone[rank]['by'] or 'reason unknown'})" for rank in stopped)
            logger.warning("%s; every rank stops with it.", reasons)
            if not mine["stop"]:
                first_rank = stopped[0]
                watch.seen = True
                watch.stopper = f"rank {first_rank}'s {everyone[first_rank]['by'] or 'stop'}"
                self.model.stop_training = True

    def _monitored(self, logs):
        """(callback, key, value) of the values this rank's deciding callbacks monitor."""
        found = []
        for callback in self._callbacks:
            name = type(callback).__name__
            if name not in _MONITORING:
                continue
            if name == "ModelCheckpoint" and not getattr(callback, "save_best_only", False):
                continue
            key = getattr(callback, "monitor", None)
            value = (logs or {}).get(key)
            if key is not None and value is not None and np.ndim(value) == 0:
                found.append((name, key, float(value)))
        return found


def _compare_rates(everyone, number):
    rates = [theirs["rates"] for theirs in everyone]
    if all(r == rates[0] for r in rates):
        return
    listed = ", ".join(f"rank {rank}: {_floats(r)}" for rank, r in enumerate(rates))
    raise ValueError(
        f"kdist: the ranks' learning rates differ after epoch {number} ({listed}). A "
        "callback changed the learning rate on some ranks only (ReduceLROnPlateau or a "
        "schedule reading this rank's own metrics?); every rank must apply the same one. "
        "Let kdist's agreement average the logs (Agreement(average_logs=True), the "
        "default) or put kdist.callbacks.MetricAverageCallback() before such callbacks.")


def _compare_digests(everyone, names, number):
    digests = [theirs["digests"] for theirs in everyone]
    for rank, theirs in enumerate(digests):
        if len(theirs) != len(digests[0]):
            raise ValueError(
                f"kdist: after epoch {number} rank {rank} holds {len(theirs)} variables "
                f"and rank 0 {len(digests[0])}; every rank must build the same model.")
    for index, name in enumerate(names):
        differing = [rank for rank, theirs in enumerate(digests)
                     if theirs[index] != digests[0][index]]
        if differing:
            raise ValueError(
                f"kdist: after epoch {number} rank(s) {differing} hold other values of "
                f"'{name}' than rank 0 (the first variable that differs): the ranks no "
                "longer train the same model. Something changed it on some ranks only (a "
                "callback, or code between epochs); a variable each rank keeps to itself "
                "belongs in BroadcastGlobalVariablesCallback(local_variables=...) or the "
                "optimizer's register_local_var.")


def _compare_monitored(everyone, number):
    lists = [theirs["monitored"] or [] for theirs in everyone]
    for index, (name, key, _) in enumerate(lists[0]):
        values = [found[index][2] if index < len(found) else None for found in lists]
        if any(v != values[0] for v in values):
            listed = ", ".join(f"rank {rank}: {v!r}" for rank, v in enumerate(values))
            logger.warning(
                "%s monitors '%s', whose value differs across the ranks after epoch %d (%s): "
                "its decisions will differ too. Average the logs first "
                "(kdist.callbacks.MetricAverageCallback, or kdist's agreement with "
                "average_logs=True).", name, key, number, listed)


def _floats(values):
    return "[" + ", ".join(f"{v:.6g}" for v in values) + "]"


def _team_comm(model):
    """The communicator of the ranks that train `model` together, when there are several."""
    try:
        if not team.trained_together(model):
            return None
        comm = team.comm_of(model)
    except Exception:  # a model that cannot say: treat it as trained alone
        return None
    return comm if comm.size > 1 else None

