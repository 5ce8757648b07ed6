"""A conditional GAN with an auxiliary head, trained one way or another by --mode.

`single` trains on one process with the global batch; `hvd` wraps both
optimizers in `kdist.DistributedOptimizer` and gives each rank its share of
every global batch; `mpi` builds and compiles inside `MPIStrategy`; `ps`
inside `ParameterServerStrategy`. Latent draws ride in the data so that every
way sees the same noise for the same sample.
"""

import argparse

import keras
import numpy as np

import ps_record
from common import report

import kdist
import kdist.gan

parser = argparse.ArgumentParser()
parser.add_argument("--mode", choices=["single", "hvd", "mpi", "ps"], default="single")
parser.add_argument("--optimizer", default="sgd")
parser.add_argument("--global-batch", type=int, default=32)
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--d-steps", type=int, default=2)
parser.add_argument("--g-steps", type=int, default=1)
parser.add_argument("--seed-per-rank", action="store_true")
parser.add_argument("--jit", action="store_true", help="compile the steps with XLA")
parser.add_argument("--record", help="with --mode ps: record the exchanges (see ps_record)")
args = parser.parse_args()

LATENT, ROWS = 4, 256
rank, size = kdist.rank(), kdist.size()
rng = np.random.default_rng(3)
condition = rng.uniform(0.5, 2.0, size=(ROWS, 1)).astype("float32")
real = (condition * np.array([1.0, -0.5]) + 0.1 * rng.normal(size=(ROWS, 2))).astype("float32")
latent = rng.normal(size=(ROWS, args.d_steps + args.g_steps, LATENT)).astype("float32")
data = {"real": real, "condition": condition, "latent": latent}


def build():
    keras.utils.set_random_seed(10 + (rank if args.seed_per_rank else 0))
    noise, cond = keras.Input((LATENT,)), keras.Input((1,))
    hidden = keras.layers.Dense(16, "tanh")(keras.layers.Concatenate()([noise, cond]))
    generator = keras.Model([noise, cond], keras.layers.Dense(2)(hidden), name="generator")
    sample = keras.Input((2,))
    hidden = keras.layers.Dense(16, "tanh")(sample)
    discriminator = keras.Model(sample, [keras.layers.Dense(1, "sigmoid", name="fake")(hidden),
                                         keras.layers.Dense(1, name="energy")(hidden)],
                                name="discriminator")
    return kdist.gan.GAN(generator, discriminator, d_steps=args.d_steps, g_steps=args.g_steps)


def optimizer():
    return keras.optimizers.get({"class_name": args.optimizer,
                                 "config": {"learning_rate": 0.05 if args.optimizer == "sgd"
                                            else 1e-3}})


callbacks, strategy = [], None
if args.mode in ("single", "hvd"):
    gan = build()
    d_opt, g_opt = optimizer(), optimizer()
    if args.mode == "hvd":
        d_opt, g_opt = kdist.DistributedOptimizer(d_opt), kdist.DistributedOptimizer(g_opt)
        callbacks = [kdist.callbacks.BroadcastGlobalVariablesCallback(0)]
        # Each rank takes its contiguous share of every global batch.
        local = args.global_batch // size
        data = {key: value.reshape(-1, size, local, *value.shape[1:])[:, rank].reshape(
            -1, *value.shape[1:]) for key, value in data.items()}
    gan.compile(d_opt, g_opt, aux_losses=["mse"], aux_loss_weights=[0.1], label_smoothing=0.1,
                jit_compile=args.jit)
    batch = args.global_batch // (size if args.mode == "hvd" else 1)
else:
    strategy = (kdist.distribute.MPIStrategy() if args.mode == "mpi"
                else kdist.ps.ParameterServerStrategy(mode="downpour"))
    with strategy.scope():
        gan = build()
        gan.compile(optimizer(), optimizer(), aux_losses=["mse"], aux_loss_weights=[0.1],
                    label_smoothing=0.1, jit_compile=args.jit)
    batch = args.global_batch

fit_kwargs = {}
if args.record:
    ps_record.install(args.record)
    fit_kwargs["worker_callbacks"] = []
    if strategy.is_worker:
        ps_record.watch(gan)
        fit_kwargs["worker_callbacks"].append(ps_record.StepStarts())
before_g, before_d = gan.generator.get_weights(), gan.discriminator.get_weights()
history = gan.fit(data, batch_size=batch, epochs=args.epochs, shuffle=False, verbose=0,
                  callbacks=callbacks, **fit_kwargs)


def flat(model):
    return np.concatenate([w.ravel() for w in model.get_weights()]).astype(float).tolist()


report({
    "generator": flat(gan.generator),
    "discriminator": flat(gan.discriminator),
    "moved": [float(max(np.abs(a - b).max() for a, b in zip(m.get_weights(), before)))
              for m, before in ((gan.generator, before_g), (gan.discriminator, before_d))],
    "d_iterations": int(gan.d_optimizer.iterations),
    "g_iterations": int(gan.g_optimizer.iterations),
    "history": {k: [float(v) for v in vs] for k, vs in history.history.items()},
    "exchanged": kdist.ps.Layout(gan).size if args.mode == "ps" else None,
    "all": ps_record.flat(gan).tolist() if args.record else None,
    "is_master": bool(strategy.is_master) if args.mode == "ps" else rank == 0,
    "jit": bool(gan.jit_compile),
})
