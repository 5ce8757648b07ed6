"""A Horovod TF2-Keras training script; the only change is the import line."""

import numpy as np
import tensorflow as tf
from tensorflow import keras

import kdist as hvd  # was: import horovod.tensorflow.keras as hvd

from common import report

hvd.init()
rng = np.random.default_rng(hvd.rank())
x = rng.normal(size=(256, 20)).astype("float32")
y = (x[:, 0] + x[:, 1] > 0).astype("int64")
dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)

model = keras.Sequential([keras.Input((20,)), keras.layers.Dense(16, activation="relu"),
                          keras.layers.Dense(2)])
opt = keras.optimizers.SGD(0.01 * hvd.size(), momentum=0.9)
opt = hvd.DistributedOptimizer(opt, backward_passes_per_step=1,
                               average_aggregated_gradients=True)
model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              optimizer=opt, metrics=["accuracy"])
callbacks = [
    hvd.callbacks.BroadcastGlobalVariablesCallback(0),
    hvd.callbacks.MetricAverageCallback(),
    hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.01 * hvd.size(), warmup_epochs=2,
                                             verbose=1),
    hvd.callbacks.LearningRateScheduleCallback(initial_lr=0.01 * hvd.size(), multiplier=0.5,
                                               start_epoch=2),
]
if hvd.rank() == 0:
    callbacks.append(keras.callbacks.ModelCheckpoint("/tmp/unused-{epoch}.keras",
                                                     save_freq=10**9))
history = model.fit(dataset, epochs=3, callbacks=callbacks,
                    verbose=1 if hvd.rank() == 0 else 0)
report({"weights_sum": float(sum(np.sum(w) for w in model.get_weights())),
        "lr": history.history["learning_rate"], "accuracy": history.history["accuracy"],
        "local_rank": hvd.local_rank(), "size": hvd.size()})
