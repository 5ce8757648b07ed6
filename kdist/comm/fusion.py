"""How gradients are grouped into fused collectives.

A model's gradients are many tensors; reducing each on its own pays MPI's
latency once per tensor. Consecutive tensors are grouped into buckets of at
most `bucket_bytes`, and each bucket travels in one collective.

One step's gradients, through `kdist.comm.tensors.TensorReducer` and then
`graph_ops.allreduce` (kdist's C++ op, else `Communicator.allreduce_many`):

    g0 g1 g2 g3 g4            model order; floating tensors, one dtype at a time
        | reversed: backpropagation produces the last layers' gradients first
        v
    [g4 g3] [g2] [g1 g0]      plan_buckets: consecutive runs of at most bucket_bytes
    bucket 0  1     2         (a larger tensor gets a bucket of its own)
        | each bucket as soon as its own tensors exist (in a graph): the
        | compression (fp16 casts; top-k gathers instead), then one allreduce:
        v
    pack buffer, reused:  | g4 * pre | g3 * pre | 1 |   the 1 only when averaging:
        | announce (op, dtype, count)                    it counts the ranks that
        | MPI_Allreduce in place                         trained (joined ones send 0)
        v
    | sum g4 | sum g3 | n |  ->  unpack: each slice * post / n, in its own shape
    The C++ op sends a tensor of 256 KiB or more past the buffer, reduced on its own.
"""

DEFAULT_BUCKET_BYTES = 64 * 1024 * 1024
# Between hosts a gradient travels in at least HOSTS_BUCKETS buckets of at least
# HOSTS_MIN_BUCKET_BYTES, so that all but the last can cross the network while the
# backward pass computes the earlier layers' gradients (docs/performance.md: a 0.6M
# convolutional net in one bucket hid nothing at 1 Gbit/s, in three about half).
HOSTS_BUCKETS = 4
HOSTS_MIN_BUCKET_BYTES = 1024 * 1024


def auto_bucket_bytes(total_bytes, spans_hosts):
    """The bucket size when none is given, for `total_bytes` of gradient: on one host
    DEFAULT_BUCKET_BYTES (one collective for most models: nothing to hide behind); between
    hosts a quarter of the gradient, between HOSTS_MIN_BUCKET_BYTES and
    DEFAULT_BUCKET_BYTES.

    >>> auto_bucket_bytes(40 * 2**20, spans_hosts=True) // 2**20
    10
    >>> auto_bucket_bytes(40 * 2**20, spans_hosts=False) // 2**20
    64
    """
    if not spans_hosts:
        return DEFAULT_BUCKET_BYTES
    share = -(-int(total_bytes) // HOSTS_BUCKETS)
    return min(DEFAULT_BUCKET_BYTES, max(HOSTS_MIN_BUCKET_BYTES, share))


def plan_buckets(sizes, bucket_bytes=DEFAULT_BUCKET_BYTES, itemsize=4):
    """Groups consecutive tensors into buckets of at most `bucket_bytes`.

    Returns a list of `(start, stop)` index ranges. A tensor larger than the
    bucket gets a bucket of its own.

    Args:
        sizes: each tensor's number of elements, in order.
        bucket_bytes: the most bytes per bucket; 64 MiB by default. It must be
            positive (`ValueError`).
        itemsize: the bytes per element.

    >>> plan_buckets([10, 10, 10], bucket_bytes=80)
    [(0, 2), (2, 3)]
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive; got {bucket_bytes}.")
    buckets, start, filled = [], 0, 0
    for i, n in enumerate(sizes):
        nbytes = int(n) * itemsize
        if i > start and filled + nbytes > bucket_bytes:
            buckets.append((start, i))
            start, filled = i, 0
        filled += nbytes
    if start < len(sizes):
        buckets.append((start, len(sizes)))
    return buckets


def block(rows, rank, size):
    """Rank `rank`'s rows of a reduce-scatter: `(start, stop)`.

    >>> [block(5, r, 2) for r in range(2)]
    [(0, 3), (3, 5)]
    """
    base, extra = divmod(int(rows), int(size))
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)
