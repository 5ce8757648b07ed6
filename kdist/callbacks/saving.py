"""Saving a model that several ranks train: one complete file per path, written once.

The ranks of a data-parallel job hold the same weights, and Keras's
`model.save`, `save_weights`, `ModelCheckpoint` and `BackupAndRestore` write
them wherever they run: on every rank, to the same path, at the same moment.
Two processes writing one file at once can leave a file that no longer
loads (a zip archive whose checksums no longer match its content). As in
TensorFlow's multi-worker convention, one rank writes the real file and the
others write nothing:

- of the ranks that write to one path, the lowest writes it; ranks given
  paths of their own (`f"replica-{rank}.keras"`) each write theirs;
- the writer writes a temporary file beside the path and renames it into
  place, so the path always holds a complete file (the previous one until the
  new one is whole), even when the writer is killed mid-save;
- `save_model` and `save_weights` are collective: every rank returns once
  the file is complete, or raises the writer's error;
- `ModelCheckpoint` and `BackupAndRestore` are Keras's callbacks whose files
  are written this way; `BackupAndRestore` restores on the writer and
  broadcasts the state, so ranks without a shared file system resume alike;
- in a `fit` that kdist's `Agreement` watches, plain
  `keras.callbacks.ModelCheckpoint` and `BackupAndRestore` are run through
  `writing_once` and behave the same.

A model whose ranks hold different parts of it (a pipeline stage) is left
alone: each rank saves its own part.
"""

import logging
import os
import shutil
import tempfile
import weakref

import keras

from kdist import _keras_private
from kdist.comm import collectives
from kdist.comm import processes
from kdist.coordination import model_state, team

logger = logging.getLogger(__name__)


def save_model(model, filepath, overwrite=True, **kwargs):
    """`model.save(filepath)` for a model trained on several ranks; call it on every rank.

    Of the ranks given the same path (compared as absolute paths), the lowest
    writes it, to a temporary file beside the path that is then renamed into
    place; ranks given paths of their own each write theirs. Every rank
    returns once the file is complete. The ranks are those that train
    `model` together (its kdist optimizer's or `MPIStrategy`'s
    communicator), else the whole job; a model whose ranks hold different
    parts of it (`ranks_hold_different_weights`) is saved on every rank, each
    its own part, without a collective. In a process outside any MPI job it
    is `model.save` with an atomic file.

    Args:
        model: the Keras model.
        filepath: a `.keras` path (or what `model.save` accepts).
        overwrite: as for `model.save`.
        **kwargs: passed to `model.save`.

    Raises:
        RuntimeError: on the other ranks, when the writing rank failed to
            write the file (naming that rank and its error); the writing rank
            raises its own error.

    Example:

        >>> import kdist, keras, os, tempfile
        >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        >>> path = os.path.join(tempfile.mkdtemp(), "model.keras")
        >>> kdist.callbacks.save_model(model, path)
        >>> keras.saving.load_model(path).count_params()
        3
    """
    _save_collectively(model, filepath, lambda target: model.save(
        target, overwrite=overwrite or target != filepath, **kwargs))


def save_weights(model, filepath, overwrite=True, **kwargs):
    """`model.save_weights(filepath)` for a model trained on several ranks; call it on
    every rank.

    Written as `save_model` writes: the lowest rank of those given the same
    path writes the file, atomically, and every rank returns once it is
    complete; a failed write raises the writer's error there and
    `RuntimeError` naming the writer and its error on the other ranks.
    `overwrite` and `**kwargs` are passed to `model.save_weights`.
    """
    _save_collectively(model, filepath, lambda target: model.save_weights(
        target, overwrite=overwrite or target != filepath, **kwargs))


def _save_collectively(model, filepath, save):
    filepath = os.fspath(filepath)
    writers = Writers.of(model, filepath)
    error = None
    if writers.writes:
        try:
            write_whole(filepath, save)
        except Exception as exception:  # told to every rank below, raised here
            error = exception
    if writers.comm is not None:
        failures = [(rank, text) for rank, text in enumerate(
            writers.comm.allgather_object(None if error is None else repr(error))) if text]
        if failures and error is None:
            rank, text = failures[0]
            raise RuntimeError(f"rank {rank} could not write {filepath}: {text}")
    if error is not None:
        raise error


def write_whole(filepath, save):
    """Runs `save(path)` on a temporary path beside `filepath`, then renames the
    result into place: `filepath` holds the old file or the new one, never a part."""
    filepath = os.fspath(filepath)
    if "://" in filepath:  # a remote store: its own rules, no rename
        save(filepath)
        return
    directory, name = os.path.split(os.path.abspath(filepath))
    os.makedirs(directory, exist_ok=True)
    # The name keeps its ending: Keras chooses the format by it.
    place = tempfile.mkdtemp(prefix=".kdist-partial-", dir=directory)
    try:
        temporary = os.path.join(place, name)
        save(temporary)
        # A sharded save writes its shards beside the file, which indexes them: they go
        # first, so that the index never names a shard that is not there yet.
        for other in sorted(os.listdir(place)):
            if other != name:
                os.replace(os.path.join(place, other), os.path.join(directory, other))
        if os.path.isdir(temporary):
            _replace_directory(temporary, filepath)
        else:
            os.replace(temporary, filepath)
    finally:
        shutil.rmtree(place, ignore_errors=True)


def _replace_directory(new, filepath):
    old = None
    if os.path.exists(filepath):
        old = tempfile.mkdtemp(prefix=".kdist-old-", dir=os.path.dirname(os.path.abspath(filepath)))
        os.rename(filepath, os.path.join(old, "previous"))
    os.rename(new, filepath)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


class Writers:
    """Which ranks write a model's file, and the ranks that wait for it.

    `writes`: whether this rank writes; `comm`: the ranks that hold the path and
    agree on it (None when there is no one to agree with); `single`: every rank of
    `comm` holds the path, so its rank 0 alone writes it (and can share what it
    restores); `agreed`: the decision came from the ranks' agreement at the start of
    `fit`, whose epoch-end collective already keeps the others behind the writer.
    """

    def __init__(self, writes=True, comm=None, single=False, agreed=False):
        self.writes, self.comm, self.single, self.agreed = writes, comm, single, agreed

    @classmethod
    def of(cls, model, path, in_fit=False):
        """Decides who writes `path` for `model`: from what the ranks shared at the start
        of the running `fit` (`share_paths`), else by asking the ranks that train
        `model` (a collective among them)."""
        if getattr(model, "ranks_hold_different_weights", False):
            return cls()
        path = _absolute(path)
        shared = _shared.get(model) if in_fit else None
        if shared is not None and path in shared[1]:
            comm, holders = shared
            ranks = holders[path]
            single = len(ranks) == comm.size
            return cls(writes=ranks[0] == comm.rank, comm=comm if single else None,
                       single=single, agreed=True)
        comm = _team(model)
        if comm is not None:
            everyone = comm.allgather_object(path)
            return cls(writes=everyone.index(path) == comm.rank, comm=comm,
                       single=len(set(everyone)) == 1)
        chief = _multi_worker_chief(model)
        return cls() if chief is None else cls(writes=chief, single=True)


# model -> (communicator, {path: the ranks whose saving callbacks write it}) for the
# `fit` that runs, as the agreement's first callback gathered it.
_shared = weakref.WeakKeyDictionary()


def share_paths(model, callbacks, comm):
    """Tells every rank which paths the saving callbacks of each rank write (a collective
    of `comm`, run by every rank at the start of `fit`), so that the callbacks decide who
    writes without a collective of their own: a callback that only some ranks hold (as
    in Horovod's `if hvd.rank() == 0: callbacks.append(ModelCheckpoint(...))`) then
    needs nothing from the others."""
    mine = sorted({_absolute(_path_of(c)) for c in map(_saving_callback, callbacks)
                   if c is not None})
    holders = {}
    for rank, paths in enumerate(comm.allgather_object(mine)):
        for path in paths:
            holders.setdefault(path, []).append(rank)
    _shared[model] = (comm, holders)


def forget_paths(model):
    """Ends what `share_paths` gathered, with the `fit` it was gathered for."""
    _shared.pop(model, None)


def _saving_callback(callback):
    """The Keras saving callback that `callback` is or runs, else None."""
    if isinstance(callback, _WritingOnce):
        return callback.callback
    return callback if isinstance(callback, _OnTheWriter) else None


def _path_of(callback):
    if isinstance(callback, keras.callbacks.BackupAndRestore):
        return os.fspath(callback.backup_dir)
    return os.fspath(callback.filepath)


def _absolute(path):
    return path if "://" in path else os.path.abspath(path)


def _team(model):
    """The communicator of the ranks that save `model` together, if more than one."""
    if team.trained_together(model):
        comm = team.comm_of(model)
    elif processes.is_initialized() or processes.launched_by_mpi():
        comm = processes.world()
    else:
        return None
    return comm if comm.size > 1 else None


def _multi_worker_chief(model):
    """Under a multi-worker `tf.distribute` strategy without MPI: whether this worker is
    the chief (TensorFlow's rule), or None for a job of one worker."""
    try:
        resolver = model.distribute_strategy.cluster_resolver
    except (AttributeError, ValueError):
        return None
    if resolver is None:
        return None
    jobs = resolver.cluster_spec().as_dict()
    if sum(len(tasks) for tasks in jobs.values()) <= 1:
        return None
    task_type, task_id = resolver.task_type, resolver.task_id
    return task_type == "chief" or (task_type == "worker" and task_id == 0
                                    and "chief" not in jobs)


class _SavesWhole:
    """Stands for a model inside a Keras saving callback on the writing rank: its
    `save` and `save_weights` go through `write_whole`; everything else is the model's."""

    def __init__(self, model):
        object.__setattr__(self, "_kdist_model", model)

    def __getattr__(self, name):
        return getattr(object.__getattribute__(self, "_kdist_model"), name)

    def __setattr__(self, name, value):
        setattr(object.__getattribute__(self, "_kdist_model"), name, value)

    def save(self, filepath, overwrite=True, **kwargs):
        model = object.__getattribute__(self, "_kdist_model")
        if not overwrite and os.path.exists(filepath):
            return model.save(filepath, overwrite=False, **kwargs)  # Keras asks
        write_whole(filepath, lambda target: model.save(target, overwrite=True, **kwargs))

    def save_weights(self, filepath, overwrite=True, **kwargs):
        model = object.__getattribute__(self, "_kdist_model")
        if not overwrite and os.path.exists(filepath):
            return model.save_weights(filepath, overwrite=False, **kwargs)
        write_whole(filepath, lambda target: model.save_weights(
            target, overwrite=True, **kwargs))


class _OneWriter:
    """What a saving callback does on each rank: Keras's own callback runs in full on the
    writing rank (with the model standing in as `_SavesWhole`), and not at all on the
    others, which get the writer's restored state and wait for its last file."""

    def __init__(self, callback):
        self.callback = callback
        self.writers = Writers()
        self.model = None

    def begin(self, model, run_begin):
        """At `on_train_begin`: decides who writes, then restores once (BackupAndRestore)."""
        self.model = model
        self.writers = Writers.of(model, _path_of(self.callback), in_fit=True)
        restores = isinstance(self.callback, keras.callbacks.BackupAndRestore)
        if not restores:
            if self.writers.writes:
                run_begin()
            return
        comm = self.writers.comm
        if comm is None:
            run_begin()
            return
        if self.writers.writes:
            _restore_and_tell(run_begin, model, comm, alone=not self.writers.single)
        if self.writers.single:
            _receive_restored(model, comm, self.writers.writes)
            return
        if not self.writers.agreed:
            comm.barrier()  # the writers have repaired their files; the others read them
        if not self.writers.writes:
            run_begin()

    def end(self, run_end):
        """At `on_train_end`: the writer ends (BackupAndRestore may delete its backup),
        and no rank leaves `fit` before the writer's last file is in place."""
        if self.writers.writes:
            run_end()
        if self.writers.comm is not None and not self.writers.agreed:
            self.writers.comm.barrier()


def _restore_and_tell(run_begin, model, comm, alone):
    error = None
    try:
        run_begin()
    except Exception as exception:
        error = exception
    if alone:
        if error is not None:
            raise error
        return
    epoch = None if error else _keras_private.initial_epoch(model)
    comm.bcast_object((repr(error) if error else None, epoch), root=0)
    if error is not None:
        raise error


def _receive_restored(model, comm, writer):
    if not writer:
        error, epoch = comm.bcast_object(None, root=0)
        if error is not None:
            raise RuntimeError(f"rank 0 could not restore the backup: {error}")
        _keras_private.set_initial_epoch(model, epoch)
    collectives.broadcast_variables(model_state.model_state(model), root_rank=0, comm=comm)


class _OnTheWriter:
    """Mixin for Keras's saving callbacks: runs them through `_OneWriter`."""

    def set_model(self, model):
        self._kdist_writer = _OneWriter(self)
        super().set_model(_SavesWhole(model))

    def _kdist_writes(self):
        return self._kdist_writer.writers.writes

    def on_train_begin(self, logs=None):
        self._kdist_writer.begin(_real(self.model), lambda: super(_OnTheWriter, self)
                                 .on_train_begin(logs))

    def on_train_end(self, logs=None):
        self._kdist_writer.end(lambda: super(_OnTheWriter, self).on_train_end(logs))

    def on_epoch_begin(self, epoch, logs=None):
        if self._kdist_writes():
            super().on_epoch_begin(epoch, logs)

    def on_epoch_end(self, epoch, logs=None):
        if self._kdist_writes():
            super().on_epoch_end(epoch, logs)

    def on_train_batch_end(self, batch, logs=None):
        if self._kdist_writes():
            super().on_train_batch_end(batch, logs)


def _real(model):
    if isinstance(model, _SavesWhole):
        return object.__getattribute__(model, "_kdist_model")
    return model


class ModelCheckpoint(_OnTheWriter, keras.callbacks.ModelCheckpoint):
    """`keras.callbacks.ModelCheckpoint` that writes each file once, whole, on one rank.

    A subclass of Keras's callback, with Keras's arguments and behaviour. On
    several ranks, the lowest rank of those given the same `filepath`
    template writes; each file appears whole (written beside its path and
    renamed into place), and `fit` returns on no rank before the last file is
    in place. When training begins it asks the ranks which paths they hold
    (one small collective among the ranks that train the model), so put it on
    every rank; in a `fit` run through `Agreement.around`, the agreement has
    asked already and a callback that rank 0 alone holds is fine. On one
    process it is Keras's callback with atomic files.

    Example:

        >>> import kdist
        >>> checkpoint = kdist.callbacks.ModelCheckpoint("ckpt-{epoch}.keras")
    """


class BackupAndRestore(_OnTheWriter, keras.callbacks.BackupAndRestore):
    """`keras.callbacks.BackupAndRestore` for several ranks: one rank writes the backup
    (atomically), and resuming restores it on that rank and broadcasts it to the others.

    A subclass of Keras's callback, with Keras's arguments. Of the ranks given
    the same `backup_dir`, the lowest writes the backup. When training
    begins, that rank restores it (with Keras's repair of a damaged backup)
    and broadcasts the weights, the optimizer's state and the epoch to
    continue at, so ranks that cannot see `backup_dir` resume alike. When
    every rank is given the same `backup_dir`, a failed restore raises on
    every rank: the writer's error there, `RuntimeError` naming it on the
    others. As for `ModelCheckpoint`, the ranks tell each other which
    directories they hold when training begins, so put it on every rank (or
    run `fit` through `Agreement.around`).

    Example:

        >>> import kdist, tempfile
        >>> backup = kdist.callbacks.BackupAndRestore(tempfile.mkdtemp())
    """


class _WritingOnce(keras.callbacks.Callback):
    """A user's Keras saving callback, run by `_OneWriter` without changing it."""

    def __init__(self, callback):
        super().__init__()
        self.callback = callback
        self.writer = _OneWriter(callback)

    @property
    def name(self):
        return type(self.callback).__name__

    def set_model(self, model):
        super().set_model(model)
        self.callback.set_model(_SavesWhole(model))

    def set_params(self, params):
        super().set_params(params)
        self.callback.set_params(params)

    def on_train_begin(self, logs=None):
        self.writer.begin(self.model, lambda: self.callback.on_train_begin(logs))

    def on_train_end(self, logs=None):
        self.writer.end(lambda: self.callback.on_train_end(logs))

    def on_epoch_begin(self, epoch, logs=None):
        if self.writer.writers.writes:
            self.callback.on_epoch_begin(epoch, logs)

    def on_epoch_end(self, epoch, logs=None):
        if self.writer.writers.writes:
            self.callback.on_epoch_end(epoch, logs)

    def on_train_batch_end(self, batch, logs=None):
        if self.writer.writers.writes:
            self.callback.on_train_batch_end(batch, logs)


def writes_on_every_rank(callback):
    """Whether `callback` is one of Keras's saving callbacks that, left as it is, would
    write the same files on every rank."""
    return (isinstance(callback, (keras.callbacks.ModelCheckpoint,
                                  keras.callbacks.BackupAndRestore))
            and not isinstance(callback, _OnTheWriter))


def writing_once(callback):
    """`callback` (a `keras.callbacks.ModelCheckpoint` or `BackupAndRestore`) run so
    that each of its files is written once, whole, by one rank.

    Returns a callback to put in `fit`'s list in place of `callback`, which
    then behaves as kdist's own `ModelCheckpoint` or `BackupAndRestore`; the
    callback itself is not changed. `Agreement.around` does this by itself
    for the Keras saving callbacks in its list.

    Raises:
        TypeError: `callback` is another callback, or kdist's own
            `ModelCheckpoint` or `BackupAndRestore` (which write once
            already).
    """
    if not writes_on_every_rank(callback):
        raise TypeError("writing_once takes a keras.callbacks.ModelCheckpoint or "
                        f"BackupAndRestore (not kdist's own); got {type(callback).__name__}.")
    return _WritingOnce(callback)
