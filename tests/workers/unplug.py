"""Training-like steps until the host of the last rank drops off the network.

That rank pulls its own host's cable (the emulated switch's port, named by the test's
environment) after a few steps, and says so, which its host's launcher daemon then cannot
pass on; no rank should ever report finishing.
"""

import os
import socket
import subprocess
import time

import numpy as np

import kdist
from common import report

kdist.init()
last = kdist.rank() == kdist.size() - 1
started = time.monotonic()
step = 0
while time.monotonic() - started < 600:
    kdist.allreduce(np.ones(1000))
    step += 1
    if step == 20 and last:
        host = int(socket.gethostname().lstrip("h"))
        switch, prefix = os.environ["KDIST_TEST_SWITCH"], os.environ["KDIST_TEST_HOSTS"]
        subprocess.run(["ip", "-n", switch, "link", "set", f"{prefix}p{host}", "down"],
                       check=True)
        # Said after the fact: this line then waits in the host's daemon for a network
        # that is gone, and the daemon lives on as long as TCP retries (15 minutes).
        print(f"rank {kdist.rank()} pulled the cable of host h{host}", flush=True)
    time.sleep(0.01)
report({"finished": True, "steps": step})
