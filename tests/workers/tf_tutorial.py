"""TensorFlow's "multi-worker training with Keras" flow, Keras 3 edition.

A small CNN on MNIST-shaped generated data (no download), a repeated and
shuffled dataset batched with the global batch, `fit` with
`steps_per_epoch`, and a saved model; the only change from the single-worker
script is the strategy line.
"""

import os

from tf_common import one_thread, report, task_index

one_thread()

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras  # noqa: E402
from kdist.distribute.multi_worker import MultiWorkerMirroredStrategy  # noqa: E402

PER_WORKER_BATCH = 16


def mnist_like_dataset(batch_size, rows=512):
    # Digit d lights up row band d: learnable, and as shaped as MNIST.
    rng = np.random.default_rng(0)
    y = rng.integers(0, 10, rows).astype("int64")
    x = rng.integers(0, 64, (rows, 28, 28)).astype("float32")
    for i, digit in enumerate(y):
        x[i, 2 * digit + 4:2 * digit + 7, 4:24] = 255.0
    x = x / np.float32(255.0)
    return tf.data.Dataset.from_tensor_slices((x, y)).shuffle(rows, seed=1).repeat().batch(
        batch_size)


def build_and_compile_cnn_model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input(shape=(28, 28)),
        keras.layers.Reshape(target_shape=(28, 28, 1)),
        keras.layers.Conv2D(8, 3, activation="relu"),
        keras.layers.Flatten(),
        keras.layers.Dense(32, activation="relu"),
        keras.layers.Dense(10),
    ])
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=keras.optimizers.SGD(learning_rate=0.05),
                  metrics=["accuracy"])
    return model


strategy = MultiWorkerMirroredStrategy()  # the one changed line

num_workers = strategy.num_replicas_in_sync
global_batch_size = PER_WORKER_BATCH * num_workers
multi_worker_dataset = mnist_like_dataset(global_batch_size)

with strategy.scope():
    multi_worker_model = build_and_compile_cnn_model()

history = multi_worker_model.fit(multi_worker_dataset, epochs=2, steps_per_epoch=5, verbose=2)

# Every worker saves (saving may read distributed variables), the chief to
# the real path and the others to scratch paths.
directory = os.environ["KDIST_TEST_REPORTS"]
is_chief = strategy.cluster_resolver.task_id in (None, 0)
path = os.path.join(directory, "model.keras" if is_chief else f"scratch-{task_index()}.keras")
multi_worker_model.save(path)
if not is_chief:
    os.remove(path)

report({
    "task": task_index(),
    "workers": num_workers,
    "loss": [float(v) for v in history.history["loss"]],
    "weights_sum": float(sum(np.abs(w).sum() for w in multi_worker_model.get_weights())),
    "saved": os.path.exists(path),
})
