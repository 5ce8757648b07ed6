"""An alpha-beta cost model of the exchanges kdist's training modes make.

A link costs `latency` seconds per message (alpha) and `1 / bandwidth` seconds
per byte (beta); reducing costs `1 / reduce_rate` seconds per byte (gamma).
From those, each function gives the seconds one step or one exchange takes:

- `allreduce_time`: ring (reduce-scatter, then allgather: what kdist's ring
  and most MPI libraries do for large messages) or tree (reduce to a root,
  then broadcast).
- `hierarchical_allreduce_time`: within each node, then between nodes.
- `data_parallel_step`: compute, plus the gradient's buckets, less what the
  backward pass hides (`overlap`: the fraction of the overlappable part that
  is hidden; about 0.5 measured with one core per rank over a 1 Gbit/s link,
  docs/lab/network.md).
- `parameter_server_step`, `gossip_step`, `pipeline_step`,
  `tensor_parallel_step`: the other layouts' steps.

`fit_link` fits a link's alpha and beta from measured allreduce times.
Everything here is arithmetic on floats; `kdist.distribute.planner` compares
layouts with it.

Example:

    >>> link = Link.from_gbit(10, latency_us=5)
    >>> round(allreduce_time(100e6, 2, link) * 1e3, 1)   # 100 MB on two ranks: ms
    80.0
"""

import math
from dataclasses import dataclass

from kdist._args import positive_number, whole_number


@dataclass(frozen=True)
class Link:
    """A network link in the alpha-beta model.

    Args:
        latency: seconds per message (alpha), >= 0.
        bandwidth: bytes per second on the wire (1 / beta).
        reduce_rate: bytes per second a rank reduces (1 / gamma); infinite by
            default, so reductions cost nothing.

    `Link.from_gbit(gbit, latency_us=0)` gives one from Gbit/s and microseconds.

    Raises:
        ValueError: a negative latency, or a bandwidth or reduce rate that is
            not positive.
    """

    latency: float
    bandwidth: float
    reduce_rate: float = math.inf

    def __post_init__(self):
        if not (isinstance(self.latency, (int, float)) and self.latency >= 0):
            raise ValueError(f"latency must be a number of seconds >= 0; got {self.latency!r}.")
        positive_number(self.bandwidth, "bandwidth")
        if self.reduce_rate != math.inf:
            positive_number(self.reduce_rate, "reduce_rate")

    @classmethod
    def from_gbit(cls, gbit, latency_us=0.0, reduce_gbyte=math.inf):
        """A link of `gbit` Gbit/s and `latency_us` microseconds, reducing
        `reduce_gbyte` GB/s (infinite by default)."""
        return cls(latency=float(latency_us) * 1e-6,
                   bandwidth=positive_number(gbit, "gbit") * 1e9 / 8,
                   reduce_rate=reduce_gbyte * 1e9 if reduce_gbyte != math.inf else math.inf)

    def transfer(self, nbytes):
        """One message of `nbytes`."""
        return self.latency + nbytes / self.bandwidth

    def get_config(self):
        return {"latency": self.latency, "bandwidth": self.bandwidth,
                "reduce_rate": self.reduce_rate}


def _ranks(ranks):
    return whole_number(ranks, "ranks", minimum=1)


def allreduce_time(nbytes, ranks, link, algorithm="ring"):
    """Seconds to allreduce `nbytes` over `ranks` ranks joined by `link`."""
    p = _ranks(ranks)
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0; got {nbytes!r}.")
    if p == 1 or nbytes == 0:
        return 0.0
    if algorithm == "ring":
        # 2(p-1) steps, each moving 1/p of the data; (p-1) of them reduce it.
        return (2 * (p - 1) * link.latency + 2 * (p - 1) / p * nbytes / link.bandwidth
                + (p - 1) / p * nbytes / link.reduce_rate)
    if algorithm == "tree":
        rounds = math.ceil(math.log2(p))
        return rounds * (2 * link.transfer(nbytes) + nbytes / link.reduce_rate)
    raise ValueError(f"algorithm must be 'ring' or 'tree'; got {algorithm!r}.")


def hierarchical_allreduce_time(nbytes, nodes, per_node, inter, intra):
    """Reduce-scatter within each node (`intra`), allreduce each part between nodes
    (`inter`), then allgather within the node: how a job with several ranks per node
    keeps most bytes off the network."""
    nodes, per_node = _ranks(nodes), _ranks(per_node)
    within = allreduce_time(nbytes, per_node, intra)
    return within + allreduce_time(nbytes / per_node, nodes, inter)


def bucket_sizes(total_bytes, bucket_bytes):
    """The payloads of `total_bytes` of gradient cut into buckets of `bucket_bytes`."""
    positive_number(bucket_bytes, "bucket_bytes")
    if total_bytes <= 0:
        return []
    full, rest = divmod(total_bytes, bucket_bytes)
    return [bucket_bytes] * int(full) + ([rest] if rest else [])


def data_parallel_step(compute, gradient_bytes, ranks, link, bucket_bytes=64 * 2**20,
                       overlap=0.5, backward_fraction=2 / 3, allreduce=None,
                       copy_rate=math.inf, per_bucket=0.0):
    """Seconds per step of synchronous data parallelism.

    `compute`: one rank's forward and backward pass in seconds. The buckets are
    reduced one after another; all but the last (the first layers', produced
    last) can travel during the backward pass, and `overlap` of that is hidden.
    `allreduce(nbytes)`: the time of one bucket (default: a ring on `link`).
    `copy_rate`: bytes per second the rank's own core moves onto the wire (the
    kernel's copying); a transfer is waiting, and can hide, only for the part of
    it that the link, not the core, sets: 1 - bandwidth / copy_rate.
    `per_bucket`: seconds of the rank's own work per bucket besides the transfer
    (packing, announcing it, unpacking), on the rank's core, so never hidden:
    what makes many small buckets cost more than few large ones.
    """
    compute = float(compute)
    if not 0 <= overlap <= 1:
        raise ValueError(f"overlap must lie between 0 and 1; got {overlap!r}.")
    if not (isinstance(per_bucket, (int, float)) and per_bucket >= 0):
        raise ValueError(f"per_bucket must be a number of seconds >= 0; got {per_bucket!r}.")
    if allreduce is None:
        def allreduce(nbytes):
            return allreduce_time(nbytes, ranks, link)
    times = [allreduce(b) for b in bucket_sizes(gradient_bytes, bucket_bytes)]
    if not times:
        return compute
    communication = sum(times)
    hideable = communication - times[-1]
    waiting = max(0.0, 1.0 - link.bandwidth / copy_rate)
    hidden = overlap * waiting * min(compute * backward_fraction, hideable)
    return compute + communication - hidden + per_bucket * len(times)


def parameter_server_step(compute, gradient_bytes, workers, link, masters=1):
    """Seconds between two updates of one worker, with `workers` workers pushing
    gradients to and pulling weights from `masters` masters that share the work.

    A worker waits for its own push and pull; the masters' links carry every
    worker's traffic, so with many workers they set the pace.
    """
    workers, masters = _ranks(workers), _ranks(masters)
    own = float(compute) + 2 * link.transfer(gradient_bytes / masters) * masters
    busiest = 2 * gradient_bytes * workers / masters / link.bandwidth
    return max(own, busiest)


def gossip_step(compute, gradient_bytes, neighbours, link):
    """Seconds per step of decentralised training: each rank exchanges its weights
    with `neighbours` neighbours (full duplex: sending and receiving overlap)."""
    neighbours = whole_number(neighbours, "neighbours", minimum=1)
    return float(compute) + neighbours * link.transfer(gradient_bytes)


def pipeline_step(compute, stages, micro_batches, boundary_bytes, link):
    """Seconds per step of a pipeline of `stages` stages (GPipe's schedule):
    `micro_batches` flow through; the bubble idles (stages - 1) of every
    (micro_batches + stages - 1) slots. `boundary_bytes`: the activations one
    whole batch passes between two stages (its gradient returns the same way)."""
    s, m = whole_number(stages, "stages", minimum=1), whole_number(
        micro_batches, "micro_batches", minimum=1)
    per_slot = compute / (s * m)
    if s > 1:
        per_slot += 2 * link.transfer(boundary_bytes / m)
    return (m + s - 1) * per_slot


def tensor_parallel_step(compute, ways, layers, activation_bytes, link):
    """Seconds per step with each layer split `ways` ways: the compute divides, and
    each of `layers` split layers allreduces its output (`activation_bytes` for the
    batch) in the forward pass and its input gradient in the backward pass."""
    ways = _ranks(ways)
    layers = whole_number(layers, "layers", minimum=1)
    return compute / ways + 2 * layers * allreduce_time(activation_bytes, ways, link)


def fit_link(sizes, seconds, ranks):
    """The `Link` whose ring allreduce best fits measured times (least squares in
    relative error).

    `sizes`: payloads in bytes (two distinct ones at least), `seconds`: the
    measured allreduce time of each, over `ranks` ranks (2 or more). Raises
    `ValueError` for fewer than 2 ranks or two distinct sizes, for times that
    are not positive, and for times that do not grow with the size.

    >>> link = Link(latency=20e-6, bandwidth=1.25e8)
    >>> sizes = [1e5, 1e6, 1e7]
    >>> fitted = fit_link(sizes, [allreduce_time(n, 2, link) for n in sizes], 2)
    >>> round(fitted.latency * 1e6), round(fitted.bandwidth / 1e6)
    (20, 125)
    """
    import numpy as np

    p = _ranks(ranks)
    if p < 2:
        raise ValueError("fitting a link needs measurements on 2 or more ranks.")
    sizes = np.asarray(sizes, dtype=float)
    seconds = np.asarray(seconds, dtype=float)
    if sizes.shape != seconds.shape or len(np.unique(sizes)) < 2:
        raise ValueError("fit_link needs one time per size and two distinct sizes at least.")
    if np.any(seconds <= 0):
        raise ValueError("measured times must be positive.")
    # t = alpha * 2(p-1) + beta * n * 2(p-1)/p, fitted in relative error (each row divided
    # by its time), so that the largest payload does not decide alone and the small
    # ones' latency counts.
    design = np.stack([np.full_like(sizes, 2 * (p - 1)), sizes * 2 * (p - 1) / p], axis=1)
    (alpha, beta), *_ = np.linalg.lstsq(design / seconds[:, None], np.ones_like(seconds),
                                        rcond=None)
    if beta <= 0:
        raise ValueError("the measured times do not grow with the size; measure larger "
                         "payloads.")
    return Link(latency=max(float(alpha), 0.0), bandwidth=1.0 / float(beta))
