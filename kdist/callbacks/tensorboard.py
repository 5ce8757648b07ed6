"""TensorBoard for data-parallel jobs: one writer, every rank's step time."""

import time

import keras
import numpy as np

from kdist import _keras_private
from kdist.comm import collectives, processes


class TensorBoard(keras.callbacks.TensorBoard):
    """Keras's `TensorBoard` callback, written by rank 0 only, with each rank's step time.

    Every rank times its training steps; at each epoch's end the ranks
    gather their mean step times, and rank 0 writes them as
    `step_time/rank_<r>` (seconds) with `step_time/slowest_over_fastest`,
    the straggler ratio, next to Keras's own scalars. Other ranks write
    nothing, so all ranks may share one `log_dir`. Put it on every rank:
    the gather is collective. Each epoch's first step is left out of its
    mean when the epoch has others (a `fit`'s first step includes tracing).

    Args:
        log_dir: as for `keras.callbacks.TensorBoard`.
        **kwargs: the other arguments of `keras.callbacks.TensorBoard`.

    Attributes:
        last_step_times: on every rank, the last epoch's mean step time of
            each rank, `{rank: seconds}`.

    Example:

        >>> import keras, numpy as np, tempfile, kdist
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        >>> model.compile("sgd", "mse")
        >>> board = kdist.callbacks.TensorBoard(tempfile.mkdtemp())
        >>> _ = model.fit(np.ones((8, 4)), np.ones((8, 1)), epochs=2, verbose=0, callbacks=[board])
        >>> sorted(board.last_step_times)
        [0]
    """

    def __init__(self, log_dir="logs", **kwargs):
        super().__init__(log_dir, **kwargs)
        self.writes = processes.rank() == 0
        self._started = None
        self._durations = []
        self.last_step_times = {}

    def set_model(self, model):
        if self.writes:
            super().set_model(model)
        else:
            # Keras's TensorBoard opens its writers here; a rank that writes nothing
            # only keeps the model, as every callback does.
            keras.callbacks.Callback.set_model(self, model)

    def on_train_batch_begin(self, batch, logs=None):
        self._started = time.perf_counter()
        if self.writes:
            super().on_train_batch_begin(batch, logs)

    def on_train_batch_end(self, batch, logs=None):
        if self._started is not None:
            self._durations.append(time.perf_counter() - self._started)
        if self.writes:
            super().on_train_batch_end(batch, logs)

    def on_epoch_end(self, epoch, logs=None):
        # The first step of a fit includes tracing: left out when others exist.
        steps = self._durations[1:] or self._durations
        mine = float(np.mean(steps)) if steps else float("nan")
        self._durations = []
        everyone = collectives.allgather_object(mine) if processes.size() > 1 else [mine]
        self.last_step_times = dict(enumerate(everyone))
        if not self.writes:
            return
        super().on_epoch_end(epoch, logs)
        writer = _keras_private.tensorboard_train_writer(self)
        with writer.as_default():
            for rank, seconds in self.last_step_times.items():
                self.summary.scalar(f"step_time/rank_{rank}", seconds, step=epoch)
            known = [s for s in everyone if np.isfinite(s) and s > 0]
            if known:
                self.summary.scalar("step_time/slowest_over_fastest",
                                    max(known) / min(known), step=epoch)
        writer.flush()


def _forward_unless_writing(name):
    def hook(self, *args, **kwargs):
        if self.writes:
            getattr(keras.callbacks.TensorBoard, name)(self, *args, **kwargs)

    hook.__name__ = name
    return hook


# Keras's other hooks open writers or profile; ranks that do not write skip them.
for _name in ("on_train_begin", "on_train_end", "on_test_begin", "on_test_end",
              "on_test_batch_begin", "on_test_batch_end", "on_predict_begin", "on_predict_end"):
    if hasattr(keras.callbacks.TensorBoard, _name):
        setattr(TensorBoard, _name, _forward_unless_writing(_name))
