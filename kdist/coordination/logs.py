"""Epoch logs averaged over the ranks, so that every callback decides on the same numbers."""

import numpy as np

from kdist.comm import collectives


def average_logs(logs, comm, known=None, who="kdist"):
    """Replaces the numeric values of `logs` in place by their average over `comm`'s ranks.

    `known` is the list of names the ranks last agreed on (None at first); when
    the names change, the ranks compare them first. Returns the names.
    """
    if comm.size == 1:
        return known
    names = sorted(k for k, v in logs.items() if np.ndim(v) == 0 and _is_number(v))
    if names != known:
        everyone = comm.allgather_object(names)
        if any(theirs != names for theirs in everyone):
            raise ValueError(
                f"{who}: ranks report different metrics ({everyone}); every rank must "
                "compile the same metrics.")
    values = np.array([float(logs[k]) for k in names], dtype=np.float64)
    averaged = collectives.allreduce(values, comm=comm)
    for name, value in zip(names, averaged):
        logs[name] = float(value)
    return names


def _is_number(value):
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True
