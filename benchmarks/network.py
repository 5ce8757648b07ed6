"""Data-parallel steps over an emulated network: two hosts and a link of a chosen rate.

    python benchmarks/network.py [--rates 1,5,25,0] [--model mlp|conv] [--width 512]
        [--depth 2] [--batch 64] [--bursts 1ms,1mbit]
        [--bucket-mb 4] [--rounds 3] [--steps 20] [--launches 1]

Needs root and `tc` (network namespaces: tests/emulated_hosts.py). For each link rate in
Gbit/s (0: no limit) it makes two hosts as network namespaces joined by a bridge, with
link-local addresses and no route out, limits what each host sends with tc's token
bucket filter (`tbf`), and runs benchmarks/overlap.py with one rank per host, started
from the first host through Open MPI's remote-shell agent as on a cluster. Both hosts
share this machine's cores, so each rank is pinned to a core of its own.

`--bursts` sets the token bucket: a time at the rate (1 ms by default) or a size as tc
reads it (`1mbit`, a smaller bucket at high rates); each rate runs with each burst.

Per rate and burst it prints one JSON object, the medians of overlap.py's rounds: one
process's compute (`plain`; the slower rank's, which a synchronous step waits for) and
its forward pass alone (the rest is the backward pass and update), the raw allreduce of
the gradient's bytes over the same link, their sum, the overlap ideal max(compute,
allreduce) and forward + max(backward, allreduce), and kdist's step with every bucket
waiting for the backward pass (`serial`) and with buckets reduced as they are ready
(`overlap`), with the fraction of the communication that overlap hides. The goals are
serial within 1.05x of compute + allreduce and overlap within 1.15x of forward +
max(backward, allreduce); the last object (`"benchmark": "network_goals"`) gives, per
rate and burst, both ratios (medians over launches) and by how much each misses. The
cost model (kdist.distribute.cost_model) is fitted to raw allreduces of
64 KiB to 16 MiB over the same link, and its predictions of the gradient's allreduce and
of kdist's steps (overlap 0 and 0.5) stand beside the measurements. The unlimited link,
when asked for, runs first: its fitted rate is the hosts' own copying rate, above which a
transfer needs the core and cannot hide (`copy_rate` in the model), and what kdist's
serial step takes there beyond compute and transfers, per bucket, is its own work per
bucket (`per_bucket`), which no link hides.

With `--launches N` (N > 1) each rate is launched N times over fresh hosts, and after the
N objects one more (`"benchmark": "network_stability"`) gives each launch's median steps
and the slowest over the fastest launch for kdist, one process's compute and the raw
allreduce: how far a launch's step time can be trusted.
"""

import argparse
import json
import math
import os
import re
import statistics
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))


def run_case(gbit, overlap_args, timeout, burst=None):
    import emulated_hosts

    with emulated_hosts.EmulatedHosts(2) as hosts:
        for index in range(2):
            hosts.limit_link(index, gbit, burst=burst)
        # kdist's own settings (KDIST_RING, bucket sizes, waits) reach both hosts.
        forward = sorted(name for name in os.environ if name.startswith("KDIST_"))
        done = hosts.run_job(1, [sys.executable, "-u", os.path.join(HERE, "overlap.py")]
                             + list(overlap_args), forward=forward, timeout=timeout,
                             env={"TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONUNBUFFERED": "1"})
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"the {gbit} Gbit/s case failed:\n{(done.stdout + done.stderr)[-3000:]}")
    return json.loads(lines[-1])


def fitted_link(result):
    from kdist.distribute import cost_model

    sizes, times = zip(*result["probe"])
    return cost_model.fit_link(sizes, [t / 1e3 for t in times], result["ranks"])


def predict(result, link, bucket_bytes, compute_ms, copy_rate, per_bucket=0.0):
    """The cost model's figures for the `link` fitted from the probe's raw allreduces:
    the gradient's raw allreduce and kdist's steps predicted from one process's compute."""
    from kdist.distribute import cost_model

    compute = compute_ms / 1e3
    grads = result["gradient_megabytes"] * 1e6

    def step(overlap):
        return cost_model.data_parallel_step(compute, grads, result["ranks"], link,
                                             bucket_bytes=bucket_bytes, overlap=overlap,
                                             copy_rate=copy_rate, per_bucket=per_bucket)

    return {"fitted_latency_us": round(link.latency * 1e6, 1),
            "fitted_gbit": round(link.bandwidth * 8 / 1e9, 3),
            "predicted_raw_allreduce_ms": round(
                cost_model.allreduce_time(grads, result["ranks"], link) * 1e3, 3),
            "predicted_serial_ms": round(step(0.0) * 1e3, 3),
            "predicted_overlap_ms": round(step(0.5) * 1e3, 3),
            "per_bucket_ms": round(per_bucket * 1e3, 3)}


def burst_bytes(burst, gbit):
    """tc's bucket for `burst`: a time at the rate ("1ms", "200us") in bytes, at least
    64 KiB, or a size tc reads itself ("1mbit", "125kb") as it is; None: the default."""
    if burst is None or not gbit:
        return None
    for unit, seconds in (("ms", 1e-3), ("us", 1e-6)):
        if burst.endswith(unit):
            return max(int(float(burst[:-len(unit)]) * seconds * gbit * 1e9 / 8), 64 * 1024)
    return burst


def summarize(gbit, result, link, bucket_bytes, copy_rate, per_bucket=0.0, burst="1ms"):
    m = result["median"]
    # A synchronous step waits for the slowest rank's compute; the hosts' cores differ.
    compute, allreduce = max(result["plain_ms_per_rank"]), m["raw_allreduce_ms"]
    forward = max(result["forward_ms_per_rank"])
    ideal = max(compute, allreduce)
    # What overlap can reach: the forward pass, then the backward pass and the transfer
    # side by side.
    overlap_goal = forward + max(compute - forward, allreduce)
    model = predict(result, link, bucket_bytes, compute, copy_rate, per_bucket)
    communication = m["serial_ms"] - compute
    return {
        "benchmark": "network",
        "link_gbit": gbit or "unlimited",
        "burst": burst if gbit else None,
        "model": result["model"],
        "gradient_megabytes": result["gradient_megabytes"],
        "buckets": result["buckets"],
        "compute_ms": compute,
        "compute_ms_per_rank": result["plain_ms_per_rank"],
        "raw_allreduce_ms": allreduce,
        "forward_ms": forward,
        "backward_ms": round(compute - forward, 3),
        "compute_plus_allreduce_ms": round(compute + allreduce, 3),
        "overlap_ideal_ms": round(ideal, 3),
        "forward_plus_max_ms": round(overlap_goal, 3),
        "serial_over_compute_plus_allreduce": round(m["serial_ms"] / (compute + allreduce), 3),
        "overlap_over_forward_plus_max": round(m["overlap_ms"] / overlap_goal, 3),
        "kdist_serial_ms": m["serial_ms"],
        "kdist_overlap_ms": m["overlap_ms"],
        "hidden_fraction": round((m["serial_ms"] - m["overlap_ms"]) / communication, 3)
        if communication > 0 else None,
        "kdist_over_ideal": round(m["overlap_ms"] / ideal, 3) if ideal > 0 else None,
        "kdist_over_compute_plus_allreduce": round(m["overlap_ms"] / (compute + allreduce), 3),
        **model,
        "overlap_over_predicted": round(m["overlap_ms"] / model["predicted_overlap_ms"], 3),
        "serial_over_predicted": round(m["serial_ms"] / model["predicted_serial_ms"], 3),
        "rounds": result["rounds"],
        "probe_bytes_ms": result["probe"],
    }


def stability(gbit, launches):
    """The spread between launches of one case: each launch's median steps, and the
    slowest over the fastest for kdist's overlapped step, one process's compute and the
    raw allreduce (a spread kdist shares with the raw allreduce is the link's, not kdist's)."""
    def spread(key):
        values = [summary[key] for summary in launches]
        return {f"{key}_per_launch": values,
                f"{key}_slowest_over_fastest": round(max(values) / min(values), 3)}

    return {"benchmark": "network_stability", "link_gbit": gbit or "unlimited",
            "burst": launches[0]["burst"],
            "model": launches[0]["model"], "launches": len(launches),
            **spread("kdist_overlap_ms"), **spread("kdist_serial_ms"),
            **spread("compute_ms"), **spread("raw_allreduce_ms")}


SERIAL_GOAL = 1.05  # kdist's serial step over compute + the raw allreduce
OVERLAP_GOAL = 1.15  # its overlapping step over forward + max(backward, raw allreduce)


def goals(summaries):
    """Per link and burst, the medians over launches of kdist's steps against their goals,
    and by how much each misses (0 where it is met)."""
    cells = {}
    for summary in summaries:
        cells.setdefault((summary["link_gbit"], summary["burst"]), []).append(summary)
    rows = []
    for (gbit, burst), launches in cells.items():
        serial = statistics.median(s["serial_over_compute_plus_allreduce"] for s in launches)
        overlap = statistics.median(s["overlap_over_forward_plus_max"] for s in launches)
        rows.append({"link_gbit": gbit, "burst": burst, "launches": len(launches),
                     "serial_over_compute_plus_allreduce": round(serial, 3),
                     "serial_misses_by": round(max(0.0, serial / SERIAL_GOAL - 1), 3),
                     "overlap_over_forward_plus_max": round(overlap, 3),
                     "overlap_misses_by": round(max(0.0, overlap / OVERLAP_GOAL - 1), 3)})
    return {"benchmark": "network_goals", "model": summaries[0]["model"],
            "serial_goal": SERIAL_GOAL, "overlap_goal": OVERLAP_GOAL, "cells": rows}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="1,5,25,0",
                        help="link rates in Gbit/s, comma-separated; 0 means no limit")
    parser.add_argument("--model", choices=("mlp", "conv"), default="mlp")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--bucket-mb", type=float, default=4.0,
                        help="most MiB per bucket; 0: kdist's default between hosts")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--bursts", default="1ms",
                        help="tbf buckets, comma-separated: a time at the rate (1ms, 200us) "
                             "or a size as tc reads it (1mbit, 125kb); default 1ms")
    parser.add_argument("--launches", type=int, default=1,
                        help="launches per rate; above 1 adds the launch-to-launch spread")
    args = parser.parse_args()
    if args.launches < 1:
        parser.error(f"--launches must be at least 1; got {args.launches}")
    try:
        rates = [float(r) for r in args.rates.split(",")]
    except ValueError:
        parser.error(f"--rates takes numbers separated by commas; got {args.rates!r}")
    if any(r < 0 for r in rates):
        parser.error("--rates must not be negative")
    bursts = [b.strip() for b in args.bursts.split(",") if b.strip()]
    size = re.compile(r"^\d+(\.\d+)?(ms|us|b|kb|mb|kbit|mbit|gbit)?$", re.IGNORECASE)
    if not bursts or not all(size.match(b) for b in bursts):
        parser.error(f"--bursts takes times (1ms, 200us) or tc sizes (1mbit, 125kb) "
                     f"separated by commas; got {args.bursts!r}")
    import emulated_hosts

    from kdist.comm import fusion

    why_not = emulated_hosts.available() or (
        None if shutil.which("tc") else "limiting a link needs the `tc` command (iproute2)")
    if why_not:
        sys.exit(f"benchmarks/network.py: {why_not}")
    overlap_args = ["--model", args.model, "--width", str(args.width), "--depth",
                    str(args.depth), "--batch", str(args.batch), "--bucket-mb",
                    str(args.bucket_mb), "--rounds", str(args.rounds), "--steps",
                    str(args.steps), "--inter-op-threads", "2", "--probe"]
    # The unlimited link first: its fitted rate is the hosts' own copying rate, which the
    # cost model needs to tell waiting (hideable) transfer from copying.
    copy_rate, per_bucket = math.inf, 0.0
    everything = []
    cases = [(rate, burst) for rate in sorted(rates, key=lambda rate: rate != 0)
             for burst in (bursts if rate else bursts[:1])]
    for gbit, burst in cases:
        gbit = int(gbit) if gbit == int(gbit) else gbit
        launches = []
        for launch in range(args.launches):
            result = run_case(gbit, overlap_args, args.timeout, burst_bytes(burst, gbit))
            link = fitted_link(result)
            if not gbit and launch == 0:
                copy_rate = link.bandwidth
            bucket_bytes = args.bucket_mb * 2**20 or fusion.auto_bucket_bytes(
                result["gradient_megabytes"] * 1e6, spans_hosts=True)
            summary = summarize(gbit, result, link, bucket_bytes, copy_rate, per_bucket,
                                burst)
            if not gbit and launch == 0:
                # What kdist's serial step takes beyond compute and the buckets' raw
                # transfers, shared among the buckets: its own per-bucket work.
                extra = summary["kdist_serial_ms"] - summary["predicted_serial_ms"]
                per_bucket = max(0.0, extra / summary["buckets"]) / 1e3
                summary = summarize(gbit, result, link, bucket_bytes, copy_rate, per_bucket,
                                    burst)
            launches.append(summary)
            print(json.dumps(dict(summary, launch=launch)), flush=True)
        if args.launches > 1:
            print(json.dumps(stability(gbit, launches)), flush=True)
        everything += launches
    print(json.dumps(goals(everything)), flush=True)


if __name__ == "__main__":
    main()
