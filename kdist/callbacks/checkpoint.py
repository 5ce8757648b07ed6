"""Atomic checkpoints of a training run, and resuming from them."""

import glob
import json
import logging
import os
import re

import keras
import numpy as np

from kdist import _keras_private
from kdist._files import write_atomically
from kdist._variables import path_of
from kdist._version import __version__
from kdist.comm import collectives
from kdist.comm import processes
from kdist.coordination import consistency, joins, model_state, team

logger = logging.getLogger(__name__)

_NAME = re.compile(r"^epoch-(\d{6})\.npz$")


def save_state(path, variables, epoch):
    """Writes `variables` and the epoch to `path` atomically (all or nothing)."""
    arrays = {f"v{i:05d}": np.asarray(keras.ops.convert_to_numpy(v))
              for i, v in enumerate(variables)}
    meta = {"epoch": int(epoch), "paths": [(path_of(v) or "?") for v in variables],
            "kdist": __version__}
    write_npz_atomically(path, arrays, meta)


def write_npz_atomically(path, arrays, meta):
    """Writes numpy `arrays` and a JSON-able `meta` dict to `path`: all or nothing.

    A crash mid-write leaves the previous file in place, never a torn one.
    """
    arrays = dict(arrays)
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    write_atomically(path, lambda stream: np.savez(stream, **arrays), suffix=".npz")


def load_state(path, variables):
    """Assigns the values saved at `path` to `variables`, matched by path; returns the epoch.

    Each variable gets the value saved under its path (`variable.path`), so
    the order in which a model creates its variables does not matter.
    Variables that share a path (two optimizers given the same name both
    hold "<name>/iteration") are matched in the order they come. Nothing is assigned
    unless every variable finds a value of its shape and every saved value a
    variable; otherwise a ValueError names the variables that differ.
    """
    with np.load(path) as data:
        meta = json.loads(bytes(data["meta"]).decode())
        saved = _positions(meta["paths"])
        here = _positions([(path_of(v) or "?") for v in variables])
        pairs, missing, unexpected = [], [], []
        for name, positions in here.items():
            indices = saved.get(name, [])
            pairs += [(variables[i], name, j) for i, j in zip(positions, indices)]
            missing += [name] * (len(positions) - len(indices))
        for name, indices in saved.items():
            unexpected += [name] * (len(indices) - len(here.get(name, [])))
        if missing or unexpected:
            differences = []
            if missing:
                differences.append(f"it holds no value for {_names(missing)} of this model")
            if unexpected:
                differences.append(f"it holds {_names(unexpected)}, which this model lacks")
            raise ValueError(
                f"Checkpoint {path} was written by another model: {'; '.join(differences)}."
                f"{_renamed_hint(data, meta, variables)}")
        values, mismatched = [], []
        for variable, name, index in pairs:
            value = data[f"v{index:05d}"]
            if tuple(value.shape) != tuple(variable.shape):
                mismatched.append(f"'{name}' is {tuple(value.shape)} there and "
                                  f"{tuple(variable.shape)} here")
            values.append((variable, value))
        if mismatched:
            raise ValueError(f"Checkpoint {path} was written by another model: variable "
                             f"shapes differ: {_names(mismatched, quote=False)}.")
    for variable, value in values:
        variable.assign(value)
    return meta["epoch"]


def _positions(paths):
    """path -> the positions where it occurs, in order."""
    positions = {}
    for i, name in enumerate(paths):
        positions.setdefault(name, []).append(i)
    return positions


def _names(names, quote=True, shown=10):
    listed = [f"'{n}'" if quote else n for n in names[:shown]]
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(listed) + more


def _renamed_hint(data, meta, variables):
    """A hint when the variables differ by name only: same count, same shapes in order."""
    if len(meta["paths"]) != len(variables) or any(
            tuple(data[f"v{i:05d}"].shape) != tuple(v.shape) for i, v in enumerate(variables)):
        return ""
    return (" The variables have the same shapes in the same order, so this may be the same "
            "model under other names: Keras numbers the automatic names of layers, models and "
            "optimizers made again in one Python process (dense_1, adam_1, ...). Resume in a "
            "new process, give them names, or call keras.backend.clear_session() before "
            "building the model.")


def saved_epoch(path):
    """The number of finished epochs a checkpoint records (its values are not read)."""
    with np.load(path) as data:
        return int(json.loads(bytes(data["meta"]).decode())["epoch"])


def latest_checkpoint(directory):
    """The path of the newest complete checkpoint in `directory`, or None.

    Looks at the files `Checkpoint` writes (`epoch-NNNNNN.npz`) and returns the
    one with the most finished epochs; a file still being written is not one
    of them (it has a temporary name until it is complete).
    """
    found = []
    for path in glob.glob(os.path.join(directory, "epoch-*.npz")):
        match = _NAME.match(os.path.basename(path))
        if match:
            found.append((int(match.group(1)), path))
    return max(found)[1] if found else None


class Checkpoint(keras.callbacks.Callback):
    """Saves the training state after every `save_freq` epochs and resumes from it.

    Rank 0 writes the model's variables, the optimizer's state and the number
    of finished epochs to `directory/epoch-NNNNNN.npz`, atomically (a file is
    complete or absent), and deletes all but the newest `keep`. When training
    begins, rank 0 looks for the newest checkpoint; if there is one, it is
    loaded and broadcast to every rank and `fit` continues with the next
    epoch, as with `initial_epoch` (so `fit(epochs=10)` runs only the epochs
    still to do). Rerunning the same command therefore resumes an interrupted
    run. Put it on every rank: the look-up is broadcast. Inside
    `kdist.elastic.run`, once ranks were lost or replaced, training goes on
    from the last commit in memory instead and the disk is only written.

    Values are matched to variables by path (`variable.path`, such as
    `"sequential/dense/kernel"` or `"adam/iteration"`), so a model that lists
    its variables in another order resumes correctly. Variables that share a
    path (two optimizers given the same name) are matched in the order they
    come. A checkpoint written by another model raises `ValueError` naming
    the variables it lacks, those it holds that the model lacks, and those
    whose shapes differ; nothing is assigned then. Paths hold the names Keras
    gives layers, models and optimizers, which Keras numbers when they are
    made again in one Python process (`dense_1`, `adam_1`): resume in a new
    process, as rerunning the script does, or name them.

    A model that Keras builds in its first step (no `Input`) is restored once
    its variables exist, before that step first runs. That needs a kdist
    optimizer: resuming such a model with another optimizer raises
    `ValueError` (give the model an `Input`, or wrap its optimizer in
    `kdist.DistributedOptimizer`). For a resume that continues exactly as the
    uninterrupted run would, see the data-parallel guide
    (docs/data-parallel.md, "Checkpoints and resume").

    Args:
        directory: where checkpoints go (a path or path-like; created when the
            first checkpoint is written).
        keep: how many of the newest checkpoints to keep; at least 1.
        save_freq: save after every `save_freq` epochs; at least 1.

    Attributes:
        resumed_from: once training began, the number of epochs the loaded
            checkpoint had finished, or None if training started afresh.

    Raises:
        ValueError: `keep` or `save_freq` is below 1; when training begins,
            a checkpoint from another model, a model built in its first step
            without a kdist optimizer (when there is a checkpoint to resume
            from), or a model whose ranks hold different parts of it
            (`ranks_hold_different_weights`; save such a model with
            `ModelCheckpoint(path, save_weights_only=True)`).

    Example:

        >>> import kdist, tempfile
        >>> checkpoint = kdist.callbacks.Checkpoint(tempfile.mkdtemp())
    """

    def __init__(self, directory, keep=2, save_freq=1):
        super().__init__()
        if int(keep) < 1:
            raise ValueError(f"keep must be at least 1; got {keep}.")
        if int(save_freq) < 1:
            raise ValueError(f"save_freq must be a positive number of epochs; got {save_freq}.")
        self.directory = os.fspath(directory)
        self.keep = int(keep)
        self.save_freq = int(save_freq)
        self.resumed_from = None

    def on_train_begin(self, logs=None):
        if getattr(self.model, "ranks_hold_different_weights", False):
            # Rank 0's state, saved for all and broadcast back on resume, is one part of
            # such a model (a pipeline stage): refuse before any collective starts.
            raise ValueError(
                "kdist.callbacks.Checkpoint saves rank 0's weights for every rank, but each "
                "rank of this model holds a different part of it (a pipeline stage or a "
                "slice). Save it with keras.callbacks.ModelCheckpoint(path, "
                "save_weights_only=True), which calls the model's own save_weights.")
        joins.forget(self.model)
        if processes.world_generation() > 0:
            # An elastic job that lost or gained ranks: its last commit, already
            # in memory on every rank, is newer than anything on disk.
            return
        path = latest_checkpoint(self.directory) if processes.rank() == 0 else None
        epoch = saved_epoch(path) if path is not None else None
        path, epoch = collectives.broadcast_object((path, epoch), root_rank=0)
        if epoch is None:
            return
        _keras_private.set_initial_epoch(self.model, epoch)
        self.resumed_from = epoch
        if model_state.built(self.model):
            self._restore(path)
            return
        # Keras builds this model in its first step: restore once its variables
        # exist, before that step first runs.
        core = team.distributed_core(self.model)
        if core is None:
            raise ValueError(
                "Checkpoint cannot resume this model: Keras builds it in its first step and "
                "its optimizer is not kdist's, so nothing can run between the two. Give the "
                "model a keras.Input (or call model.build(...)) before fit, or wrap its "
                "optimizer in kdist.DistributedOptimizer.")
        consistency.before_first_update(core, lambda: self._restore(path))

    def _restore(self, path):
        variables = model_state.model_state(self.model)
        if processes.rank() == 0:
            load_state(path, variables)
        collectives.broadcast_variables(variables, root_rank=0)
        logger.info("resumed from %s: %d epoch(s) already done", path, self.resumed_from)

    def on_epoch_end(self, epoch, logs=None):
        joins.join_once(self.model, epoch)
        if (epoch + 1) % self.save_freq or processes.rank() != 0:
            return
        path = os.path.join(self.directory, f"epoch-{epoch + 1:06d}.npz")
        save_state(path, model_state.model_state(self.model), epoch + 1)
        logger.debug("saved %s", path)
        for old in sorted(glob.glob(os.path.join(self.directory, "epoch-*.npz")))[:-self.keep]:
            os.unlink(old)
