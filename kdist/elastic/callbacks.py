"""Keras callbacks that keep an elastic job's state up to date during `fit`."""

import keras

from kdist._args import whole_number
from kdist.coordination import joins


class CommitStateCallback(keras.callbacks.Callback):
    """Commits `state` every `batches_per_commit` batches and after each epoch.

    A commit copies the model and optimizer to host memory; after a failure
    the survivors go back to the last one, so fewer batches per commit lose
    less work and cost more copying. A commit that falls due at the end of a
    batch or an epoch is made when the next batch or epoch begins (or when
    training ends), once every callback has updated the state (the batch and
    epoch counters among them), whatever the order of the callbacks. The
    count starts afresh with every `fit`, so the ranks commit together after
    a reset.

    Args:
        state: the `kdist.elastic` state to commit.
        batches_per_commit: commit every this many batches (a whole number, at
            least 1).

    Raises:
        ValueError: `batches_per_commit` is below 1 or a fraction.
        TypeError: `batches_per_commit` is a boolean or not a number.
    """

    def __init__(self, state, batches_per_commit=1):
        super().__init__()
        whole_number(batches_per_commit, "batches_per_commit", minimum=1)
        self.state = state
        self.batches_per_commit = int(batches_per_commit)
        self._remaining = self.batches_per_commit
        self._due = False

    # A commit falls due at the end of a batch or an epoch but happens when the
    # next one begins, once every callback has updated the state (the batch and
    # epoch counters among them), whatever the order of the callbacks.

    def on_train_begin(self, logs=None):
        # Every rank starts counting afresh after a reset, so commits line up.
        self._remaining = self.batches_per_commit
        self._due = False

    def on_train_batch_end(self, batch, logs=None):
        self._remaining -= 1
        if self._remaining == 0:
            self._due = True
            self._remaining = self.batches_per_commit

    def on_train_batch_begin(self, batch, logs=None):
        self._commit_if_due()

    def on_epoch_end(self, epoch, logs=None):
        self._due = True

    def on_epoch_begin(self, epoch, logs=None):
        self._commit_if_due()

    def on_train_end(self, logs=None):
        self._commit_if_due()

    def _commit_if_due(self):
        if self._due:
            self.state.commit()
            self._due = False


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Keeps `state.batch`, the batches finished in the current epoch, and resumes there.

    After a reset in the middle of an epoch, the first epoch of the next `fit`
    runs only the batches that epoch still had to run (the data it draws are
    the iterator's next ones, as in Horovod). Put it after callbacks that stop
    training on their own. Keep `batch=0` among the state's values.
    """

    def __init__(self, state):
        super().__init__()
        self.state = state
        self._skip = 0
        self._stopped_epoch = False

    def on_train_begin(self, logs=None):
        self._skip = int(getattr(self.state, "batch", 0) or 0)

    def on_epoch_begin(self, epoch, logs=None):
        self._stopped_epoch = False

    def on_train_batch_end(self, batch, logs=None):
        self.state.batch = self._skip + batch + 1
        steps = (self.params or {}).get("steps")
        if self._skip and steps and self.state.batch >= steps:
            # Ends this epoch early; on_epoch_end lets training go on.
            self.model.stop_training = True
            self._stopped_epoch = True

    def on_epoch_end(self, epoch, logs=None):
        self.state.batch = 0
        self._skip = 0
        if self._stopped_epoch:
            self.model.stop_training = False
            self._stopped_epoch = False


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Keeps `state.epoch`, the epochs finished over every `fit` of the job.

    Keras counts the epochs of each `fit` from 0 (or from `initial_epoch`);
    the state counts the epochs finished across every `fit` and reset, with
    or without `initial_epoch`, so a script passes `epochs=total - state.epoch`.
    At each epoch's end the ranks meet (`kdist.join`), so shards of different
    lengths are fine. Keep `epoch=0` among the state's values.
    """

    def __init__(self, state):
        super().__init__()
        self.state = state
        self._start = int(getattr(state, "epoch", 0) or 0)
        self._first = None

    def on_train_begin(self, logs=None):
        self._start = int(getattr(self.state, "epoch", 0) or 0)
        self._first = None
        joins.forget(self.model)  # a fit after a reset counts its epochs from 0 again

    def on_epoch_begin(self, epoch, logs=None):
        if self._first is None:
            self._first = epoch  # 0, or initial_epoch

    def on_epoch_end(self, epoch, logs=None):
        # Ranks with fewer batches wait here for the others (kdist.join), so that
        # every rank starts the next epoch, or the end of training, together.
        joins.join_once(self.model, epoch)
        self.state.epoch = self._start + epoch - self._first + 1
