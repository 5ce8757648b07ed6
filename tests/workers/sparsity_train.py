"""Prunes (and optionally quantises) a small model on several ranks; reports the masks.

Usage: sparsity_train.py {hvd,mpi,ps} [--quantize]

Under the parameter server, each worker also reports the masks it trains with
in its second epoch, and the largest raw kernel value they hide.
"""

import argparse

import numpy as np

from common import report

parser = argparse.ArgumentParser()
parser.add_argument("mode", choices=["hvd", "mpi", "ps"])
parser.add_argument("--quantize", action="store_true")
parser.add_argument("--sync-ranges", action="store_true")
args = parser.parse_args()

import keras  # noqa: E402

import kdist  # noqa: E402
from kdist import sparsity  # noqa: E402

SCHEDULE = sparsity.PolynomialDecay(0.0, 0.75, begin_step=0, end_step=24, power=2,
                                    frequency=4)
rng = np.random.default_rng(0)
x = rng.normal(size=(1024, 12)).astype("float32")
y = np.argmax(x[:, :4] @ rng.normal(size=(4, 4)), axis=-1).astype("int64")


def build():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((12,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(4, name="logits")])
    model = sparsity.prune(model, SCHEDULE)
    if args.quantize:
        model = sparsity.quantize(model, bits=4)
    return model


def compile_(model, optimizer):
    model.compile(optimizer=optimizer, metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))


kdist.init()
rank, size = kdist.rank(), kdist.size()
extra = {}
syncing = [sparsity.SyncQuantizeRanges()] if args.sync_ranges else []
if args.mode == "hvd":
    model = build()
    compile_(model, kdist.DistributedOptimizer(keras.optimizers.Adam(1e-2)))
    part = slice(rank * len(x) // size, (rank + 1) * len(x) // size)
    history = model.fit(x[part], y[part], batch_size=64 // size, epochs=2, verbose=0,
                        shuffle=False,
                        callbacks=[kdist.callbacks.BroadcastGlobalVariablesCallback(0),
                                   sparsity.UpdatePruning(), *syncing])
elif args.mode == "mpi":
    strategy = kdist.distribute.MPIStrategy()
    with strategy.scope():
        model = build()
        compile_(model, keras.optimizers.Adam(1e-2))
    history = model.fit(x, y, batch_size=64, epochs=2, verbose=0, shuffle=False,
                        callbacks=[sparsity.UpdatePruning(), *syncing])
else:
    class MaskProbe(keras.callbacks.Callback):
        """What a worker starts each step of its second epoch from, before any final sync."""

        def __init__(self):
            super().__init__()
            self.epoch, self.steps = 0, []

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_begin(self, batch, logs=None):
            if self.epoch != 1:
                return
            step = {}
            for w in sparsity.pruned_layers(self.model):
                mask = keras.ops.convert_to_numpy(w.mask)
                kernel = keras.ops.convert_to_numpy(w.kernel)
                step[w.base_layer.name] = {
                    "mask": "".join("1" if v else "0" for v in mask.ravel()),
                    "hidden": float(np.abs(kernel[mask == 0]).max(initial=0.0))}
            self.steps.append(step)

    strategy = kdist.ps.ParameterServerStrategy(mode="downpour")
    with strategy.scope():
        model = build()
        compile_(model, keras.optimizers.SGD(0.05))
    probe = MaskProbe()
    history = model.fit(x, y, batch_size=32, epochs=2, verbose=0,
                        callbacks=[sparsity.UpdatePruning()], worker_callbacks=[probe])
    extra["worker_steps"] = probe.steps if strategy.is_worker else None

masks = {w.base_layer.name: keras.ops.convert_to_numpy(w.mask).astype(int).ravel().tolist()
         for w in sparsity.pruned_layers(model)}
outermost = [layer for layer in model.layers if isinstance(layer, sparsity.KernelWrapper)]
kernels = {w.base_layer.name: keras.ops.convert_to_numpy(w.effective_kernel()).ravel().tolist()
           for w in outermost}
plain = sparsity.strip(model)
report({"masks": masks, "kernels": kernels, "sparsity": sparsity.sparsity_of(model),
        "history": {k: [float(v) for v in vs] for k, vs in history.history.items()},
        # Stripping drops activation quantisation, so only a pruned model predicts the same
        # (up to float rounding: the strategy's predict runs another graph).
        "strip_equal": args.quantize or bool(np.allclose(model.predict(x, verbose=0),
                                                         plain.predict(x, verbose=0),
                                                         rtol=1e-5, atol=1e-6)),
        "expected": SCHEDULE.sparsity_reached(),
        "ranges": [[float(keras.ops.convert_to_numpy(v)) for v in (w.output_min, w.output_max)]
                   for w in outermost if isinstance(w, sparsity.QuantizeAware)], **extra})
