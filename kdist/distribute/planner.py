"""Which layout to train a model in on a cluster: data parallel, a pipeline, split
layers, a parameter server or gossip, predicted with `kdist.distribute.cost_model`.

`plan(work, cluster)`, given a `Workload` and a `Cluster`, returns every layout
that fits in memory, fastest first, each with its predicted step time, samples per
second and scaling efficiency (samples per second over `ranks` times one device's),
and for data parallelism the bucket size that the model predicts fastest. `kdist plan`
prints it. The layouts:

- `data`: every rank holds the whole model; gradients are reduced in buckets,
  within nodes first when a node has several ranks.
- `data, fp16 gradients`: the same with half the bytes on the wire.
- `pipeline S x data`: the model cut into S stages, replicas of that pipeline
  data parallel.
- `tensor W x data`: each layer split W ways within a node, nodes data parallel.
- `parameter server`: one master per node, the other ranks workers
  (asynchronous: as many updates per second do not buy as much accuracy).
- `gossip`: each rank averages with its two ring neighbours (asynchronous in
  effect, as above).

Example:

    >>> from kdist.distribute.cost_model import Link
    >>> work = Workload(parameters=25e6, step_seconds=0.2, batch_per_rank=32)
    >>> cluster = Cluster(nodes=4, per_node=1, inter=Link.from_gbit(1, 50))
    >>> plan(work, cluster)[0].layout
    'data, fp16 gradients'
"""

import math
from dataclasses import asdict, dataclass, field

from kdist._args import positive_number, whole_number
from kdist.distribute import cost_model
from kdist.distribute.cost_model import Link

# Shared memory between ranks of one node: a few GB/s, about a microsecond.
SHARED_MEMORY = Link(latency=1e-6, bandwidth=5e9)
BUCKET_CHOICES = tuple(2**k for k in range(18, 29))  # 256 KiB .. 256 MiB


@dataclass(frozen=True)
class Workload:
    """What one rank does per step, for `plan`.

    Args:
        parameters: trainable parameters.
        step_seconds: one device's forward and backward pass at
            `batch_per_rank` samples.
        batch_per_rank: samples per rank per step.
        gradient_bytes_per_parameter: 4 for float32 gradients.
        memory_bytes_per_parameter: weights, gradients and optimizer state
            (16 for Adam in float32).
        activation_bytes_per_sample: what one sample's activations take
            between two layers, for pipelines and split layers; None leaves
            those layouts out.
        layers: how many layers could be split or staged.

    Raises:
        ValueError: a value that is not positive, or a count that is not a
            whole number (`TypeError` for what is not a number).
    """

    parameters: float
    step_seconds: float
    batch_per_rank: int
    gradient_bytes_per_parameter: float = 4
    memory_bytes_per_parameter: float = 16
    activation_bytes_per_sample: float = None
    layers: int = 8

    def __post_init__(self):
        positive_number(self.parameters, "parameters")
        positive_number(self.step_seconds, "step_seconds")
        whole_number(self.batch_per_rank, "batch_per_rank", minimum=1)
        positive_number(self.gradient_bytes_per_parameter, "gradient_bytes_per_parameter")
        positive_number(self.memory_bytes_per_parameter, "memory_bytes_per_parameter")
        if self.activation_bytes_per_sample is not None:
            positive_number(self.activation_bytes_per_sample, "activation_bytes_per_sample")
        whole_number(self.layers, "layers", minimum=1)

    @property
    def gradient_bytes(self):
        return self.parameters * self.gradient_bytes_per_parameter


@dataclass(frozen=True)
class Cluster:
    """The machines to plan for (`plan`).

    Args:
        nodes: how many nodes.
        per_node: ranks (cores or GPUs) per node.
        inter: the `Link` that joins nodes.
        intra: the `Link` between a node's ranks (default `SHARED_MEMORY`:
            1 microsecond, 5 GB/s).
        memory_bytes: what one rank may hold (None: no limit).
        overlap: the fraction of the overlappable communication the backward
            pass hides, between 0 and 1 (0.5 measured with one core per rank
            and a ring allreduce; closer to 1 with a core to spare).
        per_bucket: seconds of kdist's own work per gradient bucket, per
            gossip exchange and per parameter-server push or pull (packing,
            announcing, unpacking; 0-1 ms measured), which no link hides and
            which makes many small buckets cost more than a few.

    Raises:
        ValueError: `overlap` outside [0, 1], a negative `per_bucket`, or
            counts that are not whole numbers of at least 1.
    """

    nodes: int
    per_node: int
    inter: Link
    intra: Link = SHARED_MEMORY
    memory_bytes: float = None
    overlap: float = 0.5
    per_bucket: float = 5e-4

    def __post_init__(self):
        whole_number(self.nodes, "nodes", minimum=1)
        whole_number(self.per_node, "per_node", minimum=1)
        if not 0 <= self.overlap <= 1:
            raise ValueError(f"overlap must lie between 0 and 1; got {self.overlap!r}.")
        if not (isinstance(self.per_bucket, (int, float)) and self.per_bucket >= 0):
            raise ValueError(f"per_bucket must be a number of seconds >= 0; got "
                             f"{self.per_bucket!r}.")

    @property
    def ranks(self):
        return self.nodes * self.per_node


@dataclass
class Layout:
    """One way to train, as `plan` predicts it: `layout` (its name), `step_seconds`,
    `samples_per_second`, `efficiency` (samples per second over that of `ranks`
    independent devices), `settings` (the layout's parameters, e.g. `bucket_bytes`)
    and `note` (e.g. that it is asynchronous)."""

    layout: str
    step_seconds: float
    samples_per_second: float
    efficiency: float
    settings: dict = field(default_factory=dict)
    note: str = ""

    def to_dict(self):
        return asdict(self)


def _allreduce(cluster, nbytes, ranks_per_node=None):
    per_node = cluster.per_node if ranks_per_node is None else ranks_per_node
    if cluster.nodes == 1:
        return cost_model.allreduce_time(nbytes, per_node, cluster.intra)
    if per_node == 1:
        return cost_model.allreduce_time(nbytes, cluster.nodes, cluster.inter)
    return cost_model.hierarchical_allreduce_time(nbytes, cluster.nodes, per_node,
                                                  cluster.inter, cluster.intra)


def _best_bucket(work, cluster, gradient_bytes, ranks_per_node=None, compute=None):
    compute = work.step_seconds if compute is None else compute

    def step(bucket):
        return cost_model.data_parallel_step(
            compute, gradient_bytes, cluster.ranks, cluster.inter, bucket_bytes=bucket,
            overlap=cluster.overlap, per_bucket=cluster.per_bucket,
            allreduce=lambda n: _allreduce(cluster, n, ranks_per_node))

    return min(((step(b), b) for b in BUCKET_CHOICES), key=lambda pair: pair[0])


def _layout(name, seconds, samples, work, ranks, **settings):
    note = settings.pop("note", "")
    single = work.batch_per_rank / work.step_seconds
    return Layout(name, seconds, samples / seconds, samples / seconds / (ranks * single),
                  settings, note)


def _fits(work, cluster, split=1):
    if cluster.memory_bytes is None:
        return True
    return work.parameters * work.memory_bytes_per_parameter / split <= cluster.memory_bytes


def plan(work, cluster, micro_batches=8):
    """Which layout to train in: every layout that fits in memory, fastest first.

    Each layout's step is predicted with the alpha-beta cost model of
    `kdist.distribute.cost_model`. The layouts:

    - `data`: every rank holds the whole model; gradients are reduced in
      buckets of the size the model predicts fastest, within nodes first
      when nodes have several ranks.
    - `data, fp16 gradients`: the same with half the bytes on the wire.
    - `pipeline S x data R`: the model cut into S stages (2, 4, 8 or 16),
      R replicas of that pipeline trained data-parallel.
    - `tensor W x data N`: each layer split over a node's W ranks, the N
      nodes data parallel.
    - `parameter server`: one master per node (one in all when nodes have a
      single rank), the other ranks workers.
    - `gossip`: each rank averages with two ring neighbours.

    The last two are asynchronous in effect: as many samples per second buy
    less accuracy than synchronous training's. Pipelines and split layers are
    considered only when the workload gives `activation_bytes_per_sample`.

    `kdist plan` prints this list, and with it
    `kdist.distribute.planner.batch_for_efficiency(work, cluster, target=0.8,
    largest=2**14)`: the smallest batch per rank (the given one times a power
    of 2, up to `largest`) at which the best layout reaches `target`
    efficiency, or None.

    Args:
        work: a `Workload`: what one rank does per step.
        cluster: a `Cluster`: nodes, ranks per node, links and memory.
        micro_batches: the micro-batches per step the pipeline layouts are
            predicted with.

    Returns:
        A list of `Layout` records, fastest first, each with `layout` (its
            name, as above), `step_seconds`, `samples_per_second`, `efficiency`
            (samples per second over that of `ranks` independent devices),
            `settings` (e.g. `bucket_bytes`, `stages`, `masters`) and `note`;
            `to_dict()` gives one as a dict.

    Raises:
        ValueError: the model fits in no layout's memory; the message says
            how much it needs.

    Example:

        >>> from kdist.distribute import Cluster, Link, Workload, plan
        >>> work = Workload(parameters=25e6, step_seconds=0.2, batch_per_rank=32)
        >>> best = plan(work, Cluster(nodes=4, per_node=1, inter=Link.from_gbit(1, 50)))[0]
        >>> best.layout, round(best.efficiency, 2)
        ('data, fp16 gradients', 0.27)
    """
    ranks, batch = cluster.ranks, work.batch_per_rank
    layouts = []
    if _fits(work, cluster):
        for name, per_parameter in (("data", work.gradient_bytes_per_parameter),
                                    ("data, fp16 gradients", 2)):
            seconds, bucket = _best_bucket(work, cluster, work.parameters * per_parameter)
            layouts.append(_layout(name, seconds, ranks * batch, work, ranks,
                                   bucket_bytes=bucket, batch_per_rank=batch))
        if ranks > 1:
            # One master per node when nodes have ranks to spare, else one in all.
            masters = cluster.nodes if cluster.per_node > 1 else 1
            workers = ranks - masters
            seconds = cost_model.parameter_server_step(
                work.step_seconds, work.gradient_bytes, workers,
                cluster.inter if cluster.nodes > 1 else cluster.intra, masters=masters)
            seconds += 2 * cluster.per_bucket  # kdist's own work for a push and a pull
            layouts.append(_layout("parameter server", seconds, workers * batch, work, ranks,
                                   masters=masters, workers=workers,
                                   note="asynchronous: stale gradients"))
            link = cluster.inter if cluster.nodes > 1 else cluster.intra
            seconds = cost_model.gossip_step(work.step_seconds, work.gradient_bytes,
                                             min(2, ranks - 1), link)
            seconds += min(2, ranks - 1) * cluster.per_bucket  # one exchange per neighbour
            layouts.append(_layout("gossip", seconds, ranks * batch, work, ranks,
                                   neighbours=min(2, ranks - 1),
                                   note="ranks agree only on average"))
    if work.activation_bytes_per_sample is not None:
        boundary = work.activation_bytes_per_sample * batch
        for stages in (2, 4, 8, 16):
            if stages > min(work.layers, ranks) or ranks % stages:
                continue
            if not _fits(work, cluster, stages):
                continue
            link = cluster.intra if stages <= cluster.per_node else cluster.inter
            compute = cost_model.pipeline_step(work.step_seconds, stages, micro_batches,
                                               boundary, link)
            replicas = ranks // stages
            # Replicas reduce each stage's gradients: 1/stages of the bytes each.
            reduce = cost_model.allreduce_time(work.gradient_bytes / stages, replicas,
                                               cluster.inter if replicas > 1 else link)
            seconds = compute + reduce
            layouts.append(_layout(f"pipeline {stages} x data {replicas}", seconds,
                                   replicas * batch, work, ranks, stages=stages,
                                   micro_batches=micro_batches, batch_per_replica=batch))
        ways = cluster.per_node
        if 1 < ways <= work.layers and _fits(work, cluster, ways):
            compute = cost_model.tensor_parallel_step(work.step_seconds, ways, work.layers,
                                                      boundary, cluster.intra)
            reduce = (cost_model.allreduce_time(work.gradient_bytes / ways, cluster.nodes,
                                                cluster.inter) if cluster.nodes > 1 else 0.0)
            layouts.append(_layout(f"tensor {ways} x data {cluster.nodes}", compute + reduce,
                                   cluster.nodes * batch, work, ranks, ways=ways,
                                   batch_per_replica=batch))
    if not layouts:
        need = work.parameters * work.memory_bytes_per_parameter
        raise ValueError(
            f"No layout fits: the model needs {need / 2**30:.1f} GiB for its weights and "
            f"optimizer state and each rank has {cluster.memory_bytes / 2**30:.1f} GiB. Give "
            "activation_bytes_per_sample so that pipelines and split layers are considered.")
    return sorted(layouts, key=lambda layout: -layout.samples_per_second)


def measure_link(comm=None, sizes=(2**16, 2**20, 2**22, 2**24), repeats=3):
    """The `Link` fitted to allreduces timed over `comm` (the world by default): call it
    on every rank of `comm`, as any collective. Each size is reduced `repeats` times after
    one warm-up; the fastest time of each counts, and every rank takes the slowest rank's
    times, so that all fit the same link.

    Run across the nodes of the cluster (one rank per node), this is the link that
    `kdist plan --measure` plans with.

    Args:
        comm: the `kdist.comm.Communicator` to time (the world by default).
        sizes: payloads in bytes, two distinct ones at least.
        repeats: timed allreduces per size.

    Returns:
        The `Link` (`fit_link`), the same on every rank.

    Raises:
        ValueError: fewer than 2 ranks, or fewer than two distinct sizes.
    """
    import time

    import numpy as np

    from kdist.comm import processes
    from kdist.comm.communicator import Max

    comm = processes.world() if comm is None else comm
    repeats = whole_number(repeats, "repeats", minimum=1)
    sizes = [whole_number(n, "size", minimum=8) for n in sizes]
    if len(set(sizes)) < 2:
        raise ValueError("measure_link needs two distinct sizes at least.")
    if comm.size < 2:
        raise ValueError("measuring a link needs 2 or more ranks; start the command with "
                         "`kdist run -n 2` (one rank on each of two nodes).")
    best = []
    for nbytes in sizes:
        payload = np.ones(nbytes // 8, dtype=np.float64)
        comm.allreduce_(payload, label="link probe, warm-up")
        times = []
        for _ in range(repeats):
            comm.barrier()
            started = time.perf_counter()
            comm.allreduce_(payload, label=f"link probe, {nbytes} bytes")
            times.append(time.perf_counter() - started)
        best.append(min(times))
    slowest = np.asarray(best, dtype=np.float64)
    comm.allreduce_(slowest, op=Max, label="link probe, agreement")
    return cost_model.fit_link([n // 8 * 8 for n in sizes], list(slowest), comm.size)


def describe(layouts, limit=None):
    """The plan as a table (text)."""
    rows = [f"{'layout':26s} {'step ms':>9s} {'samples/s':>11s} {'efficiency':>10s}  settings"]
    for layout in layouts[:limit]:
        settings = ", ".join(f"{k}={_readable(k, v)}" for k, v in layout.settings.items())
        if layout.note:
            settings += f" ({layout.note})"
        rows.append(f"{layout.layout:26s} {layout.step_seconds * 1e3:9.2f} "
                    f"{layout.samples_per_second:11.1f} {layout.efficiency:10.2f}  {settings}")
    return "\n".join(rows)


def _readable(key, value):
    if key.endswith("bytes") and isinstance(value, (int, float)) and not math.isinf(value):
        return f"{value / 2**20:g} MiB"
    return value


def batch_for_efficiency(work, cluster, target=0.8, largest=2**14):
    """The smallest batch per rank (the given one times a power of 2, up to
    `largest`) at which the best layout reaches `target` efficiency, taking one
    device's step to grow in proportion to its batch; None if none does."""
    if not 0 < target <= 1:
        raise ValueError(f"target must lie in (0, 1]; got {target!r}.")
    batch = work.batch_per_rank
    while batch <= largest:
        scaled = Workload(**{**asdict(work), "batch_per_rank": batch,
                             "step_seconds": work.step_seconds * batch / work.batch_per_rank})
        if plan(scaled, cluster)[0].efficiency >= target:
            return batch
        batch *= 2
    return None
