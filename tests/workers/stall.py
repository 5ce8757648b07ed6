"""A rank that stops taking part: SIGSTOP (with a collective timeout) or a long pause."""

import os
import signal
import sys
import time

import numpy as np

import kdist
from common import report

case = sys.argv[1]  # stop (numpy collective), stop-graph (C++ op in a graph) or pause
kdist.init()


def reduce():
    if case == "stop-graph":
        import tensorflow as tf

        return tf.function(lambda t: kdist.allreduce(t, op=kdist.Sum))(tf.ones(1000))
    return kdist.allreduce(np.ones(1000), op=kdist.Sum, name="after the pause")


reduce()  # both ranks alive and talking (and the graph traced)
if kdist.rank() == 1:
    if case.startswith("stop"):
        os.kill(os.getpid(), signal.SIGSTOP)
    else:
        time.sleep(float(os.environ["PAUSE_SECONDS"]))
started = time.monotonic()
reduce()
report({"waited": time.monotonic() - started})
