"""How fast the parameter-server master applies updates, against the bounds of memory speed.

    kdist run -n 2 --no-prefix python benchmarks/ps_throughput.py   # 1 master, 1 worker
    kdist run -n 5 --no-prefix python benchmarks/ps_throughput.py   # 1 master, 4 workers

Rank 0 serves; the other ranks are workers that send updates as fast as the
master answers (no training, so only the master's path is measured). For
each model size (default 1M and 10M float32 parameters), transport (shared
memory, `kdist.ps.shared`, and plain messages) and mode, the master reports
updates per second of wall-clock time and per second of its own CPU time,
and the staleness histogram. Bounds measured in the same run:

- `add`: an in-place numpy add of the model (`center += update`), the
  least work an update can cost;
- `cold add`: `np.add(a, b, out=c)` cycling through as many buffers as the
  master keeps, so that they come from memory, not cache (two 1M-parameter
  arrays fit in a large L3 cache);
- `copy`: `np.copyto` of the model, the machine's copy bandwidth in models
  per second; a message costs at least one copy on each side.

Each rate is reported as a fraction of each bound. With one worker the
worker waits for every reply, so the wall-clock rate is the round trip; with
several, ranks share cores on a small machine and the rate per CPU second is
the master's own cost. Targets: 0.5 of the add bound for Downpour and EASGD,
0.3 for GEM. Prints one JSON object on rank 0.
"""

import argparse
import json
import time

import numpy as np

import kdist
from kdist.ps import messages, rules
from kdist.ps.hierarchy import shard_bounds
from kdist.ps.exchange import ServerExchange
from kdist.ps.server import Server
from kdist.ps.shared import SharedSlots

TARGETS = {"downpour": 0.5, "easgd": 0.5, "gem": 0.3}


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


def copy_rate(size, repeats=30):
    """Model-sized copies per second (median of repeats), from memory."""
    arrays = [np.full(size, 1e-6, dtype=np.float32) for _ in range(4)]
    samples = []
    for i in range(repeats):
        started = time.perf_counter()
        np.copyto(arrays[(i + 1) % 4], arrays[i % 4])
        samples.append(time.perf_counter() - started)
    return 1.0 / float(np.median(samples))


def serve(comm, size, mode, slots, servers):
    """Rank `comm.rank` (< servers) serves its shard; returns its figures."""
    start, stop = shard_bounds(size, servers)[comm.rank]
    rule = rules.make(mode, stop - start)
    center = np.zeros(stop - start, dtype=np.float32)
    server = Server(comm, list(range(servers, comm.size)), center, stop - start, rule,
                    slots=slots, offset=start, receives_logs=comm.rank == 0)
    comm.barrier()
    started = time.perf_counter()
    server.run()
    return dict(server.stats(), seconds=time.perf_counter() - started)


def combine(shards):
    """One case's figures from every server's: the slowest shard sets the pace."""
    updates = shards[0]["updates"]
    seconds = max(s["seconds"] for s in shards)
    cpu = max(s["cpu_seconds"] for s in shards)
    return {"updates": updates, "seconds": seconds,
            "updates_per_second": updates / seconds,
            "server_cpu_seconds": [s["cpu_seconds"] for s in shards],
            "updates_per_cpu_second": updates / max(cpu, 1e-9),
            "server_utilisation": [s["utilisation"] for s in shards],
            "shared_children": shards[0]["shared_children"],
            "staleness_mean": shards[0]["staleness_mean"],
            "staleness_histogram": shards[0]["staleness_histogram"]}


def work(comm, size, updates, slots, servers):
    link = ServerExchange(comm, list(range(servers)), size, slots)
    # The rules only read what a worker sends, so one update serves every
    # exchange and the worker does nothing but wait for the servers.
    link.message.body.fill(1e-6)
    comm.barrier()
    for _ in range(updates):
        link.exchange(messages.EXCHANGE)
    link.exchange(messages.DONE)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="1000000,10000000")
    parser.add_argument("--modes", default="downpour,easgd,gem")
    parser.add_argument("--transports", default="shared,messages")
    parser.add_argument("--servers", type=int, default=1,
                        help="ranks that each hold one shard of the centre")
    parser.add_argument("--seconds", type=float, default=3.0,
                        help="about how long each case runs")
    args = parser.parse_args()
    kdist.init()
    comm = kdist.comm.world()
    servers = args.servers
    if comm.size < servers + 1:
        raise SystemExit(f"Run on at least {servers + 1} ranks: kdist run -n {servers + 1} "
                         f"python benchmarks/ps_throughput.py --servers {servers}")
    workers = comm.size - servers
    results = {"servers": servers, "workers": workers, "cases": [],
               "target_fraction_of_add": TARGETS}
    servers_of = {rank: list(range(servers)) for rank in range(servers, comm.size)}
    for size in [int(s) for s in args.sizes.split(",")]:
        bounds = comm.bcast_object({
            "add": add_rate(size), "cold_add": cold_add_rate(size, 2 * workers + 1),
            "copy": copy_rate(size)} if comm.rank == 0 else None)
        # Enough updates for about `seconds` at a quarter of the bound.
        per_worker = max(5, int(args.seconds * bounds["add"] / 4 / workers))
        for transport in args.transports.split(","):
            slots = SharedSlots(comm, servers_of, size) if transport == "shared" else None
            for mode in args.modes.split(","):
                if comm.rank < servers:
                    shard = serve(comm, size, mode, slots, servers)
                else:
                    work(comm, size, per_worker, slots, servers)
                    shard = None
                shards = comm.allgather_object(shard)
                if comm.rank == 0:
                    case = combine(shards[:servers])
                    case.update({"parameters": size, "mode": mode, "transport": transport,
                                 "bounds_updates_per_second": bounds})
                    for rate in ("updates_per_second", "updates_per_cpu_second"):
                        case[f"{rate}_fraction_of"] = {name: case[rate] / value
                                                       for name, value in bounds.items()}
                    results["cases"].append(case)
                comm.barrier()
            if slots is not None:
                slots.free()
    if comm.rank == 0:
        print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
