"""Two stages, each split over two ranks by tensor-parallel layers, against the whole model.

Ranks 0 and 1 hold the first stage, ranks 2 and 3 the second; each stage is a
column-parallel then a row-parallel layer. Every rank trains the whole model
itself on the same batches to compare.
"""

import sys

import keras
import numpy as np

import kdist
from kdist.pipeline import (ColumnParallelDense, PipelineModel, RowParallelDense,
                            load_whole_model_weights)
from workers.common import report

path = sys.argv[1]
kdist.init()


def whole():
    keras.utils.set_random_seed(5)
    return keras.Sequential([
        keras.Input((10,)), keras.layers.Dense(16, activation="tanh"),
        keras.layers.Dense(12, activation="tanh"), keras.layers.Dense(8, activation="tanh"),
        keras.layers.Dense(3)])


reference = whole()
start = whole()


def stage(first, width, units):
    def build(group):
        layers = [ColumnParallelDense(width, activation="tanh", group=group),
                  RowParallelDense(units, activation="tanh" if first else None, group=group)]
        model = keras.Sequential([keras.Input((10 if first else 12,))] + layers)
        offset = 0 if first else 2
        for layer, full in zip(layers, start.layers[offset:offset + 2]):
            layer.load_from_full(full)
        return model
    return build


def compile_args():
    return dict(optimizer=keras.optimizers.Adam(0.01), metrics=["accuracy"],
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))


rng = np.random.default_rng(1)
x = rng.normal(size=(48, 10)).astype("float32")
y = rng.integers(0, 3, 48)
reference.compile(**compile_args())
expected = reference.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0).history

model = PipelineModel([stage(True, 16, 12), stage(False, 8, 3)], micro_batches=3,
                      tensor_parallel=2)
model.compile(**compile_args())
history = model.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0).history
model.save_weights(path)
kdist.barrier()
restored = whole()
load_whole_model_weights(restored, path)
error = max(float(np.max(np.abs(a - b)))
            for a, b in zip(restored.get_weights(), reference.get_weights()))
shard = model.stage.layers[0].kernel.shape
model.load_weights(path)  # the whole weights, sliced again for this rank
reloaded = float(np.max(np.abs(model.predict(x[:5], verbose=0)
                               - reference.predict(x[:5], verbose=0))))
model.close()
report({"stage": model.stage_index, "tensor_rank": model.tensor_rank,
        "shard": list(shard), "weight_error": error, "prediction_error": reloaded,
        "loss": history["loss"], "expected_loss": expected["loss"]})
