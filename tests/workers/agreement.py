"""Plain Horovod-style scripts whose ranks validate on their own shards.

`python agreement.py all` runs, in one job and in sequence: EarlyStopping and
ReduceLROnPlateau without MetricAverageCallback, a callback that stops rank 1's
fit alone, a learning rate changed on
rank 1 alone, a weight changed on rank 1 alone, and a custom train_step under
MPIStrategy. Each case reports what each rank saw; the two that must fail
catch the ValueError (raised on every rank alike, so the ranks stay in step).
Every fit there passes its callbacks through `kdist.callbacks.Agreement().around`.
`python agreement.py leave`: an Agreement without log averaging for one epoch,
then a fit without any agreement, where rank 1's EarlyStopping ends its fit
early and its script ends, while rank 0 trains on.
"""

import sys

import keras
import numpy as np
import tensorflow as tf

import kdist
from common import flat_weights, report

kdist.init()
rank = kdist.rank()
EPOCHS = 10


def data(seed, rows=256):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 8)).astype("float32")
    y = (x @ np.linspace(-1, 1, 8) + 0.1 * rng.normal(size=rows)).astype("float32")
    return x, y[:, None]


def shards():
    """This rank's training shard, and a validation shard that only rank 0's is like:
    rank 1's targets are noise, so its own val_loss soon stops improving."""
    x, y = data(rank)
    vx, vy = data(100 + rank, rows=64)
    if rank == 1:
        vy = np.random.default_rng(7).normal(size=vy.shape).astype("float32") * 3
    return x, y, vx, vy


def horovod_model(lr=2e-3):
    keras.utils.set_random_seed(rank)  # different on each rank: the broadcast fixes that
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"),
                              keras.layers.Dense(1)])
    model.compile(optimizer=kdist.DistributedOptimizer(keras.optimizers.Adam(lr)), loss="mse")
    return model


def fit(model, callbacks, epochs=EPOCHS, agreement=True):
    x, y, vx, vy = shards()
    callbacks = [kdist.callbacks.BroadcastGlobalVariablesCallback(0)] + callbacks
    if agreement:
        callbacks = kdist.callbacks.Agreement().around(callbacks)
    return model.fit(x, y, batch_size=32, epochs=epochs, validation_data=(vx, vy),
                     verbose=0, callbacks=callbacks)


def early_stopping():
    model = horovod_model()
    history = fit(model, [keras.callbacks.EarlyStopping(monitor="val_loss", patience=1)])
    return {"epochs": len(history.epoch), "history": history.history,
            "weights": flat_weights(model)}


def plateau():
    model = horovod_model(lr=2e-2)
    history = fit(model, [keras.callbacks.ReduceLROnPlateau(monitor="val_loss", factor=0.2,
                                                            patience=0, min_lr=1e-6)])
    return {"lr": float(model.optimizer.learning_rate.numpy()), "history": history.history,
            "weights": flat_weights(model)}


class OnRankOne(keras.callbacks.Callback):
    """Does `change(model)` at the end of the second epoch, on rank 1 only."""

    def __init__(self, change):
        super().__init__()
        self.change = change

    def on_epoch_end(self, epoch, logs=None):
        if epoch == 1 and rank == 1:
            self.change(self.model)


def failing(change):
    model = horovod_model()
    try:
        fit(model, [OnRankOne(change)], epochs=4)
    except ValueError as error:
        return {"error": str(error), "kernel": model.layers[0].kernel.path}
    return {"error": None}


def stop_alone():
    """A callback of rank 1's own stops its fit after the second epoch."""

    class StopOnRankOne(OnRankOne):
        pass

    model = horovod_model()
    history = fit(model, [StopOnRankOne(lambda m: setattr(m, "stop_training", True))],
                  epochs=4)
    return {"epochs": len(history.epoch), "weights": flat_weights(model)}


def halve_learning_rate(model):
    model.optimizer.learning_rate = float(model.optimizer.learning_rate.numpy()) / 2


def nudge_kernel(model):
    kernel = model.layers[0].kernel
    kernel.assign(kernel + 1e-3)


class Custom(keras.Model):
    """A custom train_step that logs a value of its own, computed on this rank's batch."""

    def train_step(self, batch):
        x, y = batch
        with tf.GradientTape() as tape:
            prediction = self(x, training=True)
            loss = self.compute_loss(x=x, y=y, y_pred=prediction)
        self.optimizer.apply(tape.gradient(loss, self.trainable_variables),
                             self.trainable_variables)
        # compute_loss divides by the number of replicas (Keras does so under any strategy).
        return {"batch_error": tf.reduce_mean(tf.square(prediction - y)), "scaled_loss": loss}


def strategy_custom_step():
    strategy = kdist.distribute.MPIStrategy()
    with strategy.scope():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((8,))
        model = Custom(inputs, keras.layers.Dense(1)(keras.layers.Dense(16)(inputs)))
        model.compile(optimizer="adam", loss="mse")
    x, y = data(0)
    history = model.fit(x, y, batch_size=32, epochs=3, verbose=0,
                        callbacks=kdist.callbacks.Agreement().around())
    return {"history": history.history, "weights": flat_weights(model)}


def leave():
    # An agreement built by hand, without log averaging: it warns at the first epoch
    # that EarlyStopping's inputs differ.
    model = horovod_model()
    agreement = kdist.callbacks.Agreement(average_logs=False)
    fit(model, agreement.around([keras.callbacks.EarlyStopping(monitor="val_loss")]),
        epochs=1, agreement=False)
    model = horovod_model()
    try:
        fit(model, [keras.callbacks.EarlyStopping(monitor="val_loss", patience=1)],
            epochs=40, agreement=False)
    except Exception as error:
        report({"error": str(error)})
        raise
    report({"finished": True})


if sys.argv[1] == "leave":
    leave()
else:
    report({
        "early_stopping": early_stopping(),
        "plateau": plateau(),
        "stop_alone": stop_alone(),
        "learning_rate": failing(halve_learning_rate),
        "weight": failing(nudge_kernel),
        "strategy": strategy_custom_step(),
    })
