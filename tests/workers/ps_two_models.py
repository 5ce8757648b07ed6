"""A model made of two sub-models, each with its own optimizer, trained by the parameter server.

Each step updates both halves (as a GAN's alternating step does); the exchange
after it must carry both. Reports each half's weights on every rank; with a
directory as argument, records the exchanges there (see ps_record).
"""

import sys

import keras
import numpy as np
import tensorflow as tf

import ps_record
from common import report

import kdist


class Pair(keras.Model):
    """`first` fits y from x; `second` fits y from `first`'s output, with its own optimizer."""

    def __init__(self):
        super().__init__()
        self.first = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, "tanh"),
                                       keras.layers.Dense(1)])
        self.second = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])

    def compile(self, first_optimizer, second_optimizer):
        super().compile()
        self.first_optimizer = first_optimizer
        self.second_optimizer = second_optimizer

    def call(self, x):
        return self.second(self.first(x))

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            first_loss = tf.reduce_mean(tf.square(self.first(x) - y))
        grads = tape.gradient(first_loss, self.first.trainable_variables)
        self.first_optimizer.apply(grads, self.first.trainable_variables)
        with tf.GradientTape() as tape:
            second_loss = tf.reduce_mean(tf.square(self.second(self.first(x)) - y))
        grads = tape.gradient(second_loss, self.second.trainable_variables)
        self.second_optimizer.apply(grads, self.second.trainable_variables)
        return {"first_loss": first_loss, "second_loss": second_loss}


keras.utils.set_random_seed(0)
rng = np.random.default_rng(0)
x = rng.normal(size=(1024, 4)).astype("float32")
y = (x @ np.array([[1.0], [-2.0], [0.5], [0.0]], "float32")).astype("float32")

strategy = kdist.ps.ParameterServerStrategy(mode="downpour")
with strategy.scope():
    model = Pair()
    model(x[:1])
    model.compile(keras.optimizers.SGD(0.02), keras.optimizers.SGD(0.02))
worker_callbacks = []
if len(sys.argv) > 1:
    ps_record.install(sys.argv[1])
    if strategy.is_worker:
        ps_record.watch(model)
        worker_callbacks.append(ps_record.StepStarts())
before = [w.copy() for w in model.first.get_weights() + model.second.get_weights()]
history = model.fit(x, y, batch_size=32, epochs=3, worker_callbacks=worker_callbacks)
after = model.first.get_weights() + model.second.get_weights()
report({"first": [w.ravel().tolist() for w in model.first.get_weights()],
        "second": [w.ravel().tolist() for w in model.second.get_weights()],
        "moved": [float(np.abs(a - b).max()) for a, b in zip(after, before)],
        "exchanged": kdist.ps.Layout(model).size,
        "all": ps_record.flat(model).tolist(),
        "history": history.history if strategy.is_master else None})
