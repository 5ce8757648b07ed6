"""Trains the small test model with Keras `fit` under a TensorFlow strategy.

    python tf_train.py kdist|stock|none [--steps N] [--global-batch B]

Every worker reads the same dataset, batched with the global batch; the
strategy shards each global batch across the workers (DATA policy, no
shuffle), so several workers and one process see the same batches per step.
"""

import argparse

from tf_common import one_thread, report, task_index

parser = argparse.ArgumentParser()
parser.add_argument("strategy", choices=("kdist", "stock", "none"))
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--global-batch", type=int, default=16)
parser.add_argument("--epochs", type=int, default=2)
args = parser.parse_args()

one_thread()

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras  # noqa: E402
from common import flat_weights, global_batches, small_model  # noqa: E402

if args.strategy == "kdist":
    from kdist.distribute.multi_worker import MultiWorkerMirroredStrategy

    strategy = MultiWorkerMirroredStrategy()
elif args.strategy == "stock":
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
else:
    strategy = tf.distribute.get_strategy()

x, y = global_batches(args.steps, args.global_batch)
x, y = x.reshape(-1, x.shape[-1]), y.reshape(-1)
options = tf.data.Options()
options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(args.global_batch)
dataset = dataset.with_options(options)

with strategy.scope():
    model = small_model()
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
history = model.fit(dataset, epochs=args.epochs, validation_data=dataset, verbose=0)
evaluation = model.evaluate(dataset, verbose=0)
predictions = model.predict(dataset, verbose=0)
# 30 rows do not fill the last global batch: workers get unequal slices.
uneven = model.predict(x[:30], batch_size=args.global_batch, verbose=0)
result = {
    "task": task_index(),
    "replicas": strategy.num_replicas_in_sync,
    "weights": flat_weights(model),
    "history": {k: [float(v) for v in vs] for k, vs in history.history.items()},
    "evaluate": [float(v) for v in evaluation],
    "predict": np.asarray(predictions, dtype=np.float64).ravel().tolist(),
    "predict_uneven": np.asarray(uneven, dtype=np.float64).ravel().tolist(),
    "steps_per_execution_error": None,
}
if args.strategy == "kdist" and strategy.num_replicas_in_sync > 1:
    # A known limit must come with its reason, not a placeholder error.
    with strategy.scope():
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss=model.loss,
                      steps_per_execution=2)
    try:
        model.fit(dataset, epochs=1, verbose=0)
    except ValueError as error:
        result["steps_per_execution_error"] = str(error)
report(result)
print("done", task_index(), flush=True)
