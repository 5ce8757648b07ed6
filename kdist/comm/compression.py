"""Gradient compression: how a list of float tensors is summed or averaged across ranks.

A compressor turns a list of tensors into fewer bytes on the wire and back,
in TensorFlow ops around one of kdist's collectives, so it works eagerly, in
graphs and under XLA:

- `Compression.none`: the tensors as they are.
- `Compression.fp16`: float16 on the wire (half the bytes), summed in float16;
  when averaging, values are divided by the number of ranks first, which
  keeps the float16 sum in range.
- `Compression.topk(ratio)`: each rank sends only its largest `ratio`
  fraction of entries (indices and values, gathered from every rank); what it
  leaves out is kept as a residual and added to its next gradient (error
  feedback), so nothing is lost, only delayed.
"""


class Compressor:
    """Base class: sums or averages a list of floating tensors over a communicator."""

    name = "none"

    def reduce(self, tensors, comm, average, prescale=1.0, postscale=1.0, label="", key=None):
        """Returns `reduce(t * prescale) * postscale` for each tensor, divided by the
        number of contributing ranks with `average`.

        `key` names the list for compressors that keep state between steps
        (None: keep none).
        """
        from kdist.comm import graph_ops

        return _by_dtype(tensors, lambda group: graph_ops.allreduce(
            group, comm, average=average, prescale=prescale, postscale=postscale, label=label))

    def compress(self, tensor):
        """Horovod's compressor interface: `(the tensor as it travels, context)`."""
        return tensor, None

    def decompress(self, tensor, ctx):
        """The inverse of `compress`, given the context it returned."""
        return tensor

    def get_config(self):
        return {"name": self.name}

    def __repr__(self):
        return f"Compression.{self.name}"


class NoneCompressor(Compressor):
    name = "none"


class FP16Compressor(Compressor):
    name = "fp16"

    def compress(self, tensor):
        """Floating tensors travel as float16; others as they are."""
        import tensorflow as tf

        tensor = tf.convert_to_tensor(tensor)
        if tensor.dtype.is_floating:
            return tf.cast(tensor, tf.float16), tensor.dtype
        return tensor, None

    def decompress(self, tensor, ctx):
        import tensorflow as tf

        return tensor if ctx is None else tf.cast(tensor, ctx)

    def reduce(self, tensors, comm, average, prescale=1.0, postscale=1.0, label="", key=None):
        import tensorflow as tf

        from kdist.comm import graph_ops

        tensors = [tf.convert_to_tensor(t) for t in tensors]
        half = [tf.cast(t, tf.float16) for t in tensors]
        if average and comm.size > 1:
            # Divide before summing so that the float16 sum stays in range.
            prescale, postscale = prescale / comm.size, postscale * comm.size
        reduced = graph_ops.allreduce(half, comm, average=average, prescale=prescale,
                                      postscale=postscale, label=f"{label}, fp16")
        return [tf.cast(r, t.dtype) for r, t in zip(reduced, tensors)]


class TopKCompressor(Compressor):
    """Sends the largest `ratio` fraction of entries; keeps the rest for later.

    Example:

        >>> import kdist
        >>> compression = kdist.Compression.topk(ratio=0.05)
        >>> compression.ratio
        0.05
    """

    name = "topk"

    def compress(self, tensor):
        raise NotImplementedError(
            "Top-k compression happens inside the reduction, where it keeps each tensor's "
            "residual for the next step; use it through DistributedOptimizer(compression=...) "
            "or allreduce(compression=...), not compress/decompress.")

    def __init__(self, ratio=0.01):
        if not 0.0 < float(ratio) <= 1.0:
            raise ValueError(f"top-k compression needs 0 < ratio <= 1; got ratio={ratio}.")
        self.ratio = float(ratio)
        self._residuals = {}

    def __call__(self, ratio=0.01):
        """Returns a top-k compressor with another ratio: `Compression.topk(0.1)`."""
        return TopKCompressor(ratio)

    def residual(self, key):
        """The error-feedback residual kept for `key` (None before first use)."""
        return self._residuals.get(key)

    def _residual_variable(self, key, size):
        import tensorflow as tf

        variable = self._residuals.get(key)
        if variable is None or variable.shape[0] != size:
            with tf.init_scope():
                variable = tf.Variable(tf.zeros([size], tf.float32), trainable=False,
                                       name="topk_residual")
            self._residuals[key] = variable
        return variable

    def reduce(self, tensors, comm, average, prescale=1.0, postscale=1.0, label="", key=None):
        import tensorflow as tf

        from kdist.comm import graph_ops

        tensors = [tf.convert_to_tensor(t) for t in tensors]
        sizes = [int(t.shape.num_elements()) for t in tensors]
        n = sum(sizes)
        values = tf.concat([tf.reshape(tf.cast(t, tf.float32), [-1]) for t in tensors], 0)
        values = values * prescale
        residual = self._residual_variable(key, n) if key is not None else None
        if residual is not None:
            values = values + residual
        k = max(1, int(round(self.ratio * n)))
        chosen = tf.math.top_k(tf.abs(values), k=k, sorted=False).indices
        picked = tf.gather(values, chosen)
        # One message per rank: k rows (index, value bits), then (n, count bits).
        message = tf.concat([
            tf.stack([chosen, tf.bitcast(picked, tf.int32)], axis=1),
            tf.constant([[n, 0x3F800000]], tf.int32)], axis=0)  # 0x3F800000 is 1.0f
        everyone = graph_ops.allgather(message, comm, label=f"{label}, top-k")
        # Row index n collects the count of contributing ranks; zero rows add nothing.
        summed = tf.math.unsorted_segment_sum(tf.bitcast(everyone[:, 1], tf.float32),
                                              everyone[:, 0], num_segments=n + 1)
        if residual is not None:
            left = tf.tensor_scatter_nd_update(values, chosen[:, None], tf.zeros([k]))
            finite = tf.reduce_all(tf.math.is_finite(left))
            # An overflowing step is skipped; carrying its inf/NaN on would spoil later ones.
            residual.assign(tf.where(finite, left, tf.zeros_like(left)))
        factor = tf.constant(postscale, tf.float32)
        if average:
            factor = factor / tf.maximum(summed[n], 1.0)
        reduced = summed[:n] * factor
        results, offset = [], 0
        for t, size in zip(tensors, sizes):
            results.append(tf.cast(tf.reshape(reduced[offset:offset + size], t.shape), t.dtype))
            offset += size
        return results

    def get_config(self):
        return {"name": self.name, "ratio": self.ratio}

    def __repr__(self):
        return f"Compression.topk(ratio={self.ratio:g})"


def _by_dtype(tensors, reduce_group):
    """Applies `reduce_group` to the tensors of each dtype; returns results in order."""
    import tensorflow as tf

    tensors = [tf.convert_to_tensor(t) for t in tensors]
    results = [None] * len(tensors)
    groups = {}
    for index, t in enumerate(tensors):
        groups.setdefault(t.dtype, []).append(index)
    for indices in groups.values():
        for index, result in zip(indices, reduce_group([tensors[i] for i in indices])):
            results[index] = result
    return results


class Compression:
    """The gradient compression modes, named as in Horovod.

    For the `compression=` of `DistributedOptimizer`, `MPIStrategy`,
    `kdist.comm.TensorReducer` and the reducing collectives (`kdist.allreduce`,
    `grouped_allreduce`, `reducescatter`, `grouped_reducescatter`):

    - `Compression.none` (the default): the tensors travel as they are.
    - `Compression.fp16`: float16 on the wire, half the bytes of float32, summed in
      float16 (divided by the number of ranks first when averaging, which keeps the sum
      in range) and returned in each tensor's dtype.
    - `Compression.topk(ratio=0.01)`: each rank sends its largest `ratio` fraction of
      entries, as (index, value) pairs gathered from every rank; the rest is kept as a
      residual and added to its next gradient (error feedback), so nothing is lost,
      only delayed.

    `compression=` also takes a mode's name (`"none"`, `"fp16"`, `"topk"`) or its
    config (`{"name": "topk", "ratio": 0.05}`); anything else raises `ValueError`.
    When to use which: "Compression" in the data-parallel guide.

    A mode works in TensorFlow ops around kdist's collectives, so it runs eagerly, in
    graphs and under XLA. Every mode has:

    - `reduce(tensors, comm, average, prescale=1.0, postscale=1.0, label="",
      key=None)`: sums (or averages, over the ranks that contributed) a list of
      floating tensors over a `kdist.comm.Communicator`, returning
      `reduce(t * prescale) * postscale` for each; `key` names the list whose residual
      top-k keeps (None: keep none);
    - Horovod's compressor interface: `compress(tensor)` returns `(the tensor as sent,
      context)` and `decompress(tensor, context)` undoes it. `fp16` casts floating
      tensors to float16 and back and leaves the others alone; `none` changes
      nothing; top-k, which works inside the reduction, raises `NotImplementedError`;
    - `name` (`"none"`, `"fp16"`, `"topk"`) and `get_config()`.

    `Compression.topk` is itself a top-k compressor with `ratio=0.01`; calling it
    returns one with another ratio, which must satisfy `0 < ratio <= 1`
    (`ValueError`). A top-k compressor has `ratio` and `residual(key)`: the residual
    kept for a key, a float32 `tf.Variable`, or None before first use.

    Example:

        >>> import kdist
        >>> kdist.Compression.topk(ratio=0.05).ratio
        0.05
        >>> kdist.Compression.fp16.get_config()
        {'name': 'fp16'}
        >>> import keras
        >>> opt = kdist.DistributedOptimizer(keras.optimizers.SGD(0.1),
        ...                                  compression=kdist.Compression.fp16)
    """

    none = NoneCompressor()
    """The tensors travel as they are."""
    fp16 = FP16Compressor()
    """The tensors travel and are summed as float16, and come back in their own dtype."""
    topk = TopKCompressor()
    """Top-k sparsification with error feedback, `ratio=0.01`; `Compression.topk(ratio)`
    gives another ratio."""


def get(identifier):
    """Returns a compressor from a compressor, a name, or a config dict."""
    if isinstance(identifier, Compressor):
        return identifier
    if identifier is None:
        return Compression.none
    if isinstance(identifier, str):
        identifier = {"name": identifier}
    if isinstance(identifier, dict):
        name = identifier.get("name")
        if name == "none":
            return Compression.none
        if name == "fp16":
            return Compression.fp16
        if name == "topk":
            return TopKCompressor(identifier.get("ratio", 0.01))
    raise ValueError(
        f"Unknown compression {identifier!r}; use kdist.Compression.none, "
        "kdist.Compression.fp16 or kdist.Compression.topk(ratio).")
