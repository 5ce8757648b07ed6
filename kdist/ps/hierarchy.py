"""Who serves whom: rank 0 is the master, then sub-masters, then workers."""


def topology(size, submasters=0):
    """Returns `(parent, children)`: each non-master rank's server, and each
    server's children, for a job of `size` ranks.

    >>> topology(4)
    ({1: 0, 2: 0, 3: 0}, {0: [1, 2, 3]})
    >>> topology(5, submasters=2)[1]
    {0: [1, 2], 1: [3], 2: [4]}
    """
    if size < 2:
        raise ValueError(
            f"A parameter server needs at least 2 ranks (1 master, 1 worker); this job has "
            f"{size}. Start it with mpiexec -n 3 (or more) python script.py.")
    if submasters < 0:
        raise ValueError(f"submasters must be 0 or more; got {submasters}.")
    workers = size - 1 - submasters
    if workers < max(1, submasters):
        raise ValueError(
            f"{submasters} sub-masters need at least {max(1, submasters)} workers, but "
            f"{size} ranks leave {workers}. Use fewer sub-masters or more ranks "
            f"(at least {1 + 2 * max(1, submasters)}).")
    if submasters == 0:
        return {r: 0 for r in range(1, size)}, {0: list(range(1, size))}
    parent = {s: 0 for s in range(1, submasters + 1)}
    children = {0: list(range(1, submasters + 1))}
    for s in range(1, submasters + 1):
        children[s] = []
    for i, w in enumerate(range(submasters + 1, size)):
        parent[w] = 1 + i % submasters
        children[parent[w]].append(w)
    return parent, children


def workers(size, submasters=0):
    """The ranks that train, in order."""
    return list(range(submasters + 1, size))
