"""Asynchronous parameter-server training: Downpour, EASGD, GEM, sub-masters.

>>> import kdist.ps
>>> kdist.ps.topology(5, submasters=2)
({1: 0, 2: 0, 3: 1, 4: 2}, {0: [1, 2], 1: [3], 2: [4]})
"""

from kdist._exports import declare as _declare

_EXPORTS = {
    "algorithms": "kdist.ps.algorithms",
    "topology": "kdist.ps.hierarchy",
    "Layout": "kdist.ps.layout",
    "MasterAdam": "kdist.ps.master_optimizers",
    "MasterSGD": "kdist.ps.master_optimizers",
    "Server": "kdist.ps.server",
    "ParameterServerStrategy": "kdist.ps.strategy",
    "SyncCallback": "kdist.ps.worker",
    "WorkerSession": "kdist.ps.worker",
}

__all__, __getattr__, __dir__ = _declare(__name__, _EXPORTS)
