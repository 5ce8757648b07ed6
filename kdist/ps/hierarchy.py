"""Who serves whom: the top servers first, then sub-masters, then workers.

With `servers=K`, ranks 0 to K-1 each hold one shard of the centre
(`shard_bounds`); rank 0 is also the master that validates and checkpoints.
A child of the top exchanges with every one of them, a sub-master's child
with its sub-master only.
"""

from kdist._args import whole_number


def topology(size, submasters=0, servers=1):
    """Returns `(parent, children)`: each child's server, and each server's
    children, for a job of `size` ranks. A child of the top has parent 0,
    which stands for all `servers` top ranks.

    Ranks `0` to `servers - 1` are the top servers, the next `submasters`
    ranks sub-masters, the rest workers, dealt to the sub-masters in turn.

    Args:
        size: ranks in the job.
        submasters: sub-masters, as in `ParameterServerStrategy`.
        servers: top servers, as in `ParameterServerStrategy`.

    Raises:
        ValueError: fewer than `servers + 1` ranks, a negative number of
            sub-masters, or fewer workers than sub-masters.

    >>> topology(4)
    ({1: 0, 2: 0, 3: 0}, {0: [1, 2, 3]})
    >>> topology(5, submasters=2)[1]
    {0: [1, 2], 1: [3], 2: [4]}
    >>> topology(5, servers=2)
    ({2: 0, 3: 0, 4: 0}, {0: [2, 3, 4]})
    """
    servers = whole_number(servers, "servers", minimum=1)
    if size < servers + 1:
        raise ValueError(
            f"A parameter server needs at least {servers + 1} ranks ({servers} server(s), "
            f"1 worker); this job has {size}. Start it with mpiexec -n {servers + 2} "
            "(or more) python script.py.")
    if submasters < 0:
        raise ValueError(f"submasters must be 0 or more; got {submasters}.")
    first = servers
    workers = size - first - submasters
    if workers < max(1, submasters):
        raise ValueError(
            f"{submasters} sub-masters need at least {max(1, submasters)} workers, but "
            f"{size} ranks leave {workers}. Use fewer sub-masters or more ranks "
            f"(at least {first + 2 * max(1, submasters)}).")
    if submasters == 0:
        return {r: 0 for r in range(first, size)}, {0: list(range(first, size))}
    subs = list(range(first, first + submasters))
    parent = {s: 0 for s in subs}
    children = {0: list(subs)}
    for s in subs:
        children[s] = []
    for i, w in enumerate(range(first + submasters, size)):
        parent[w] = subs[i % submasters]
        children[parent[w]].append(w)
    return parent, children


def workers(size, submasters=0, servers=1):
    """The ranks that train, in order."""
    return list(range(servers + submasters, size))


def shard_bounds(size, servers):
    """`[(start, stop)]` of each server's contiguous share of `size` values,
    as equal as whole values allow.

    >>> shard_bounds(10, 3)
    [(0, 3), (3, 6), (6, 10)]
    """
    edges = [size * k // servers for k in range(servers + 1)]
    return [(edges[k], edges[k + 1]) for k in range(servers)]
