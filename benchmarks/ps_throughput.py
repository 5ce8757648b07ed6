"""How fast the parameter-server master applies updates, against the bound of memory speed.

    kdist run -n 5 --no-prefix benchmarks/ps_throughput.py

Rank 0 serves; the other ranks are workers that send updates as fast as the
master answers (no training, so only the master's path is measured). For
each model size (default 1M and 10M float32 parameters) and mode, the master
reports updates applied per second, and the bound measured in the same run:
the rate of an in-place numpy add of the same size (`center += update`), the
least work an update can cost. `fraction_of_bound` = rate / bound; target >= 0.5.
Since two 1M-parameter arrays fit in a large L3 cache, the same add cycling
through as many buffers as the master keeps is reported too (`cold_bound`).
Prints one JSON object on rank 0.
"""

import argparse
import json
import time

import numpy as np

import kdist
from kdist.ps import protocol, rules
from kdist.ps.link import Link
from kdist.ps.server import Server


def add_rate(size, repeats=30):
    """In-place adds per second for `size` float32 values (median of repeats)."""
    center = np.random.default_rng(0).normal(size=size).astype(np.float32)
    update = np.full(size, 1e-6, dtype=np.float32)
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        center += update
        samples.append(time.perf_counter() - started)
    return 1.0 / float(np.median(samples))


def cold_add_rate(size, buffers, repeats=30):
    """The same add, cycling through as many buffers as the master keeps (one
    incoming and one reply per worker), so that they come from memory, not cache."""
    arrays = [np.full(size, 1e-6, dtype=np.float32) for _ in range(buffers)]
    samples = []
    for i in range(repeats):
        a, b, out = arrays[i % buffers], arrays[(i + 1) % buffers], arrays[(i + 2) % buffers]
        started = time.perf_counter()
        np.add(a, b, out=out)
        samples.append(time.perf_counter() - started)
    return 1.0 / float(np.median(samples))


def serve(comm, size, mode, updates_per_worker):
    rule = rules.make(mode, size)
    center = np.zeros(size, dtype=np.float32)
    server = Server(comm, list(range(1, comm.size)), center, size, rule)
    comm.barrier()
    started = time.perf_counter()
    server.run()
    elapsed = time.perf_counter() - started
    stats = server.stats()
    return {"updates": stats["updates"], "seconds": elapsed,
            "updates_per_second": stats["updates"] / elapsed,
            "master_utilisation": stats["utilisation"],
            "staleness_mean": stats["staleness_mean"]}


def work(comm, size, updates):
    link = Link(comm, 0, size)
    link.message.body[:] = 1e-6
    comm.barrier()
    for _ in range(updates):
        link.exchange(protocol.EXCHANGE)
    link.exchange(protocol.DONE)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="1000000,10000000")
    parser.add_argument("--modes", default="downpour,easgd,gem")
    parser.add_argument("--seconds", type=float, default=3.0,
                        help="about how long each case runs")
    args = parser.parse_args()
    kdist.init()
    comm = kdist.comm.world()
    if comm.size < 2:
        raise SystemExit("Run on at least 2 ranks: kdist run -n 5 benchmarks/ps_throughput.py")
    results = {"workers": comm.size - 1, "cases": []}
    for size in [int(s) for s in args.sizes.split(",")]:
        bound = comm.bcast_object(add_rate(size) if comm.rank == 0 else None)
        cold = comm.bcast_object(cold_add_rate(size, 2 * (comm.size - 1) + 1)
                                 if comm.rank == 0 else None)
        # Enough updates for about `seconds` at a quarter of the bound.
        per_worker = max(5, int(args.seconds * bound / 4 / (comm.size - 1)))
        for mode in args.modes.split(","):
            if comm.rank == 0:
                case = serve(comm, size, mode, per_worker)
                case.update({"parameters": size, "mode": mode,
                             "bound_updates_per_second": bound,
                             "fraction_of_bound": case["updates_per_second"] / bound,
                             "cold_bound_updates_per_second": cold,
                             "fraction_of_cold_bound": case["updates_per_second"] / cold})
                results["cases"].append(case)
            else:
                work(comm, size, per_worker)
            comm.barrier()
    if comm.rank == 0:
        results["target_fraction"] = 0.5
        print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
