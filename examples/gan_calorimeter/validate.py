"""Compares showers from a trained generator with simulated (or real) ones.

    python validate.py --input run/ --output run/validation/ [--quick]

Reads INPUT/generator.keras, draws showers for the primary energies of a
reference sample (fresh simulated showers, or `--data` HDF5 files), and
writes to OUTPUT:

- longitudinal.png: mean energy per layer along the depth;
- transverse.png: mean energy per cell along x;
- total_energy.png: deposited energy against primary energy;
- cell_spectrum.png: distribution of cell energies;
- showers.png: a real and a generated shower side by side (x-depth view);
- metrics.json: per-layer relative difference of the mean longitudinal
  profile, ratio of mean total energies, and the Wasserstein distance between
  the log10 cell-energy spectra (with the fraction of empty cells of each);
- evaluation.json, evaluation.md and feature_*.png: the calorimeter metrics
  of `evaluation.py` (separation powers, chi-squared, classifier AUCs, FPD and
  KPD, energy response and resolution per energy bin, sparsity, generation
  time), each beside its floor, a second reference sample of the same size
  and energies, and the targets the training recipe aims at.
"""

import argparse
import glob
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import data  # noqa: E402
import evaluation  # noqa: E402
import model as gan_model  # noqa: E402

# Cells below this (GeV) count as empty: well under one ionisation hit.
EMPTY_BELOW = 1e-5


def generate(generator, energies, seed=0, batch_size=64):
    """Generated showers in GeV, (N, 25, 25, 25), for primary `energies` in GeV."""
    rng = np.random.default_rng(seed)
    latent = rng.normal(size=(len(energies), generator.inputs[0].shape[-1])).astype("float32")
    condition = (np.asarray(energies, "float32") / gan_model.ENERGY_SCALE).reshape(-1, 1)
    showers = generator.predict([latent, condition], batch_size=batch_size, verbose=0)
    return showers[..., 0] / gan_model.CELL_SCALE


def longitudinal(showers):
    return showers.sum(axis=(1, 2))


def transverse(showers):
    return showers.sum(axis=(2, 3))


def metrics(real, fake):
    """Agreement of generated with reference showers (both in GeV)."""
    from scipy import stats

    real_profile, fake_profile = longitudinal(real).mean(0), longitudinal(fake).mean(0)
    per_layer = np.abs(fake_profile - real_profile) / np.maximum(real_profile, 1e-12)
    # Layers holding at least 1% of the mean shower carry the comparison.
    core = real_profile >= 0.01 * real_profile.sum()
    real_cells, fake_cells = real[real > EMPTY_BELOW], fake[fake > EMPTY_BELOW]
    distance = (float(stats.wasserstein_distance(np.log10(real_cells), np.log10(fake_cells)))
                if real_cells.size and fake_cells.size else float("inf"))
    return {
        "showers": int(len(real)),
        "longitudinal_relative_difference": [float(v) for v in per_layer],
        "longitudinal_mean_relative_difference": float(per_layer[core].mean()),
        "total_energy_ratio": float(fake.sum(axis=(1, 2, 3)).mean()
                                    / real.sum(axis=(1, 2, 3)).mean()),
        "cell_spectrum_wasserstein_log10": distance,
        "empty_cell_fraction_real": float((real <= EMPTY_BELOW).mean()),
        "empty_cell_fraction_generated": float((fake <= EMPTY_BELOW).mean()),
        "shower_maximum_layer_real": int(np.argmax(real_profile)),
        "shower_maximum_layer_generated": int(np.argmax(fake_profile)),
    }


def plot(real, fake, energies, output):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def figure(name, draw, xlabel, ylabel, log=False):
        fig, ax = plt.subplots(figsize=(5, 4))
        draw(ax)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        if log:
            ax.set_yscale("log")
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(output, name), dpi=90)
        plt.close(fig)

    layers = np.arange(data.CELLS)
    figure("longitudinal.png",
           lambda ax: [ax.plot(layers, longitudinal(s).mean(0), label=label, drawstyle="steps-mid")
                       for s, label in ((real, "reference"), (fake, "generated"))],
           "layer (depth)", "mean energy (GeV)")
    figure("transverse.png",
           lambda ax: [ax.plot(layers, transverse(s).mean(0), label=label, drawstyle="steps-mid")
                       for s, label in ((real, "reference"), (fake, "generated"))],
           "cell along x", "mean energy (GeV)", log=True)
    figure("total_energy.png",
           lambda ax: [ax.scatter(energies, s.sum(axis=(1, 2, 3)), s=6, label=label, alpha=0.6)
                       for s, label in ((real, "reference"), (fake, "generated"))],
           "primary energy (GeV)", "deposited energy (GeV)")
    bins = np.logspace(np.log10(EMPTY_BELOW), 0, 60)
    figure("cell_spectrum.png",
           lambda ax: ([ax.hist(s[s > EMPTY_BELOW], bins=bins, histtype="step", label=label)
                        for s, label in ((real, "reference"), (fake, "generated"))],
                       ax.set_xscale("log")),
           "cell energy (GeV)", "cells", log=True)
    fig, axes = plt.subplots(1, 2, figsize=(8, 4))
    for ax, s, label in zip(axes, (real[0], fake[0]), ("reference", "generated")):
        ax.imshow(s.sum(axis=1).T, origin="lower", cmap="viridis")
        ax.set_title(f"{label}, {energies[0]:.0f} GeV")
        ax.set_xlabel("x")
        ax.set_ylabel("depth")
    fig.tight_layout()
    fig.savefig(os.path.join(output, "showers.png"), dpi=90)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", required=True, help="train.py's output directory")
    parser.add_argument("--output", required=True)
    parser.add_argument("--data", help="reference HDF5 files (default: fresh simulated showers)")
    parser.add_argument("--showers", type=int, default=2000)
    parser.add_argument("--quick", action="store_true", help="300 showers")
    parser.add_argument("--seed", type=int, default=12345)
    args = parser.parse_args(argv)
    if args.quick:
        args.showers = min(args.showers, 300)
    path = os.path.join(args.input, "generator.keras")
    if not os.path.exists(path):
        raise SystemExit(f"No generator at {path}; run train.py --output {args.input} first.")
    import keras

    generator = keras.models.load_model(path)
    # The floor: a second, independent reference sample, as a perfect generator
    # would give: the next showers of the same files, or a second simulation
    # for the same energies.
    simulation_seconds = second_energies = None
    if args.data:
        files = sorted(glob.glob(os.path.join(args.data, "*.h5")))
        both, all_energies = data.ShowerFiles(files).read(limit=2 * args.showers)
        half = len(both) // 2
        if half < 10:
            raise SystemExit(f"{args.data} holds {len(both)} showers; the report needs at "
                             "least 20 (half of them for the floor).")
        real, second = both[:half], both[half:2 * half]
        energies, second_energies = all_energies[:half], all_energies[half:2 * half]
    else:
        energies = np.random.default_rng(args.seed).uniform(10.0, 500.0, args.showers)
        started = time.perf_counter()
        real = data.simulate(energies, seed=args.seed)
        simulation_seconds = (time.perf_counter() - started) / len(energies)
        second = data.simulate(energies, seed=args.seed + 1)
    generate(generator, energies[:64], seed=args.seed)  # the first call builds the graph
    started = time.perf_counter()
    fake = generate(generator, energies, seed=args.seed)
    generation_seconds = (time.perf_counter() - started) / len(energies)
    os.makedirs(args.output, exist_ok=True)
    result = metrics(real, fake)
    def write_metrics(path):
        with open(path, "w") as f:
            json.dump(result, f, indent=1)

    data.replace_atomically(os.path.join(args.output, "metrics.json"), write_metrics)
    plot(real, fake, np.asarray(energies), args.output)
    report = evaluation.evaluate(real, second, fake, energies, seed=args.seed,
                                 generation_seconds_per_shower=generation_seconds,
                                 simulation_seconds_per_shower=simulation_seconds,
                                 second_energies=second_energies)
    evaluation.write_report(report, args.output)
    evaluation.plot(real, second, fake, energies, args.output, second_energies)
    print(json.dumps({k: v for k, v in result.items() if k != "longitudinal_relative_difference"},
                     indent=1))
    print(evaluation.markdown(report), flush=True)


if __name__ == "__main__":
    main()
