"""Asynchronous parameter-server training: Downpour, EASGD, GEM, sub-masters.

>>> import kdist.ps
>>> kdist.ps.topology(5, submasters=2)
({1: 0, 2: 0, 3: 1, 4: 2}, {0: [1, 2], 1: [3], 2: [4]})
"""

from kdist.ps import algorithms
from kdist.ps.layout import Layout
from kdist.ps.master_optimizers import MasterAdam, MasterSGD
from kdist.ps.server import Server
from kdist.ps.strategy import ParameterServerStrategy
from kdist.ps.hierarchy import topology
from kdist.ps.worker import SyncCallback, WorkerSession

__all__ = ["Layout", "MasterAdam", "MasterSGD", "ParameterServerStrategy", "Server",
           "SyncCallback", "WorkerSession", "algorithms", "topology"]
