"""kdist's collectives in a TensorFlow 1 graph, run by a Session, on 2 ranks.

The first collective of the process is built inside the graph (kdist's C++
ops must load from there), and several collectives are fetched in one
`Session.run`, which gives TensorFlow no order to run them in unless kdist
sets one.
"""

import tensorflow as tf

import kdist as hvd
from common import report

hvd.init()
rank = hvd.rank()
results = []
with tf.Graph().as_default():
    sums = [hvd.allreduce(tf.fill([n], float(rank + 1)), op=hvd.Sum) for n in (3, 70, 5, 900, 1)]
    gathered = hvd.allgather(tf.fill([rank + 1, 2], rank))
    accessors = [hvd.rank_op(), hvd.size_op()]
    with tf.compat.v1.Session() as session:
        for _ in range(10):
            values = session.run(sums + [gathered] + accessors)
            results.append([sorted(set(v.ravel().tolist())) for v in values[:5]]
                           + [values[5].shape[0], int(values[6]), int(values[7])])
from kdist.comm import native  # noqa: E402

report({"runs": results, "native": native.load() is not None})
