"""Reduces tensors of several sizes and dtypes inside a tf.function with the timeline
on, and reports the results and which data phases the in-graph collectives took."""

import json
import sys

import numpy as np
import tensorflow as tf

import kdist
from common import report

kdist.init()
r, n = kdist.rank(), kdist.size()
timeline = sys.argv[1]
sizes = [int(s) for s in sys.argv[2].split(",")]


@tf.function
def reduce_all(tensors):
    out = []
    for t in tensors:
        out.append(kdist.allreduce(t, op=kdist.Sum))
        out.append(kdist.allreduce(t, op=kdist.Max))
        if t.dtype.is_floating:
            out.append(kdist.allreduce(t, op=kdist.Average))
    return out


inputs = []
for size in sizes:
    for dtype in (np.float32, np.float64, np.int32, np.float16):
        inputs.append(tf.constant(((np.arange(size) % 50) * (r + 1)).astype(dtype)))
kdist.start_timeline(timeline)
results = [t.numpy() for t in reduce_all(inputs)]
kdist.stop_timeline()
digest = [float(np.asarray(t, np.float64).sum()) for t in results]
# Every rank must end with the same bytes, not merely close values.
rank_0 = kdist.broadcast_object(results, root_rank=0)
same = all(np.array_equal(mine, theirs) for mine, theirs in zip(results, rank_0))
out = {"results": [t.astype(np.float64).tolist() for t in results], "same_as_rank_0": same}
if r == 0:
    with open(timeline) as f:
        events = json.load(f)["traceEvents"]
    out["phases"] = sorted({(e["name"], e["args"]["bytes"]) for e in events
                            if e.get("ph") == "X" and e.get("tid") == 1
                            and "allreduce" in e["name"]}, key=str)
report(out)
