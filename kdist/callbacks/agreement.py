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

`install()` arranges this for every `fit` of a model whose ranks train in
step through kdist (a kdist optimizer, or `kdist.distribute.MPIStrategy`), on
more than one rank: it wraps `keras.Model.fit` once, process-wide. It runs
the first time kdist's data-parallel optimizer or `MPIStrategy` is created.
`KDIST_AGREEMENT=0` (read at each `fit`) or `uninstall()` turns it off; a
`fit` given a `keras.callbacks.CallbackList` is left alone.
"""

import functools
import hashlib
import logging
import os
import threading

import keras
import numpy as np

from kdist import _args
from kdist.callbacks import _sync
from kdist.callbacks import saving
from kdist.callbacks.broadcast import average_logs
from kdist.comm import collectives
from kdist.comm import protocol
from kdist.distribute import consistency
from kdist.distribute import mpi_strategy

logger = logging.getLogger(__name__)

ENVIRONMENT = "KDIST_AGREEMENT"

# Callbacks whose decisions follow a monitored value (when logs are not averaged,
# the ranks' values are compared at the first epoch).
_MONITORING = ("EarlyStopping", "ReduceLROnPlateau", "ModelCheckpoint")


class Agreement:
    """Keeps the ranks of a data-parallel `fit` in agreement at each epoch's end.

    kdist adds it by itself to every `fit` of a model trained with a kdist
    optimizer or `kdist.distribute.MPIStrategy` on several ranks (see the
    module's description). Build one yourself after turning that off
    (`KDIST_AGREEMENT=0`), to choose its options, and pass
    `agreement.around(callbacks)` as fit's callbacks.

    Args:
        average_logs: average the epoch's numeric logs over the ranks before
            any other callback reads them. Without it, the values that
            `EarlyStopping`, `ReduceLROnPlateau` and
            `ModelCheckpoint(save_best_only=True)` monitor are compared at the
            first epoch, with a warning naming the callback, the key and each
            rank's value when they differ.
        check_every: compare a digest of every variable of the model and its
            optimizer every this many epochs (0: never). The learning rates
            are compared at every epoch.

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
        self._collective = True
        self._watch = _Watch()

    def around(self, callbacks=None):
        """`callbacks` with this agreement's callbacks around them, for `fit`."""
        if isinstance(callbacks, keras.callbacks.CallbackList):
            raise TypeError("Agreement.around takes a list of callbacks, not a CallbackList.")
        callbacks = list(callbacks or [])
        front = _Front(self)
        wrapped = [front]
        for callback in callbacks:
            name = type(callback).__name__
            if self._collective and saving.writes_on_every_rank(callback):
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
        _sync.forget(self.model)
        saving.forget_paths(self.model)
        if self._agreement._collective:
            comm = _sync.comm_of(self.model)
            if comm.size > 1:
                # Before the saving callbacks start: who writes which file.
                saving.share_paths(self.model, self.callbacks, comm)

    def on_train_batch_end(self, batch, logs=None):
        # Set before any callback ran: the model's own step stopped training.
        self._agreement._watch.look("the model's train step")

    def on_epoch_end(self, epoch, logs=None):
        if not self._agreement._collective:
            return
        comm = _sync.comm_of(self.model)
        if comm.size == 1:
            return
        _sync.join_once(self.model, epoch)
        if self._agreement.average_logs and logs is not None:
            self._names = average_logs(logs, comm, self._names, "kdist.callbacks.Agreement")
            _sync.mark_averaged(self.model, epoch)


class _Back(keras.callbacks.Callback):
    """Last in fit's list: one collective to agree on stopping, learning rates and state."""

    def __init__(self, agreement, callbacks):
        super().__init__()
        self._agreement = agreement
        self._callbacks = callbacks
        self._first_epoch = None

    def on_train_begin(self, logs=None):
        self._first_epoch = None

    def on_train_end(self, logs=None):
        saving.forget_paths(self.model)

    def on_epoch_end(self, epoch, logs=None):
        agreement = self._agreement
        if not agreement._collective:
            return
        comm = _sync.comm_of(self.model)
        if comm.size == 1:
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
        "Leave kdist's log averaging on (KDIST_AGREEMENT unset) or put "
        "kdist.callbacks.MetricAverageCallback() before such callbacks.")


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


def learning_rates(model):
    """The current learning rate of each of `model`'s optimizers, as floats."""
    rates = []
    for optimizer in _sync._optimizers(model):
        try:
            rate = optimizer.learning_rate
        except (AttributeError, ValueError):
            continue
        rates.append(float(np.asarray(keras.ops.convert_to_numpy(rate))))
    return rates


def digest(array):
    """An exact 8-byte digest of an array's bytes (BLAKE2b): equal for equal bytes."""
    array = np.ascontiguousarray(array)
    return hashlib.blake2b(memoryview(array).cast("B"), digest_size=8).hexdigest()


def state_digests(model):
    """`[(name, digest)]` of each variable that every rank must hold identically:
    the model's trainable variables and its optimizers' variables, without those
    each rank keeps to itself. Empty for models whose ranks hold different parts
    (pipeline stages) or train apart (gossip)."""
    if getattr(model, "ranks_hold_different_weights", False) or \
            model in _sync._independent:
        return []
    return [(collectives.variable_name(v), digest(v.numpy())) for v in shared_state(model)]


def shared_state(model):
    """The variables `state_digests` covers.

    Left out: variables kept local through `BroadcastGlobalVariablesCallback`
    or the optimizer's `register_local_var` (with their optimizer slots), the
    optimizer's local gradient sums, and non-trainable model variables (batch
    normalisation's moving statistics are each rank's own unless synchronised).
    """
    local = set(_sync._local.get(model, ()))
    prefixes = []
    optimizers = _sync._optimizers(model)
    for optimizer in optimizers:
        core = _sync.reducing_core(optimizer)
        if core is None:
            continue
        local |= set(getattr(consistency, "_excluded", {}).get(core, ()))
        keys = getattr(core, "_local_keys", None)
        ids, paths = keys() if keys is not None else ((), ())
        local |= set(ids)
        for v in model.trainable_variables:
            if id(v) in ids or collectives.variable_name(v) in paths:
                local.add(id(v))
                prefixes.append(collectives.variable_name(v).replace("/", "_") + "_")
    variables = [v for v in model.trainable_variables if id(v) not in local]
    for optimizer in optimizers:
        if not getattr(optimizer, "built", False):
            continue
        for v in optimizer.variables:
            name = getattr(v, "name", "") or ""
            if id(v) in local or "gradient_accumulator" in name or \
                    any(name.startswith(p) for p in prefixes):
                continue
            variables.append(v)
    return variables


# -- fit, process-wide ----------------------------------------------------------------

_original_fit = None
_inside = threading.local()


def enabled():
    """Whether `KDIST_AGREEMENT` leaves the automatic agreement on (the default)."""
    return os.environ.get(ENVIRONMENT, "1").strip().lower() not in ("0", "false", "no", "off")


def install():
    """Wraps `keras.Model.fit` (once, process-wide) so that kdist's models agree.

    Only models trained in step through kdist on several ranks are affected;
    every other model's `fit` runs unchanged.
    """
    global _original_fit
    if _original_fit is not None:
        return
    original = keras.Model.fit

    @functools.wraps(original)
    def fit(self, *args, **kwargs):
        return _fit(original, self, args, kwargs)

    fit._kdist_agreement = True
    _original_fit = original
    keras.Model.fit = fit


def uninstall():
    """Gives `keras.Model.fit` back unchanged."""
    global _original_fit
    if _original_fit is not None:
        keras.Model.fit = _original_fit
        _original_fit = None


def installed():
    return _original_fit is not None


_CALLBACKS_POSITION = 5  # fit(x, y, batch_size, epochs, verbose, callbacks, ...)


def _fit(original, model, args, kwargs):
    if getattr(_inside, "depth", 0) or not _concerns(model):
        return original(model, *args, **kwargs)
    args = list(args)
    positional = len(args) > _CALLBACKS_POSITION
    callbacks = args[_CALLBACKS_POSITION] if positional else kwargs.get("callbacks")
    if isinstance(callbacks, keras.callbacks.CallbackList):
        logger.debug("fit was given a CallbackList: kdist's agreement leaves it alone")
        return original(model, *args, **kwargs)
    agreement = Agreement()
    # Off: no collectives, but the sentinels still say who stopped this rank's fit.
    agreement._collective = enabled()
    wrapped = agreement.around(keras.tree.flatten(callbacks) if callbacks else [])
    if positional:
        args[_CALLBACKS_POSITION] = wrapped
    else:
        kwargs["callbacks"] = wrapped
    epochs = args[3] if len(args) > 3 else kwargs.get("epochs", 1)
    _inside.depth = 1
    try:
        history = original(model, *args, **kwargs)
    finally:
        _inside.depth = 0
    protocol.set_note(_ending(model, history, epochs, agreement.stopped_by))
    return history


def _concerns(model):
    try:
        return _sync.trained_together(model) and _sync.comm_of(model).size > 1
    except Exception:  # a model that cannot say: leave its fit alone
        return False


def _ending(model, history, epochs, stopper):
    """One line on how this rank's fit ended, for the report when it leaves the job."""
    done = getattr(history, "epoch", None) or []
    last = (done[-1] + 1) if done else 0
    if getattr(model, "stop_training", False):
        return (f"its last fit stopped after epoch {last} of {epochs}: "
                f"{stopper or 'a callback'} set stop_training")
    return f"its last fit ran to epoch {last} of {epochs}"


# Every MPIStrategy made from now on installs the agreement.
mpi_strategy.when_created(lambda strategy: install())
