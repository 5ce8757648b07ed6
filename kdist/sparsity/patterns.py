"""Which weights a mask keeps: one by one, in blocks, or N of every M.

Each function takes a kernel's values and gives a 0/1 float32 mask of the
same shape, computed in NumPy on every rank from the same values (so the
masks agree without communication). `mask_for` picks the function from a
pruned layer's settings.
"""

import numpy as np


def magnitude_mask(values, sparsity):
    """1 where a weight is among the `1 - sparsity` largest in magnitude, else 0.

    Ties at the threshold are all kept; at least one weight always is.

    >>> import numpy as np
    >>> magnitude_mask(np.array([0.1, -3.0, 0.5, 2.0]), 0.5)
    array([0., 1., 0., 1.], dtype=float32)
    """
    magnitudes = np.abs(np.asarray(values, dtype=np.float32))
    size = magnitudes.size
    keep = max(1, int(np.rint(np.float32(size) * np.float32(1.0 - sparsity))))
    threshold = np.partition(magnitudes, size - keep, axis=None)[size - keep]
    return (magnitudes >= threshold).astype(np.float32)


def block_mask(values, sparsity, block_size, pooling="AVG"):
    """Keeps or drops whole `block_size` blocks of a 2-D kernel, by their mean
    (`"AVG"`) or largest (`"MAX"`) magnitude.

    Blocks at the edges may be partial; an average counts only their weights.
    Kernels that are not 2-D once size-1 axes are dropped are pruned weight by
    weight, as in tensorflow-model-optimization.

    >>> import numpy as np
    >>> block_mask(np.array([[1.0, 1.0, 0.1, 0.2], [1.0, 1.0, 0.2, 0.1]]), 0.5, (2, 2))
    array([[1., 1., 0., 0.],
           [1., 1., 0., 0.]], dtype=float32)
    """
    values = np.asarray(values, dtype=np.float32)
    grid = np.squeeze(np.abs(values))
    if grid.ndim != 2 or tuple(block_size) == (1, 1):
        return magnitude_mask(values, sparsity)
    (rows, cols), (height, width) = grid.shape, block_size
    padding = ((0, -rows % height), (0, -cols % width))
    shape = ((rows + padding[0][1]) // height, height, (cols + padding[1][1]) // width, width)
    blocks = np.pad(grid, padding).reshape(shape)
    if pooling == "MAX":
        pooled = blocks.max(axis=(1, 3))
    else:
        counts = np.pad(np.ones_like(grid), padding).reshape(shape).sum(axis=(1, 3))
        pooled = blocks.sum(axis=(1, 3)) / counts
    kept = magnitude_mask(pooled, sparsity)
    mask = np.repeat(np.repeat(kept, height, axis=0), width, axis=1)[:rows, :cols]
    return mask.reshape(values.shape)


def n_of_m_mask(values, zeros, group):
    """`zeros` of every `group` consecutive input-channel weights set to zero,
    the smallest in magnitude (2:4 sparsity is `zeros=2, group=4`).

    Groups run along the input-channel axis (the second to last; the only one
    of a 1-D kernel), as sparse tensor cores and TFLite expect. A last,
    partial group is completed with zeros, which count towards `zeros`.

    >>> import numpy as np
    >>> n_of_m_mask(np.array([[0.1], [-3.0], [0.5], [2.0]]), 2, 4).ravel()
    array([0., 1., 0., 1.], dtype=float32)
    """
    values = np.asarray(values, dtype=np.float32)
    axis = -2 if values.ndim > 1 else -1
    moved = np.moveaxis(np.abs(values), axis, -1)
    channels = moved.shape[-1]
    padded = np.pad(moved, [(0, 0)] * (moved.ndim - 1) + [(0, -channels % group)])
    groups = padded.reshape(-1, group)
    smallest = np.argsort(groups, axis=1, kind="stable")[:, :zeros]
    mask = np.ones_like(groups)
    np.put_along_axis(mask, smallest, 0.0, axis=1)
    mask = mask.reshape(padded.shape)[..., :channels]
    return np.moveaxis(mask, -1, axis)


def check_pattern(block_size, block_pooling_type, sparsity_m_by_n):
    """Validated `(block_size, block_pooling_type, sparsity_m_by_n)`."""
    try:
        block_size = tuple(int(b) for b in block_size)
    except (TypeError, ValueError):
        block_size = ()
    if len(block_size) != 2 or min(block_size) < 1:
        raise ValueError(f"block_size must be two integers >= 1 (height, width); got "
                         f"{block_size!r}.")
    if block_pooling_type not in ("AVG", "MAX"):
        raise ValueError(f"block_pooling_type must be 'AVG' or 'MAX'; got "
                         f"{block_pooling_type!r}.")
    if sparsity_m_by_n is not None:
        try:
            zeros, group = (int(v) for v in sparsity_m_by_n)
        except (TypeError, ValueError):
            zeros = group = 0
        if not 0 < zeros < group:
            raise ValueError("sparsity_m_by_n must be (m, n) with 0 < m < n: m zeros in every "
                             f"n consecutive weights; got {sparsity_m_by_n!r}.")
        if block_size != (1, 1):
            raise ValueError("Give block_size or sparsity_m_by_n, not both.")
        sparsity_m_by_n = (zeros, group)
    return block_size, block_pooling_type, sparsity_m_by_n


def mask_for(values, sparsity, block_size=(1, 1), block_pooling_type="AVG",
             sparsity_m_by_n=None):
    """The mask a pruned layer with these settings takes at `sparsity`.

    With `sparsity_m_by_n` the pattern fixes the sparsity and `sparsity` is
    not used; the schedule still says when the mask changes.
    """
    if sparsity_m_by_n is not None:
        return n_of_m_mask(values, *sparsity_m_by_n)
    return block_mask(values, sparsity, block_size, block_pooling_type)
