"""A rank that stops taking part: SIGSTOP (with a collective timeout), a long pause, a
deadlock (two ranks waiting in collectives on different communicators) or a rank whose
script ends while the other still runs collectives."""

import os
import signal
import sys
import time

import numpy as np

import kdist
from common import report

case = sys.argv[1]  # stop, stop-graph (C++ op in a graph), pause, deadlock, leave, leave-graph
kdist.init()

if case == "deadlock":
    pair = kdist.comm.world().split(0)  # the same two ranks, another communicator
    kdist.allreduce(np.ones(3), op=kdist.Sum)  # both ranks alive and talking
    if kdist.rank() == 0:
        kdist.allreduce(np.ones(3), op=kdist.Sum, name="on the world")
    else:
        kdist.allreduce(np.ones(3), op=kdist.Sum, name="on the pair", comm=pair)
    report({"finished": True})
    sys.exit(0)


def reduce():
    if case.endswith("graph"):
        import tensorflow as tf

        return tf.function(lambda t: kdist.allreduce(t, op=kdist.Sum))(tf.ones(1000))
    return kdist.allreduce(np.ones(1000), op=kdist.Sum, name="after the pause")


reduce()  # both ranks alive and talking (and the graph traced)
if case.startswith("leave"):
    if kdist.rank() == 1:
        sys.exit(0)  # its script ends: it announces that it leaves
    time.sleep(1)
    started = time.monotonic()
    try:
        reduce()
    except Exception as error:  # what the waiting rank sees, before the job ends
        report({"waited": time.monotonic() - started, "error": str(error)})
        raise
    report({"finished": True})
    sys.exit(0)
if kdist.rank() == 1:
    if case.startswith("stop"):
        os.kill(os.getpid(), signal.SIGSTOP)
    else:
        time.sleep(float(os.environ["PAUSE_SECONDS"]))
started = time.monotonic()
reduce()
report({"waited": time.monotonic() - started})
