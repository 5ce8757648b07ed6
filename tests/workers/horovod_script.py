"""A Horovod TF2-Keras training script; the only change is the import line.

After training it calls the rest of Horovod's top-level API the way Horovod's
documentation does, so that the test can check each answer across ranks.
"""

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
                               average_aggregated_gradients=True,
                               compression=hvd.Compression.fp16)
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
rank = hvd.rank()
value = np.array([rank + 1.0, 10.0 * (rank + 1)])
variable = tf.Variable(np.full(3, float(rank), np.float32))
hvd.broadcast_variables([variable], root_rank=1)
api = {
    "average": hvd.allreduce(value).tolist(),
    "sum": hvd.allreduce(value, op=hvd.Sum).tolist(),
    "min": hvd.allreduce(value, op=hvd.Min).tolist(),
    "max": hvd.allreduce(value, op=hvd.Max).tolist(),
    "allgather": hvd.allgather(np.full((rank + 1, 2), rank, np.int32)).tolist(),
    "broadcast": hvd.broadcast(value, root_rank=1).tolist(),
    "broadcast_variables": variable.numpy().tolist(),
    "cross": [hvd.cross_rank(), hvd.cross_size()],
    "local_size": hvd.local_size(),
    "threads": hvd.mpi_threads_supported(),
    "join": hvd.join(),
}
from mpi4py import MPI  # noqa: E402

api["threads_expected"] = MPI.Query_thread() == MPI.THREAD_MULTIPLE
hvd.shutdown()
api["after_shutdown"] = hvd.is_initialized()
hvd.init()
api["reinit_sum"] = hvd.allreduce(np.array([1.0]), op=hvd.Sum).tolist()
report({"weights_sum": float(sum(np.sum(w) for w in model.get_weights())),
        "lr": history.history["learning_rate"], "accuracy": history.history["accuracy"],
        "local_rank": hvd.local_rank(), "size": hvd.size(), "api": api})
