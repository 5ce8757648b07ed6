"""Trains the 3D calorimeter GAN on one process or many.

    python train.py --quick --output run/                       # one process
    kdist run -n 2 train.py --quick --output run/               # data parallel
    kdist run -n 3 train.py --strategy ps --quick --output run/ # parameter server

Showers come from `--data` (HDF5 files with ECAL and energy, such as the
public CLIC files) or, when that directory holds none, are simulated into it
first. Every epoch is checkpointed under OUTPUT/checkpoints; rerunning the
same command resumes where the last run stopped. At the end rank 0 writes
OUTPUT/generator.keras, OUTPUT/gan.keras and OUTPUT/train.json (settings,
history, timing); `validate.py --input OUTPUT` compares generated showers
with simulated ones.

Strategies: `hvd` (each rank reads its share of the files, both optimizers
wrapped in kdist.DistributedOptimizer; `--batch-size` per rank), `mpi`
(kdist.distribute.MPIStrategy; the global batch is `--batch-size` times the
ranks), `ps` (kdist.ps.ParameterServerStrategy: rank 0 holds the central
models, the others train on their share), `single`. The default is `single`
on one process and `hvd` on several.
"""

import argparse
import glob
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import data  # noqa: E402
import model as gan_model  # noqa: E402


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", required=True, help="directory for models and checkpoints")
    parser.add_argument("--data", help="directory of shower HDF5 files (default OUTPUT/data)")
    parser.add_argument("--strategy", choices=["auto", "single", "hvd", "mpi", "ps"],
                        default="auto")
    parser.add_argument("--ps-mode", choices=["downpour", "easgd", "gem"], default="downpour")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=64, help="showers per rank and step")
    parser.add_argument("--files", type=int, default=4, help="files to simulate")
    parser.add_argument("--showers", type=int, default=1000, help="showers per simulated file")
    parser.add_argument("--steps", type=int, default=0,
                        help="steps per epoch (default: one pass over each rank's showers)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--d-steps", type=int, default=1)
    parser.add_argument("--g-steps", type=int, default=2)
    parser.add_argument("--aux-weight", type=float, default=0.1,
                        help="weight of the energy and cell-sum regressions (published: 0.1)")
    parser.add_argument("--coordinates", action="store_true",
                        help="the generator's last convolutions also see each cell's position")
    parser.add_argument("--log-cells", action="store_true",
                        help="the discriminator sees log(1 + cell / one hit), not the energies")
    parser.add_argument("--split-energy", action="store_true",
                        help="the total energy from its own network, fitted first; the "
                             "convolutions only share it out over the cells")
    parser.add_argument("--small", action="store_true", help="the small model, for CPUs")
    parser.add_argument("--quick", action="store_true",
                        help="small model, 2 files of 256 showers, 4 epochs")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.quick:
        args.small = True
        args.files, args.showers = min(args.files, 2), min(args.showers, 256)
        args.epochs = min(args.epochs, 4)
        args.batch_size = min(args.batch_size, 32)
    for name in ("epochs", "batch_size", "files", "showers"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.aux_weight < 0:
        parser.error("--aux-weight must be at least 0")
    args.data = args.data or os.path.join(args.output, "data")
    return args


def to_model_units(showers, energies):
    """Numpy showers (N, 25, 25, 25) in GeV and energies (N,) -> a GAN batch of rows."""
    real = (showers * gan_model.CELL_SCALE)[..., None].astype("float32")
    condition = (energies / gan_model.ENERGY_SCALE).reshape(-1, 1).astype("float32")
    return {"real": real, "condition": condition,
            "cell_sum": real.sum(axis=(1, 2, 3, 4)).reshape(-1, 1)}


def shower_dataset(files, batch_size, seed):
    import tensorflow as tf

    def as_gan_batch(row):
        return {"real": row["real"], "condition": row["condition"],
                "aux": (row["condition"], row["cell_sum"])}

    return (files.dataset(to_model_units)
            .shuffle(1024, seed=seed, reshuffle_each_iteration=True)
            .repeat()
            .batch(batch_size, drop_remainder=True)
            .map(as_gan_batch, num_parallel_calls=tf.data.AUTOTUNE)
            .prefetch(tf.data.AUTOTUNE))


def build_gan(args, total_weights=None, mean_fractions=None):
    """The GAN; with `total_weights` (from `fit_total_energy`), its generator
    splits the energy and the total network holds them, frozen; the mean
    shower's cell fractions (`ShowerFiles.mean_fractions`) are its shape prior."""
    import keras

    import kdist.gan

    keras.utils.set_random_seed(args.seed)
    generator = gan_model.generator(args.small, coordinates=args.coordinates,
                                    split_energy=total_weights is not None)
    if total_weights is not None:
        total = generator.get_layer("total_energy")
        total.set_weights(total_weights)
        total.trainable = False
        if mean_fractions is not None:
            generator.get_layer("shower").set_mean_shape(mean_fractions)
    discriminator = gan_model.discriminator(args.small, log_cells=args.log_cells)
    gan = kdist.gan.GAN(generator, discriminator,
                        d_steps=args.d_steps, g_steps=args.g_steps, seed=args.seed)
    return gan


def fit_total_energy(energies, totals, seed=0, steps=1500):
    """Fits a `model.total_energy` network to showers' primary `energies` and
    deposited `totals` (GeV): (weights, summary).

    Every rank fits the same network on all the rows of all the files (their
    totals only, one number per shower), outside any strategy, so no rank
    waits for another; the broadcast or checkpoint that follows leaves them
    identical anyway. The summary is the fitted (mean, sigma) of
    log(deposited / primary) at 10, 100 and 500 GeV.
    """
    import keras
    import numpy as np
    import tensorflow as tf

    condition = (energies / gan_model.ENERGY_SCALE).reshape(-1, 1).astype("float32")
    target = np.log(totals * gan_model.CELL_SCALE / condition[:, 0]).reshape(-1, 1)
    keras.utils.set_random_seed(seed)
    network = gan_model.total_energy()
    # Start from the sample's mean and spread, so the fit only learns their
    # dependence on the energy.
    kernel, _ = network.layers[-1].get_weights()
    network.layers[-1].set_weights([kernel * 0.1, np.array(
        [target.mean(), np.log(target.std() + 1e-6)], "float32")])
    optimizer = keras.optimizers.Adam(0.01)
    x, y = tf.constant(condition), tf.constant(target, tf.float32)

    @tf.function
    def fit():  # full-batch steps in one graph: Keras's fit would spend 50 ms on each
        for _ in tf.range(steps):
            with tf.GradientTape() as tape:
                loss = gan_model.gaussian_nll(y, network(x))
            optimizer.apply(tape.gradient(loss, network.trainable_variables),
                            network.trainable_variables)

    fit()
    probe = np.array([[0.1], [1.0], [5.0]], "float32")
    params = network.predict(probe, verbose=0)
    return network.get_weights(), {
        f"{e * gan_model.ENERGY_SCALE:g} GeV": [float(m), float(np.exp(s))]
        for e, (m, s) in zip(probe[:, 0], params)}


def compile_gan(gan, args, wrap=None):
    import keras

    optimizers = [keras.optimizers.Adam(args.lr, beta_1=0.5) for _ in range(2)]
    if wrap is not None:
        optimizers = [wrap(o) for o in optimizers]
    # One-sided label smoothing and the published loss weights: the adversarial
    # term counts double, the energy and cell-sum regressions a tenth each
    # (`--aux-weight`).
    weight = getattr(args, "aux_weight", 0.1)
    gan.compile(*optimizers, loss="binary_crossentropy",
                aux_losses=["mean_absolute_percentage_error"] * 2,
                aux_loss_weights=[weight, weight], adversarial_weight=2.0, label_smoothing=0.1)


def main(argv=None):
    args = parse(argv)
    import keras

    import kdist

    rank, size = kdist.rank(), kdist.size()
    strategy_name = args.strategy if args.strategy != "auto" else ("hvd" if size > 1 else "single")
    if strategy_name == "ps" and size < 2:
        raise SystemExit("--strategy ps needs at least 2 ranks: kdist run -n 3 train.py ...")
    if strategy_name == "single" and size > 1:
        raise SystemExit("--strategy single runs on one process; use hvd, mpi or ps under "
                         "kdist run.")
    if rank == 0:
        os.makedirs(args.output, exist_ok=True)
    found = glob.glob(os.path.join(args.data, "*.h5"))
    # Real files are used as they are; a simulated set left incomplete is completed.
    if rank == 0 and all(data.is_simulated(p) for p in found) and len(found) < args.files:
        print(f"Simulating {args.files - len(found)} x {args.showers} showers into "
              f"{args.data} ...", flush=True)
        data.make_dataset(args.data, args.files, args.showers, seed=args.seed)
    kdist.barrier()
    paths = sorted(glob.glob(os.path.join(args.data, "*.h5")))
    total_weights = total_fit = mean_fractions = None
    if args.split_energy:
        # One pass over every file gives both priors.
        energies, totals, mean_fractions = data.ShowerFiles(paths).statistics()
        total_weights, total_fit = fit_total_energy(energies, totals, seed=args.seed)
        if rank == 0:
            print("Total energy fitted, log(deposited / primary) mean and sigma: "
                  + ", ".join(f"{k} {m:.3f} {s:.4f}" for k, (m, s) in total_fit.items()),
                  flush=True)
    checkpoints = os.path.join(args.output, "checkpoints")
    callbacks, fit_kwargs = [], {}
    start = time.time()

    if strategy_name == "ps":
        strategy = kdist.ps.ParameterServerStrategy(mode=args.ps_mode, shard=False,
                                                    checkpoint_dir=checkpoints)
        with strategy.scope():
            gan = build_gan(args, total_weights, mean_fractions)
            compile_gan(gan, args)
        share = (strategy.worker_index, strategy.num_workers) if strategy.is_worker else (0, 1)
        files = data.ShowerFiles(paths, *share)
        batch = args.batch_size
        showers_per_epoch_rank = len(files)
        if strategy.is_master:
            callbacks.append(keras.callbacks.CSVLogger(os.path.join(args.output, "log.csv"),
                                                       append=True))
        trainers = strategy.num_workers
    else:
        strategy = kdist.distribute.MPIStrategy() if strategy_name == "mpi" else None
        if strategy is not None:
            with strategy.scope():
                gan = build_gan(args, total_weights, mean_fractions)
                compile_gan(gan, args)
            files = data.ShowerFiles(paths)
            batch = args.batch_size * size
        else:
            gan = build_gan(args, total_weights, mean_fractions)
            compile_gan(gan, args, kdist.DistributedOptimizer if size > 1 else None)
            files = data.ShowerFiles(paths, rank, size)
            batch = args.batch_size
            if size > 1:
                callbacks.append(kdist.callbacks.BroadcastGlobalVariablesCallback(0))
        callbacks.append(kdist.callbacks.Checkpoint(checkpoints))
        if rank == 0:
            callbacks.append(keras.callbacks.CSVLogger(os.path.join(args.output, "log.csv"),
                                                       append=True))
        showers_per_epoch_rank = len(files) // (size if strategy is not None else 1)
        trainers = size

    # Every rank makes the same number of steps, or a collective would wait forever.
    steps = args.steps or kdist.allreduce(
        max(1, showers_per_epoch_rank // args.batch_size), op=kdist.Min, name="steps")
    steps = int(steps)
    fit_kwargs["steps_per_epoch"] = steps
    # Under MPIStrategy every rank must read the same global batches (the strategy
    # slices them); otherwise each rank shuffles its own share differently.
    dataset = shower_dataset(files, batch,
                             seed=args.seed if strategy_name == "mpi" else args.seed + rank)
    if rank == 0:
        print(f"Training the {'small' if args.small else 'full'} 3DGAN with {strategy_name} on "
              f"{size} process(es): {len(paths)} file(s), {steps} steps of "
              f"{args.batch_size} showers per trainer and epoch.", flush=True)
    history = gan.fit(dataset, epochs=args.epochs, callbacks=callbacks,
                      verbose=2 if rank == 0 else 0, shuffle=False, **fit_kwargs)
    elapsed = time.time() - start
    if rank == 0:
        data.replace_atomically(os.path.join(args.output, "generator.keras"),
                                gan.generator.save)
        data.replace_atomically(os.path.join(args.output, "gan.keras"), gan.save)
        epochs_run = len(history.history.get("d_loss", []))
        summary = {
            "strategy": strategy_name, "ranks": size, "small": args.small,
            "epochs": args.epochs, "epochs_run": epochs_run, "steps_per_epoch": steps,
            "batch_size": args.batch_size, "trainers": trainers, "wall_s": elapsed,
            "split_energy": args.split_energy, "total_energy_fit": total_fit,
            "showers_trained_per_s": epochs_run * steps * args.batch_size * trainers / elapsed,
            "history": {k: [float(v) for v in vs] for k, vs in history.history.items()},
        }
        def write_summary(path):
            with open(path, "w") as f:
                json.dump(summary, f, indent=1)

        data.replace_atomically(os.path.join(args.output, "train.json"), write_summary)
        print(f"Saved {os.path.join(args.output, 'generator.keras')} after {elapsed:.0f} s.",
              flush=True)


if __name__ == "__main__":
    main()
