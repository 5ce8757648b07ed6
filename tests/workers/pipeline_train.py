"""Trains a model cut into pipeline stages and the same model whole; reports the differences.

Arguments: stages, replicas, schedule, optimizer, recompute (0/1), and a
path where the pipeline saves its weights. Every rank trains the whole
model on the global batch itself, so each can compare its own stage.
"""

import sys

import keras
import numpy as np

import kdist
from kdist.pipeline import PipelineModel, load_whole_model_weights, split
from workers.common import report

stages, replicas, schedule, optimizer, recompute, path = sys.argv[1:7]
stages, replicas, recompute = int(stages), int(replicas), recompute == "1"
kdist.init()
BATCH, EPOCHS = 12, 2


def build():
    keras.utils.set_random_seed(3)
    return keras.Sequential([
        keras.Input((10,)),
        keras.layers.Dense(16, activation="tanh"),
        keras.layers.Dense(16, activation="tanh", kernel_regularizer=keras.regularizers.L2(1e-2)),
        keras.layers.Dropout(0.0),
        keras.layers.Dense(8, activation="tanh"),
        keras.layers.Dense(3),
    ])


def compile_args():
    return dict(optimizer=keras.optimizers.get({"class_name": optimizer,
                                                "config": {"learning_rate": 0.05}}),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=["accuracy"])


rng = np.random.default_rng(0)
x = rng.normal(size=(96, 10)).astype("float32")
y = rng.integers(0, 3, 96)
reference = build()
reference.compile(**compile_args())
expected = reference.fit(x, y, batch_size=BATCH * replicas, epochs=EPOCHS, shuffle=False,
                         verbose=0).history

# Replica r takes rows r*BATCH to (r+1)*BATCH of every global batch.
replica = kdist.rank() // stages
steps = len(x) // (BATCH * replicas)
rows = np.arange(len(x)).reshape(steps, replicas, BATCH)[:, replica].reshape(-1)

whole = build()
cuts = {1: [], 2: [2], 4: [1, 2, 4]}[stages]
# Batches of 12 rows cut into micro-batches of 3, 3, 2, 2 and 2: uneven shares.
model = PipelineModel(split(whole, cuts) if cuts else [whole], micro_batches=5,
                      schedule=schedule, recompute=recompute, replicas=replicas)
model.compile(**compile_args())
# Keras's own checkpoint callback calls save_weights on every rank, as a pipeline needs.
saved_each_epoch = keras.callbacks.ModelCheckpoint(path + ".epoch.weights.h5",
                                                   save_weights_only=True)
history = model.fit(x[rows], y[rows], batch_size=BATCH, epochs=EPOCHS, shuffle=False,
                    verbose=2 if kdist.rank() == 0 else 0, callbacks=[saved_each_epoch]).history

try:
    model.fit(x[rows][:BATCH], y[rows][:BATCH], batch_size=BATCH, epochs=1, verbose=0,
              callbacks=[kdist.callbacks.Checkpoint(path + ".kdist-checkpoint")])
    refused = None
except ValueError as error:
    refused = str(error)

mine = [whole.layers.index(layer) for layer in model.stage.layers]
error = max(float(np.max(np.abs(a.numpy() - b.numpy())))
            for i in mine for a, b in zip(whole.layers[i].weights, reference.layers[i].weights))
prediction = model.predict(x[:7], verbose=0)
evaluation = model.evaluate(x[rows], y[rows], batch_size=BATCH, verbose=0)
model.save_weights(path)
model.close()
kdist.barrier()

# The same file, into the whole model in one process and into four stages with no replicas.
restored = build()
load_whole_model_weights(restored, path)
restored_error = max(float(np.max(np.abs(a - b)))
                     for a, b in zip(restored.get_weights(), reference.get_weights()))
load_whole_model_weights(restored, path + ".epoch.weights.h5")
checkpoint_error = max(float(np.max(np.abs(a - b)))
                       for a, b in zip(restored.get_weights(), reference.get_weights()))
relaid = None
if kdist.size() == 4:
    other = PipelineModel(split(build(), [1, 2, 4]), micro_batches=2, replicas=1)
    other.load_weights(path)
    relaid = float(np.max(np.abs(other.predict(x[:7], verbose=0)
                                 - reference.predict(x[:7], verbose=0))))
    other.close()

report({
    "stage": model.stage_index, "replica": model.replica, "weight_error": error,
    "loss": history["loss"], "expected_loss": expected["loss"],
    "accuracy": history["accuracy"], "expected_accuracy": expected["accuracy"],
    "prediction_error": float(np.max(np.abs(prediction - reference.predict(x[:7], verbose=0)))),
    "evaluation": evaluation,
    "restored_error": restored_error, "relaid_prediction_error": relaid,
    "checkpoint_error": checkpoint_error, "kdist_checkpoint_refused": refused,
})
