"""How fast two cores of this machine talk to each other, over time.

    python benchmarks/core_placement.py [--seconds 20]

Two measurements with neither TensorFlow nor kdist in them:

- `cache_line_round_trip_ns`: two threads, pinned to cores 0 and 1, pass a
  cache line back and forth (a small C program, built with the system's C
  compiler); one sample per 100 ms window;
- `allreduce_ms`: two MPI ranks (bound to a core each) reduce the 2.68 MB
  gradient of the benchmark MLP with raw mpi4py `Allreduce`; the median of each
  100 ms window.

On a virtual machine the host decides where the virtual cores run. When both
run on cores that share a last-level cache, data moves between them several
times faster than when they do not, and the host changes that while a job
runs. Both series then jump between two levels; `slow_fraction` is the share
of windows at more than 1.5x the fastest tenth. Prints one JSON object.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

PING_PONG = r"""
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static _Atomic long turn __attribute__((aligned(64)));
static _Atomic int done;

static void pin(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  pthread_setaffinity_np(pthread_self(), sizeof set, &set);
}

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

/* The other core answers every odd value with the next even one. */
static void* answer(void* unused) {
  pin(1);
  while (!atomic_load(&done)) {
    long value = atomic_load(&turn);
    if (value & 1) atomic_store(&turn, value + 1);
  }
  return unused;
}

int main(int argc, char** argv) {
  double seconds = argc > 1 ? atof(argv[1]) : 10.0;
  pthread_t peer;
  pthread_create(&peer, NULL, answer, NULL);
  pin(0);
  double end = now() + seconds;
  while (now() < end) {
    const int trips = 20000;
    double start = now();
    for (int i = 0; i < trips; ++i) {
      long value = atomic_load(&turn);
      atomic_store(&turn, value + 1);
      while (atomic_load(&turn) == value + 1) {
      }
    }
    printf("%.1f\n", (now() - start) / trips * 1e9);
    fflush(stdout);
    struct timespec pause = {0, 100000000};
    nanosleep(&pause, NULL);
  }
  atomic_store(&done, 1);
  pthread_join(peer, NULL);
  return 0;
}
"""


def _summary(samples, unit):
    samples = np.asarray(samples, dtype=float)
    fast = np.percentile(samples, 10)
    return {f"p10_{unit}": round(float(fast), 3),
            f"median_{unit}": round(float(np.median(samples)), 3),
            f"p90_{unit}": round(float(np.percentile(samples, 90)), 3),
            "slow_fraction": round(float(np.mean(samples > 1.5 * fast)), 3),
            "windows": int(samples.size)}


def ping_pong(seconds):
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None or (os.cpu_count() or 1) < 2:
        return None
    with tempfile.TemporaryDirectory() as directory:
        source = os.path.join(directory, "ping_pong.c")
        binary = os.path.join(directory, "ping_pong")
        with open(source, "w") as stream:
            stream.write(PING_PONG)
        subprocess.run([compiler, "-O2", "-pthread", source, "-o", binary], check=True)
        out = subprocess.run([binary, str(seconds)], capture_output=True, text=True,
                             check=True).stdout
    return [float(line) for line in out.split()]


def allreduce_windows(seconds):
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    flat = np.ones(669706, np.float32)
    windows = []
    end = time.perf_counter() + seconds
    while True:
        stop = comm.bcast(time.perf_counter() > end)
        if stop:
            break
        window_end = time.perf_counter() + 0.1
        times = []
        while not comm.bcast(time.perf_counter() > window_end):
            comm.Barrier()
            start = time.perf_counter()
            comm.Allreduce(MPI.IN_PLACE, flat)
            times.append((time.perf_counter() - start) * 1e3)
        windows.append(float(np.median(times)))
    if comm.rank == 0:
        print("WINDOWS " + json.dumps(windows))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--ranks-mode", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.seconds <= 0:
        parser.error("--seconds must be positive")
    if args.ranks_mode:
        allreduce_windows(args.seconds)
        return
    from kdist.cli import mpiexec_command

    result = {"benchmark": "core_placement", "seconds": args.seconds}
    trips = ping_pong(args.seconds)
    result["cache_line_round_trip_ns"] = (
        _summary(trips, "ns") if trips else "no C compiler, or fewer than 2 cores")
    argv, env = mpiexec_command(2, [sys.executable, os.path.abspath(__file__), "--ranks-mode",
                                    "--seconds", str(args.seconds)])
    done = subprocess.run(argv, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        # The launcher's own words, which a bare CalledProcessError would drop.
        sys.exit(f"the 2-rank allreduce run failed with exit status {done.returncode}:\n"
                 f"{done.stderr[-3000:]}")
    out = done.stdout
    line = next(line for line in out.splitlines() if line.startswith("WINDOWS "))
    result["allreduce_ms"] = _summary(json.loads(line[len("WINDOWS "):]), "ms")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
