"""Electromagnetic showers for the calorimeter GAN: a fast simulator and an HDF5 reader.

The simulator stands in for Geant4 so that the example runs without downloads.
It draws showers in a 25x25x25-cell sampling calorimeter (x, y, depth):

- a longitudinal profile shaped like a gamma distribution whose maximum
  deepens with log(E), with a per-shower spread of its shape;
- an exponential transverse fall-off around a slightly jittered axis,
  widening with depth;
- a sampling fraction with a stochastic resolution term;
- per-cell fluctuations: each cell holds a Poisson number of ionisation hits
  with exponentially distributed energies, so most cells far from the core
  stay empty.

Files are written in the layout of the public CLIC calorimeter files: a
dataset `ECAL` of shape (N, 25, 25, 25) in GeV and `energy` (N,), the primary
energy in GeV. `ShowerFiles` reads lists of such files (simulated or real),
gives each rank its own rows and streams them through tf.data.

    python data.py --output showers/ --files 4 --showers 1000
"""

import argparse
import math
import os

import numpy as np
from scipy import stats

CELLS = 25
SAMPLING_FRACTION = 0.02      # deposited / primary energy
CRITICAL_ENERGY = 0.0081      # GeV, tungsten
LAYER_X0 = 1.0                # layer thickness in radiation lengths
MOLIERE_CELLS = 1.8           # Moliere radius in cells
HIT_ENERGY = 2e-4             # GeV deposited per ionisation hit, on average
RESOLUTION = 0.15             # stochastic term, relative, per sqrt(GeV)


def shower_maximum(energy):
    """Depth of the shower maximum in radiation lengths (photon showers)."""
    return np.log(np.asarray(energy, float) / CRITICAL_ENERGY) - 0.5


def simulate(energies, seed=None, chunk=256):
    """Showers (N, 25, 25, 25) in GeV deposited, for primary `energies` in GeV."""
    energies = np.asarray(energies, float).reshape(-1)
    if energies.size and energies.min() <= 0:
        raise ValueError("Primary energies must be positive (GeV).")
    rng = np.random.default_rng(seed)
    out = np.empty((energies.size, CELLS, CELLS, CELLS), np.float32)
    for start in range(0, energies.size, chunk):
        out[start:start + chunk] = _simulate_chunk(energies[start:start + chunk], rng)
    return out


def _simulate_chunk(energies, rng):
    n = energies.size
    # Longitudinal: dE/dt ~ t^(a-1) exp(-b t), maximum at (a - 1) / b.
    b = 0.5 * np.exp(rng.normal(0.0, 0.05, n))
    a = 1.0 + b * shower_maximum(energies) * np.exp(rng.normal(0.0, 0.04, n))
    edges = np.arange(CELLS + 1) * LAYER_X0
    cdf = stats.gamma.cdf(edges[None, :] * b[:, None], a[:, None])
    longitudinal = np.diff(cdf, axis=1)                                # (n, depth)
    # Transverse: exp(-r / width) around an axis jittered by a fraction of a cell.
    centre = (CELLS - 1) / 2 + rng.normal(0.0, 0.3, (n, 2))
    depth = np.arange(CELLS) + 0.5
    width = 0.45 * MOLIERE_CELLS * (0.6 + depth / CELLS)               # (depth,)
    coords = np.arange(CELLS)
    dx = coords[None, :] - centre[:, 0:1]                              # (n, x)
    dy = coords[None, :] - centre[:, 1:2]                              # (n, y)
    r = np.sqrt(dx[:, :, None] ** 2 + dy[:, None, :] ** 2)             # (n, x, y)
    transverse = np.exp(-r[..., None] / width)                         # (n, x, y, depth)
    transverse /= 2 * math.pi * width ** 2                             # per unit area
    deposited = energies * SAMPLING_FRACTION * (
        1 + rng.normal(0.0, 1.0, n) * RESOLUTION / np.sqrt(energies))
    mean = deposited[:, None, None, None] * transverse * longitudinal[:, None, None, :]
    hits = rng.poisson(mean / HIT_ENERGY)
    return rng.gamma(hits, HIT_ENERGY).astype(np.float32)


def write_file(path, energies, seed=None):
    """Simulates showers for `energies` and writes them to `path` (HDF5), atomically."""
    import h5py

    showers = simulate(energies, seed=seed)
    partial = f"{path}.partial"
    with h5py.File(partial, "w") as f:
        f.create_dataset("ECAL", data=showers, chunks=(min(64, len(showers)) or 1,) + (CELLS,) * 3,
                         compression="gzip", compression_opts=1)
        f.create_dataset("energy", data=np.asarray(energies, np.float32).reshape(-1))
    os.replace(partial, path)
    return path


def replace_atomically(path, write):
    """Calls `write(partial_path)`, then moves the result to `path` in one step.

    An interrupted run leaves the previous file (or none), never half of one.
    The partial name keeps `path`'s extension, which Keras's `save` checks.
    """
    directory, name = os.path.split(path)
    partial = os.path.join(directory, f".partial-{name}")
    try:
        write(partial)
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return path


def is_simulated(path):
    """Whether `path` is named like a file `make_dataset` writes."""
    name = os.path.basename(path)
    return name.startswith("showers_") and name[8:-3].isdigit() and name.endswith(".h5")


def make_dataset(directory, files=2, showers=500, energy_range=(10.0, 500.0), seed=0):
    """Writes `files` HDF5 files of `showers` each with uniform primary energies; returns paths.

    Existing files are kept, so a rerun does not simulate again.
    """
    os.makedirs(directory, exist_ok=True)
    low, high = energy_range
    if not 0 < low <= high:
        raise ValueError(f"energy_range must be 0 < low <= high GeV; got {energy_range}.")
    paths = []
    for index in range(files):
        path = os.path.join(directory, f"showers_{index:03d}.h5")
        if not os.path.exists(path):
            rng = np.random.default_rng((seed, index))
            write_file(path, rng.uniform(low, high, showers), seed=(seed, index, 1))
        paths.append(path)
    return paths


class ShowerFiles:
    """Rows of a list of calorimeter HDF5 files (`ECAL`, `energy`), shared out by rank.

    Each rank reads a contiguous part of every file, so that ranks never read
    the same shower, all see the whole energy range, and their row counts
    differ by at most one per few files.

    Args:
        paths: HDF5 files with `ECAL` (N, 25, 25, 25) and `energy` (N,) or (N, 1).
        rank, size: this reader's share of the rows.
    """

    def __init__(self, paths, rank=0, size=1):
        import h5py

        if isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        self.paths = [os.fspath(p) for p in paths]
        if not self.paths:
            raise ValueError("No shower files given.")
        if not 0 <= rank < size:
            raise ValueError(f"rank must be in [0, size); got rank {rank} of {size}.")
        self.parts = []
        for index, path in enumerate(self.paths):
            with h5py.File(path, "r") as f:
                for key in ("ECAL", "energy"):
                    if key not in f:
                        raise ValueError(f"{path} has no dataset {key!r}; a shower file holds "
                                         "ECAL (N, 25, 25, 25) and energy (N,).")
                rows = f["ECAL"].shape[0]
                if f["energy"].shape[0] != rows:
                    raise ValueError(f"{path}: {rows} showers but {f['energy'].shape[0]} "
                                     "energies.")
            # Rotating the parts over files spreads the larger ones over the ranks.
            bounds = np.linspace(0, rows, size + 1).astype(int)
            part = (rank + index) % size
            self.parts.append((path, bounds[part], bounds[part + 1]))

    def __len__(self):
        return sum(stop - start for _, start, stop in self.parts)

    def read(self, limit=None):
        """(showers, energies) of this rank's rows, as numpy arrays."""
        showers, energies = [], []
        for chunk in self._chunks(limit):
            showers.append(chunk[0])
            energies.append(chunk[1])
        if not showers:
            return (np.zeros((0,) + (CELLS,) * 3, np.float32), np.zeros((0,), np.float32))
        return np.concatenate(showers), np.concatenate(energies)

    def statistics(self):
        """(energies, deposited totals in GeV, mean cell fractions) of this rank's rows,
        in one pass over the files: each shower's total, and the mean over the showers
        of each cell's fraction of its shower's energy, (cells, cells, cells)."""
        energies, totals, summed = [], [], np.zeros((CELLS,) * 3)
        for showers, chunk_energies in self._chunks():
            chunk_totals = showers.sum(axis=(1, 2, 3), dtype=np.float64)
            energies.append(chunk_energies)
            totals.append(chunk_totals)
            summed += (showers / np.maximum(chunk_totals, 1e-12)[:, None, None, None]).sum(axis=0)
        if not energies:
            raise ValueError("No showers to read.")
        totals = np.concatenate(totals)
        return np.concatenate(energies), totals, summed / len(totals)

    def totals(self):
        """(energies, deposited totals) of this rank's rows in GeV, as numpy arrays."""
        return self.statistics()[:2]

    def mean_fractions(self):
        """The mean over this rank's showers of each cell's fraction of the shower's energy."""
        return self.statistics()[2]

    def _chunks(self, limit=None, chunk=128):
        import h5py

        left = len(self) if limit is None else min(limit, len(self))
        for path, start, stop in self.parts:
            with h5py.File(path, "r") as f:
                for begin in range(start, stop, chunk):
                    if left <= 0:
                        return
                    end = min(stop, begin + chunk, begin + left)
                    left -= end - begin
                    yield (np.asarray(f["ECAL"][begin:end], np.float32),
                           np.asarray(f["energy"][begin:end], np.float32).reshape(-1))

    def dataset(self, transform=None, limit=None):
        """A tf.data.Dataset of single showers, read as it is iterated.

        `transform(showers, energies)` maps a chunk of numpy arrays to what
        the dataset yields (a dict of arrays with one row per shower).
        """
        import tensorflow as tf

        transform = transform or (lambda s, e: {"ECAL": s, "energy": e})
        first = transform(*next(self._chunks(limit=1)))
        signature = {k: tf.TensorSpec((None,) + np.shape(v)[1:], tf.as_dtype(np.asarray(v).dtype))
                     for k, v in first.items()}

        def generate():
            for showers, energies in self._chunks(limit):
                yield transform(showers, energies)

        chunks = tf.data.Dataset.from_generator(generate, output_signature=signature)
        return chunks.unbatch().apply(tf.data.experimental.assert_cardinality(
            min(len(self), limit) if limit is not None else len(self)))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", required=True, help="directory for the HDF5 files")
    parser.add_argument("--files", type=int, default=2)
    parser.add_argument("--showers", type=int, default=500, help="showers per file")
    parser.add_argument("--min-energy", type=float, default=10.0, help="GeV")
    parser.add_argument("--max-energy", type=float, default=500.0, help="GeV")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    paths = make_dataset(args.output, args.files, args.showers,
                         (args.min_energy, args.max_energy), args.seed)
    print("\n".join(paths))


if __name__ == "__main__":
    main()
