"""How gradients are grouped into fused collectives.

A model's gradients are many tensors; reducing each on its own pays MPI's
latency once per tensor. Consecutive tensors are grouped into buckets of at
most `bucket_bytes`, and each bucket travels in one collective.
"""

DEFAULT_BUCKET_BYTES = 64 * 1024 * 1024


def plan_buckets(sizes, bucket_bytes=DEFAULT_BUCKET_BYTES, itemsize=4):
    """Groups consecutive tensors into buckets of at most `bucket_bytes`.

    Returns a list of `(start, stop)` index ranges. A tensor larger than the
    bucket gets a bucket of its own.

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
