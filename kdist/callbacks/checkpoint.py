"""Atomic checkpoints of a training run, and resuming from them."""

import glob
import json
import logging
import os
import re
import tempfile

import keras
import numpy as np

from kdist._version import __version__
from kdist.callbacks import _sync
from kdist.callbacks.broadcast import model_state
from kdist.comm import collectives
from kdist.comm import processes

logger = logging.getLogger(__name__)

_NAME = re.compile(r"^epoch-(\d{6})\.npz$")


def _variable_path(v):
    return getattr(v, "path", None) or getattr(v, "name", "?")


def save_state(path, variables, epoch):
    """Writes `variables` and the epoch to `path` atomically (all or nothing)."""
    arrays = {f"v{i:05d}": np.asarray(keras.ops.convert_to_numpy(v))
              for i, v in enumerate(variables)}
    meta = {"epoch": int(epoch), "paths": [_variable_path(v) for v in variables],
            "kdist": __version__}
    write_npz_atomically(path, arrays, meta)


def write_npz_atomically(path, arrays, meta):
    """Writes numpy `arrays` and a JSON-able `meta` dict to `path`: all or nothing.

    A crash mid-write leaves the previous file in place, never a torn one.
    """
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    arrays = dict(arrays)
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    handle, temporary = tempfile.mkstemp(dir=directory, prefix=".partial-", suffix=".npz")
    try:
        with os.fdopen(handle, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise


def load_state(path, variables):
    """Assigns the values saved at `path` to `variables`; returns the saved epoch."""
    with np.load(path) as data:
        meta = json.loads(bytes(data["meta"]).decode())
        if len(meta["paths"]) != len(variables):
            raise ValueError(
                f"Checkpoint {path} holds {len(meta['paths'])} variables but the model and "
                f"optimizer have {len(variables)}: it was written by another model.")
        for i, v in enumerate(variables):
            value = data[f"v{i:05d}"]
            if tuple(value.shape) != tuple(v.shape):
                raise ValueError(
                    f"Checkpoint {path}: variable '{meta['paths'][i]}' has shape {value.shape} "
                    f"but '{_variable_path(v)}' here has shape {tuple(v.shape)}.")
            v.assign(value)
    return meta["epoch"]


def latest_checkpoint(directory):
    """The path of the newest complete checkpoint in `directory`, or None."""
    found = []
    for path in glob.glob(os.path.join(directory, "epoch-*.npz")):
        match = _NAME.match(os.path.basename(path))
        if match:
            found.append((int(match.group(1)), path))
    return max(found)[1] if found else None


class Checkpoint(keras.callbacks.Callback):
    """Saves the training state after every epoch and resumes from it.

    Rank 0 writes the model's variables, the optimizer's state and the number
    of finished epochs to `directory/epoch-NNNNNN.npz`, atomically (a file is
    complete or absent). When training begins, rank 0 looks for the newest
    checkpoint; if there is one, it is loaded and broadcast to every rank and
    `fit` continues with the next epoch. Rerunning the same command therefore
    resumes an interrupted run.

    Args:
        directory: where checkpoints go.
        keep: how many of the newest checkpoints to keep.
        save_freq: save after every `save_freq` epochs.

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
        _sync.forget(self.model)
        variables = model_state(self.model)
        path = latest_checkpoint(self.directory) if processes.rank() == 0 else None
        epoch = None
        if path is not None:
            epoch = load_state(path, variables)
        epoch = collectives.broadcast_object(epoch, root_rank=0)
        if epoch is None:
            return
        collectives.broadcast_variables(variables, root_rank=0)
        self.model._initial_epoch = epoch
        self.resumed_from = epoch
        logger.info("resumed from %s: %d epoch(s) already done", path or self.directory, epoch)

    def on_epoch_end(self, epoch, logs=None):
        _sync.join_once(self.model, epoch)
        if (epoch + 1) % self.save_freq or processes.rank() != 0:
            return
        path = os.path.join(self.directory, f"epoch-{epoch + 1:06d}.npz")
        save_state(path, model_state(self.model), epoch + 1)
        logger.debug("saved %s", path)
        for old in sorted(glob.glob(os.path.join(self.directory, "epoch-*.npz")))[:-self.keep]:
            os.unlink(old)
