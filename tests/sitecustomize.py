"""Runs first in every Python process the tests start: their PYTHONPATH begins with tests/.

Importing TensorFlow and Keras makes some 400,000 objects that live as long as the
process. At Python's default thresholds the collector walks all of them about six times
during that import, some 0.7 s of each rank's start-up; the suite starts hundreds of
ranks. The oldest generation is collected less often here, which changes no result:
garbage still goes, and the tests that measure memory collect explicitly first.
"""

import gc

gc.set_threshold(700, 10, 1000)

import faulthandler
import signal

# On SIGUSR1 (which the tests send a job that outlives its timeout, and which Open MPI's
# and MPICH's launchers pass on to every rank) every thread's Python stack is written out.
faulthandler.register(signal.SIGUSR1, all_threads=True)
