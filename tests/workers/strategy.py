"""A script written the tf.distribute way; only the strategy line depends on --strategy.

One process with `--strategy mirrored` (or `default`) trains on the whole
global batch; under mpiexec with `--strategy mpi` each rank is one replica.
No kdist callbacks and no manual sharding: the strategy does all of it.
"""

import argparse

import keras
import numpy as np
import tensorflow as tf

import kdist
from common import flat_weights, global_batches, report

parser = argparse.ArgumentParser()
parser.add_argument("--strategy", choices=["mpi", "mirrored", "default", "auto"], default="mpi")
parser.add_argument("--optimizer", default="sgd")
parser.add_argument("--lr", type=float, default=0.05)
parser.add_argument("--global-batch", type=int, default=16)
parser.add_argument("--steps", type=int, default=12)
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--batch-norm", choices=["none", "sync", "local"], default="none")
parser.add_argument("--seed-per-rank", action="store_true")
parser.add_argument("--mixed", action="store_true", help="mixed_float16 policy")
parser.add_argument("--distributed-optimizer", action="store_true",
                    help="also wrap the optimizer in kdist.DistributedOptimizer")
parser.add_argument("--overflow-batch", type=int, default=-1,
                    help="make the second half of this global batch overflow float16")
parser.add_argument("--jit", action="store_true", help="compile the steps with XLA")
args = parser.parse_args()

if args.mixed:
    keras.mixed_precision.set_global_policy("mixed_float16")

if args.strategy == "mpi":
    strategy = kdist.distribute.MPIStrategy()
elif args.strategy == "mirrored":
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
elif args.strategy == "auto":
    strategy = kdist.distribute.auto()
else:
    strategy = tf.distribute.get_strategy()

x, y = global_batches(args.steps, args.global_batch)
if args.overflow_batch >= 0:
    # Beyond float16's range; on 2 ranks only rank 1's slice holds these rows.
    x[args.overflow_batch, args.global_batch // 2:] = 1e5
x, y = x.reshape(-1, x.shape[-1]), y.reshape(-1)
dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(args.global_batch)

keras.utils.set_random_seed(100 + (kdist.rank() if args.seed_per_rank else 0))
with strategy.scope():
    layers = [keras.Input((x.shape[-1],)), keras.layers.Dense(32, activation="tanh")]
    if args.batch_norm != "none":
        layers.append(keras.layers.BatchNormalization(synchronized=args.batch_norm == "sync",
                                                      momentum=0.5))
    layers += [keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(4)]
    model = keras.Sequential(layers)
    optimizer = {"sgd": keras.optimizers.SGD, "adam": keras.optimizers.Adam}[args.optimizer]
    optimizer = optimizer(args.lr)
    if args.distributed_optimizer:
        optimizer = kdist.DistributedOptimizer(optimizer)
    model.compile(optimizer=optimizer, jit_compile=args.jit,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])

history = model.fit(dataset, epochs=args.epochs, verbose=0)
evaluation = model.evaluate(x, y, batch_size=args.global_batch, verbose=0, return_dict=True)
# 30 rows in batches of 8: the last batch (6 rows) splits unevenly on 4 ranks.
predictions = model.predict(x[:30], batch_size=8, verbose=0)
report({
    "replicas": int(strategy.num_replicas_in_sync),
    "strategy": type(strategy).__name__,
    "weights": flat_weights(model),
    "history": {k: [float(v) for v in vs] for k, vs in history.history.items()},
    "evaluation": {k: float(v) for k, v in evaluation.items()},
    "predictions": np.asarray(predictions, dtype=np.float64).tolist(),
    "iterations": int(model.optimizer.iterations.numpy()),
    "optimizer": type(model.optimizer).__name__,
    "optimizer_reduced_itself": bool(getattr(model.optimizer, "_reducers", None)),
    "jit": bool(model.jit_compile),
})
