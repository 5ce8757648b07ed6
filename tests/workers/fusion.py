"""Separate allreduces inside a tf.function, on 2 ranks: what the fusion queue does.

argv[1]: "fused" (the default set-up) or "stalled" (each rank waits for an allreduce the
other never runs; KDIST_DEADLOCK_TIMEOUT is short).
"""

import json
import os
import sys

import numpy as np
import tensorflow as tf

import kdist
from common import report
from kdist.comm import native

kdist.init()
rank = kdist.rank()
mode = sys.argv[1] if len(sys.argv) > 1 else "fused"
out = {}


def fused_events(run, name):
    """The fused reductions of separate allreduces that the timeline recorded while
    `run()` ran, on rank 0: [tensors in each]."""
    path = os.path.join(os.environ["KDIST_TEST_REPORTS"], f"{name}.json")
    kdist.start_timeline(path, mark_cycles=True)
    run()
    kdist.stop_timeline()
    if rank != 0:
        return None
    with open(path) as f:
        events = json.load(f)
    events = events["traceEvents"] if isinstance(events, dict) else events
    sizes = []
    for event in events:
        what = str(event.get("args", {}).get("what", ""))
        if event.get("ph") == "i" and event.get("pid") == 0 and "from separate ops" in what:
            sizes.append(int(what.split("fused allreduce of ")[1].split(" ")[0]))
    return sizes


if mode == "stalled":
    # First a queue with a long timeout, which must end with kdist.shutdown(): MPI may
    # give the next world's communicator the same handle (the same address, often), and
    # that world must get a queue of its own that reads the short timeout set here.
    short = os.environ["KDIST_DEADLOCK_TIMEOUT"]
    os.environ["KDIST_DEADLOCK_TIMEOUT"] = "600"
    out["before"] = float(tf.function(lambda x: kdist.allreduce(x, op=kdist.Sum))(tf.ones([2]))[0])
    out["queues"] = [native.fusion_queue_count()]
    kdist.shutdown()
    out["queues"].append(native.fusion_queue_count())
    os.environ["KDIST_DEADLOCK_TIMEOUT"] = short
    kdist.init()

    # Rank 0 runs one graph, rank 1 another: neither allreduce exists on the other rank
    # (the queue tells them apart by node name).
    @tf.function
    def mine(x):
        with tf.name_scope("only_on_rank_0"):
            return kdist.allreduce(x)

    @tf.function
    def theirs(x):
        with tf.name_scope("only_on_rank_1"):
            return kdist.allreduce(x)

    try:
        (mine if rank == 0 else theirs)(tf.ones([3]))
        out["error"] = None
    except tf.errors.OpError as error:
        out["error"] = [type(error).__name__, str(error)]
    report(out)
    sys.exit(0)

# Ten tensors of different shapes and dtypes, reduced one call each.
values = [tf.constant(np.full((2, i + 1), (rank + 1) * (i + 1), np.float32)) for i in range(8)]
values += [tf.constant([rank + 1, 10 * (rank + 1)], tf.int32),
           tf.constant([0.5 * (rank + 1)], tf.float64)]


@tf.function
def separate(values):
    sums = [kdist.allreduce(v, op=kdist.Sum) for v in values]
    averages = [kdist.allreduce(v) for v in values]
    return sums, averages


results = {}


def run_separate():
    for _ in range(3):  # the queue learns which tensors come together
        results["value"] = separate(values)


out["fused"] = fused_events(run_separate, "fused")
sums, averages = results["value"]
out["sums"] = [s.numpy().ravel().tolist()[:2] for s in sums]
out["averages"] = [a.numpy().ravel().tolist()[:2] for a in averages]

# With KDIST_FUSION=0 when a function is traced, each allreduce runs on its own.
os.environ["KDIST_FUSION"] = "0"
unfused = tf.function(separate.python_function)
out["unfused"] = fused_events(lambda: unfused(values), "unfused")
out["unfused_sums"] = [s.numpy().ravel().tolist()[:2] for s in unfused(values)[0]]
del os.environ["KDIST_FUSION"]


# Reductions that depend on each other, an ordered collective between them, scaling,
# Min/Max and a constant input, in one graph.
@tf.function
def mixed(x):
    averaged = kdist.allreduce(x)
    gathered = kdist.allgather(x)
    doubled = kdist.allreduce(averaged * 2.0, op=kdist.Sum)
    scaled = kdist.allreduce(x, op=kdist.Sum, prescale_factor=2.0, postscale_factor=0.5)
    smallest = kdist.allreduce(x, op=kdist.Min)
    largest = kdist.allreduce(x, op=kdist.Max)
    constant = kdist.allreduce(tf.constant(5.0 + rank))
    return averaged, gathered, doubled, scaled, smallest, largest, constant


out["mixed"] = [t.numpy().ravel().tolist() for t in mixed(tf.constant([1.0 + rank]))]


# Ordered collectives nested in a branch and in an inner tf.function (traced once,
# then called from two functions) between queued allreduces: every rank runs them in
# one order, step after step.
@tf.function
def inner(x):
    return kdist.broadcast(x * 2.0, 0)


def with_nested(x, flag):
    before = kdist.allreduce(x, op=kdist.Sum)
    branch = tf.cond(flag, lambda: kdist.allgather(x), lambda: tf.concat([x, x], 0))
    called = inner(x)
    after = kdist.allreduce(x * 3.0, op=kdist.Sum)
    return before, branch, called, after


nested_a, nested_b = tf.function(with_nested), tf.function(with_nested)
nested = []
for step in range(4):
    run = nested_a if step % 2 == 0 else nested_b
    nested.append([t.numpy().tolist() for t in run(tf.constant([1.0 + rank]),
                                                   tf.constant(step < 2))])
out["nested"] = nested


# The same number of elements in another shape on each rank: a mismatch, on both ranks,
# after which the ranks go on together.
@tf.function(reduce_retracing=True)
def reshaped(x):
    return kdist.allreduce(x, op=kdist.Sum, name="reshaped")


try:
    reshaped(tf.ones([2, 3]) if rank == 0 else tf.ones([3, 2]))
    out["mismatch"] = None
except tf.errors.FailedPreconditionError as error:
    out["mismatch"] = ["FailedPreconditionError", "not running the same collective" in str(error)]
out["after_mismatch"] = separate(values)[0][0].numpy().ravel().tolist()[:2]

# The same, eagerly (the C++ op) and on numpy arrays (in Python): Horovod's
# [17, 1311] against [17, 23, 57].
eager_errors = []
for make in (tf.constant, np.asarray):
    try:
        kdist.allreduce(make(np.ones((17, 1311) if rank == 0 else (17, 23, 57), np.float32)))
        eager_errors.append(None)
    except Exception as error:  # noqa: BLE001 - the class is what is checked
        eager_errors.append([type(error).__name__, "[17, 23, 57]" in str(error)])
out["eager_mismatch"] = eager_errors


# Inside a while loop the allreduce runs in place (iterations may overlap).
@tf.function
def looped(x):
    for _ in tf.range(3):
        x = kdist.allreduce(x, op=kdist.Sum)
    return x


out["looped"] = looped(tf.constant([1.0])).numpy().tolist()


# Uneven data in a custom loop: rank 1 runs out after 2 steps and joins; rank 0's
# averages count only the ranks still training.
@tf.function
def averaged(x):
    return kdist.allreduce(x), kdist.allreduce(x * 10.0)


steps = 4 if rank == 0 else 2
seen = []
for step in range(steps):
    a, b = averaged(tf.constant([float(rank + 1)]))
    seen.append([a.numpy().tolist()[0], b.numpy().tolist()[0]])
out["uneven"] = seen
out["last_joined"] = kdist.join()
report(out)
