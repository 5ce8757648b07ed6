"""Who averages with whom: graphs over the ranks and their mixing weights.

A rank averages its weights with its neighbours' using Metropolis weights,
`a_ij = 1 / (1 + max(d_i, d_j))` for neighbours i, j of degrees d_i, d_j and
`a_ii = 1 - sum_j a_ij`. The matrix is symmetric and doubly stochastic, so
repeated averaging keeps the mean of the replicas and, on a connected graph,
drives every replica to it; the second-largest eigenvalue modulus says how
fast (the spectral gap `1 - |lambda_2|` is the share of the disagreement
removed per round).
"""

import numpy as np

from kdist._args import whole_number


class Topology:
    """An undirected, connected graph over `size` ranks.

    Constructors for the usual graphs: `Topology.ring(size)`,
    `Topology.torus(rows, cols)`, `Topology.exponential(size)` and
    `Topology.complete(size)`. A rank averages with its neighbours using
    Metropolis weights (`weights`, `mixing_matrix`); `spectral_gap()` says how
    fast repeated averaging brings the replicas together.

    Args:
        adjacency: a `size x size` 0/1 matrix (symmetric, zero diagonal), or
            a list whose entry i holds rank i's neighbours.
        name: a label for logs.

    Raises:
        ValueError: one-way edges, a rank listed as its own neighbour, a
            neighbour outside the ranks, no ranks, or a graph that is not
            connected.
        TypeError: `adjacency` is neither a matrix nor a list of lists.

    Example:

        >>> ring = Topology.ring(4)
        >>> ring.neighbours(0), ring.weights(0)
        ([1, 3], {1: 0.3333333333333333, 3: 0.3333333333333333})
        >>> round(ring.spectral_gap(), 4)
        0.6667
        >>> Topology.torus(2, 3).neighbours(0)
        [1, 2, 3]
    """

    def __init__(self, adjacency, name="graph"):
        if len(adjacency) and not hasattr(adjacency[0], "__len__"):
            raise TypeError("adjacency is a 0/1 matrix or a list of neighbour lists.")
        size = len(adjacency)
        matrix = np.zeros((size, size), dtype=bool)
        rows = list(adjacency)
        square = all(len(row) == size for row in rows) and all(
            set(np.unique(np.asarray(row)).tolist()) <= {0, 1} for row in rows)
        if square:
            matrix[:] = np.asarray(rows, dtype=float) != 0
        else:
            for i, row in enumerate(rows):
                for j in row:
                    if not 0 <= int(j) < size:
                        raise ValueError(f"Rank {i} lists neighbour {j}, outside 0..{size - 1}.")
                    matrix[i, int(j)] = True
        if size < 1:
            raise ValueError("A topology needs at least one rank.")
        if np.any(np.diag(matrix)):
            raise ValueError("A rank cannot be its own neighbour (the diagonal must be 0).")
        if not np.array_equal(matrix, matrix.T):
            i, j = np.argwhere(matrix != matrix.T)[0]
            raise ValueError(f"Neighbours must be mutual: {i} lists {j}"
                             f"{'' if matrix[i, j] else ' not'}, but {j} does"
                             f"{' not' if matrix[i, j] else ''} list {i}.")
        self.matrix = matrix
        self.size = size
        self.name = name
        if not self._connected():
            raise ValueError(f"The {name} is not connected: replicas in different parts could "
                             "never agree. Add edges between the parts.")

    def _connected(self):
        seen, frontier = {0}, [0]
        while frontier:
            node = frontier.pop()
            for other in np.flatnonzero(self.matrix[node]):
                if other not in seen:
                    seen.add(int(other))
                    frontier.append(int(other))
        return len(seen) == self.size

    @classmethod
    def ring(cls, size):
        """Each rank's neighbours are the ranks before and after it."""
        _check_size(size)
        return cls([sorted({(i - 1) % size, (i + 1) % size} - {i}) for i in range(size)],
                   name=f"ring({size})")

    @classmethod
    def torus(cls, rows, cols):
        """A `rows x cols` grid that wraps around; rank `r * cols + c` sits at (r, c)."""
        _check_size(rows, "rows")
        _check_size(cols, "cols")
        neighbours = []
        for r in range(rows):
            for c in range(cols):
                around = {((r + dr) % rows) * cols + (c + dc) % cols
                          for dr, dc in ((-1, 0), (1, 0), (0, -1), (0, 1))}
                neighbours.append(sorted(around - {r * cols + c}))
        return cls(neighbours, name=f"torus({rows}, {cols})")

    @classmethod
    def exponential(cls, size):
        """Neighbours at distances 1, 2, 4, ... around the ring (made mutual)."""
        _check_size(size)
        matrix = np.zeros((size, size), dtype=int)
        for i in range(size):
            hop = 1
            while hop < size:
                matrix[i, (i + hop) % size] = matrix[(i + hop) % size, i] = 1
                hop *= 2
        np.fill_diagonal(matrix, 0)
        return cls(matrix.tolist(), name=f"exponential({size})")

    @classmethod
    def complete(cls, size):
        """Every rank is every other rank's neighbour (the mean in one round)."""
        _check_size(size)
        return cls([[j for j in range(size) if j != i] for i in range(size)],
                   name=f"complete({size})")

    def neighbours(self, rank):
        """Rank `rank`'s neighbours, in increasing order."""
        return [int(j) for j in np.flatnonzero(self.matrix[rank])]

    def degree(self, rank):
        """How many neighbours rank `rank` has."""
        return int(self.matrix[rank].sum())

    def weights(self, rank):
        """Rank `rank`'s Metropolis weight for each neighbour; its own is 1 minus their sum."""
        return {j: 1.0 / (1 + max(self.degree(rank), self.degree(j)))
                for j in self.neighbours(rank)}

    def mixing_matrix(self):
        """The `size x size` matrix of Metropolis weights: row i averages rank i's
        replica with its neighbours'. Symmetric, each row and column summing to 1."""
        mixing = np.zeros((self.size, self.size))
        for i in range(self.size):
            for j, weight in self.weights(i).items():
                mixing[i, j] = weight
            mixing[i, i] = 1.0 - mixing[i].sum()
        return mixing

    def spectral_gap(self):
        """`1 - |lambda_2|` of the mixing matrix: the share of disagreement one round removes."""
        if self.size == 1:
            return 1.0
        moduli = np.sort(np.abs(np.linalg.eigvalsh(self.mixing_matrix())))[::-1]
        return float(1.0 - moduli[1])

    def __repr__(self):
        return f"Topology.{self.name}" if "(" in self.name else f"Topology({self.name})"


def resolve(topology, size):
    """A `Topology` for `size` ranks from a name (`"ring"`, `"exponential"`,
    `"complete"`, `"torus"` for the squarest grid) or a `Topology`."""
    if isinstance(topology, Topology):
        if topology.size != size:
            raise ValueError(f"The topology has {topology.size} ranks; the job has {size}.")
        return topology
    if topology == "ring":
        return Topology.ring(size)
    if topology == "exponential":
        return Topology.exponential(size)
    if topology == "complete":
        return Topology.complete(size)
    if topology == "torus":
        rows = max(r for r in range(1, int(np.sqrt(size)) + 1) if size % r == 0)
        return Topology.torus(rows, size // rows)
    raise ValueError(f"Unknown topology {topology!r}; use 'ring', 'torus', 'exponential', "
                     "'complete' or a kdist.gossip.Topology.")


def _check_size(value, name="size"):
    whole_number(value, name, minimum=1)
