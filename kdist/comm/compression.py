"""Gradient compression: how a fused float32 buffer is summed across ranks.

Every compressor sums a flat float32 send buffer over the ranks into a result
buffer. The buffer's last element is a participation count (1 from a rank that
is training, 0 from a rank that has joined); compressors must sum it exactly so
that the average divides by the number of ranks that really contributed.
When averaging, values arrive already divided by the number of ranks, which
also keeps float16 sums in range; a plain sum in float16 can overflow.

- `Compression.none`: plain float32 allreduce.
- `Compression.fp16`: values are sent as float16 (half the bytes), summed in
  float16 and restored to float32.
- `Compression.topk(ratio)`: each rank sends only its largest `ratio` fraction
  of entries (indices and values); what it leaves out is kept as a residual
  and added to its next gradient (error feedback), so nothing is lost, only
  delayed.
"""

import numpy as np


class Compressor:
    """Base class: how one fused buffer is summed across a communicator."""

    name = "none"

    def sum_(self, comm, send, recv, key=None):
        """Sums `send` (float32, last element a count) over `comm` into `recv`.

        `key` names the buffer for compressors that keep state between steps;
        None means "keep no state" (a joined rank's zeros).
        """
        raise NotImplementedError

    def get_config(self):
        return {"name": self.name}

    def __repr__(self):
        return f"Compression.{self.name}"


class NoneCompressor(Compressor):
    name = "none"

    def sum_(self, comm, send, recv, key=None):
        return comm.allreduce_into(send, recv)


_FP16_SUM = None


def _fp16_sum_op():
    """An MPI reduction that adds float16 values (MPI has no float16 type)."""
    global _FP16_SUM
    if _FP16_SUM is None:
        from mpi4py import MPI

        def add(inbuf, inoutbuf, datatype):
            accumulated = np.frombuffer(inoutbuf, dtype=np.float16)
            np.add(accumulated, np.frombuffer(inbuf, dtype=np.float16), out=accumulated)

        _FP16_SUM = MPI.Op.Create(add, commute=True)
    return _FP16_SUM


class FP16Compressor(Compressor):
    name = "fp16"

    def sum_(self, comm, send, recv, key=None):
        half = send.astype(np.float16)
        if comm.size > 1:
            from mpi4py import MPI

            comm.allreduce_op_(half.view(np.uint16), _fp16_sum_op(), MPI.UINT16_T)
        np.copyto(recv, half, casting="unsafe")
        return recv


class TopKCompressor(Compressor):
    """Sends the largest `ratio` fraction of entries; keeps the rest for later.

    Example:

    >>> import kdist
    >>> compression = kdist.Compression.topk(ratio=0.05)
    >>> compression.ratio
    0.05
    """

    name = "topk"

    def __init__(self, ratio=0.01):
        if not 0.0 < float(ratio) <= 1.0:
            raise ValueError(f"top-k compression needs 0 < ratio <= 1; got ratio={ratio}.")
        self.ratio = float(ratio)
        self._residuals = {}

    def __call__(self, ratio=0.01):
        """Returns a top-k compressor with another ratio: `Compression.topk(0.1)`."""
        return TopKCompressor(ratio)

    def residual(self, key):
        """The error-feedback residual kept for buffer `key` (None before first use)."""
        return self._residuals.get(key)

    def sum_(self, comm, send, recv, key=None):
        values = send[:-1]
        if key is not None:
            residual = self._residuals.get(key)
            if residual is None or residual.shape != values.shape:
                residual = self._residuals[key] = np.zeros_like(values)
            values = values + residual
        n = values.shape[0]
        k = max(1, int(round(self.ratio * n)))
        if k >= n:
            chosen = np.arange(n)
        else:
            chosen = np.argpartition(np.abs(values), n - k)[n - k:]
        message = np.empty((chosen.shape[0] + 1, 2), dtype=np.int32)
        message[:-1, 0] = chosen
        message[:-1, 1] = values[chosen].view(np.int32)
        message[-1, 0] = n
        message[-1, 1] = send[-1:].view(np.int32)[0]
        if key is not None:
            residual[...] = values
            residual[chosen] = 0.0
            if not np.isfinite(residual).all():
                # An overflowing step is skipped; carrying its inf/NaN on would
                # make every later step overflow too.
                residual[...] = 0.0
        everyone = comm.allgather_rows(message)
        recv[...] = 0.0
        np.add.at(recv, everyone[:, 0], everyone[:, 1].view(np.float32))
        return recv

    def get_config(self):
        return {"name": self.name, "ratio": self.ratio}

    def __repr__(self):
        return f"Compression.topk(ratio={self.ratio:g})"


class Compression:
    """The gradient compression modes, named as in Horovod.

    Example:

    >>> import keras, kdist
    >>> opt = kdist.DistributedOptimizer(keras.optimizers.SGD(0.1),
    ...                                  compression=kdist.Compression.fp16)
    """

    none = NoneCompressor()
    fp16 = FP16Compressor()
    topk = TopKCompressor()


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
