"""A worker's side of parameter-server training, for `fit` and custom loops.

`WorkerSession` is the lower-level API: call `step()` after each training
step, `end_epoch(epoch, logs)` after each epoch and `finish()` at the end;
it exchanges with the server every `sync_every` steps and tells you when
the master asked to stop. `SyncCallback` drives it from Keras `fit`.

Example of a custom loop (on every rank but the master):

```python
session = strategy.worker_session(model)
for epoch in range(epochs):
    for x, y in shard:
        train_step(x, y)
        if session.step():          # True once the master asks to stop
            break
    session.end_epoch(epoch, {"loss": float(loss)})
session.finish()
```
"""

import keras
import numpy as np

from kdist.ps import messages
from kdist.ps.exchange import ServerExchange


class WorkerSession:
    """Keeps a replica (the variables of `layout`) in step with its server.

    Get one from `ParameterServerStrategy.worker_session(models)`, for a
    custom training loop on a worker rank: call `step()` after each training
    step, `end_epoch(epoch, logs)` after each epoch and `finish()` at the end.
    `step` and `end_epoch` return True once the master asked to stop.
    `SyncCallback(session)` drives one from Keras `fit`.

    A worker that sends its weights (EASGD) first stretches its progress since
    its last exchange by `step_scale` (the strategy's `elastic_step_scale`);
    the others send the change of their weights since then.

    Args:
        comm: the job's `kdist.comm.Communicator`.
        parent: the server's rank, or the ranks of the top servers that each
            hold one shard of the centre.
        layout: the replica's `kdist.ps.Layout`.
        sends_weights: True for EASGD (send the weights), False for
            Downpour and GEM (send the update since the last pull).
        sync_every: training steps between two exchanges.
        slots: a `kdist.ps.shared.SharedSlots` for exchanges through shared
            memory, or None for messages.
        step_scale: EASGD's stretch of the worker's own progress.

    Attributes:
        steps: training steps counted so far.
        exchanges: exchanges made so far.
        stop_requested: True once the master asked to stop.
    """

    def __init__(self, comm, parent, layout, sends_weights, sync_every, slots=None,
                 step_scale=1.0):
        self.layout = layout
        self.link = ServerExchange(comm, parent, layout.size, slots)
        self.sends_weights = sends_weights
        self.sync_every = sync_every
        self.step_scale = float(step_scale)
        self.steps = 0
        self.exchanges = 0
        self.stop_requested = False
        # The centre as last pulled: the reply buffer keeps it until the next exchange.
        self.link.reply.body[:] = layout.read()

    def step(self):
        """Counts one training step; exchanges when due. Returns True to stop."""
        self.steps += 1
        if self.steps % self.sync_every == 0:
            self._sync(messages.EXCHANGE)
        return self.stop_requested

    def end_epoch(self, epoch, logs=None):
        """Exchanges and reports this epoch's metrics. Returns True to stop."""
        self._sync(messages.EPOCH_END, epoch, logs)
        return self.stop_requested

    def finish(self):
        """The last exchange: the server stops waiting for this worker."""
        self._sync(messages.DONE)

    def _sync(self, kind, epoch=0, logs=None):
        body = self.link.message.body
        self.layout.read_(body)
        t = self.layout.trainable_size
        if not self.sends_weights:
            body[:t] -= self.link.reply.body[:t]
        elif self.step_scale != 1.0:
            # The reply holds the weights this worker resumed from: stretch
            # its own progress since then before the elastic exchange.
            last = self.link.reply.body[:t]
            body[:t] -= last
            body[:t] *= self.step_scale
            body[:t] += last
        reply = self.link.exchange(kind, epoch=epoch, steps=self.steps, logs=logs)
        self.layout.write(reply.body)
        self.exchanges += 1
        self.stop_requested = self.stop_requested or reply.stop


class SyncCallback(keras.callbacks.Callback):
    """Runs a `WorkerSession` from inside `model.fit`.

    After each batch it calls `session.step()`, at each epoch's end
    `session.end_epoch(epoch, logs)`, at the end of training
    `session.finish()`; it sets `model.stop_training` once the master asks to
    stop. `ParameterServerStrategy.fit` adds one to every worker's callbacks.

    Args:
        session: the worker's `WorkerSession`.
    """

    def __init__(self, session):
        super().__init__()
        self.session = session

    def on_train_batch_end(self, batch, logs=None):
        if self.session.step():
            self.model.stop_training = True

    def on_epoch_end(self, epoch, logs=None):
        if self.session.end_epoch(epoch, logs):
            self.model.stop_training = True

    def on_train_end(self, logs=None):
        self.session.finish()


def shard(values, index, count):
    """This worker's rows of arrays (or nests of arrays), or of a tf.data dataset."""
    if values is None:
        return None
    import tensorflow as tf

    if isinstance(values, tf.data.Dataset):
        return values.shard(count, index)
    if isinstance(values, dict):
        return {k: shard(v, index, count) for k, v in values.items()}
    if isinstance(values, (list, tuple)):
        return type(values)(shard(v, index, count) for v in values)
    if hasattr(values, "shape") and len(getattr(values, "shape", ())) > 0:
        return np.asarray(values)[index::count]
    raise TypeError(
        f"Cannot split {type(values).__name__} between workers: pass numpy arrays, a dict "
        "or list of them, or a tf.data.Dataset; or pass shard=False to the strategy and "
        "give each rank its own data.")
