"""Tensors of any shape sent to one neighbouring process: pipeline activations and gradients.

A pipeline stage sends each micro-batch's outputs to the next stage and its
input gradient to the previous one. The shapes change (the last micro-batch
of an epoch is smaller), so each message is a fixed-size header (count,
dtypes and shapes) followed by the raw buffers, read in place by MPI. Sends
never block: a stage goes on with its next micro-batch while the bytes
travel. Messages from one peer with one tag arrive in the order they were
sent, which is all the matching the schedules need. The link runs on its own
duplicate of the communicator, so its tags meet no other layer's.
"""

import time

import numpy as np

from kdist.comm.p2p import _wait, _wait_any
from kdist.comm.processes import _mpi

_MAX_TENSORS = 8
_MAX_RANK = 7
_HEADER = 1 + _MAX_TENSORS * (2 + _MAX_RANK)
_DTYPES = ["float32", "float16", "float64", "int32", "int64", "uint8", "bool", "int8",
           "bfloat16"]


def _dtype(name):
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _code(dtype):
    name = np.dtype(dtype).name
    if name not in _DTYPES:
        raise TypeError(f"Cannot send tensors of dtype {name} between stages; use one of "
                        f"{', '.join(_DTYPES)}.")
    return _DTYPES.index(name)


def _message(array):
    return [array.reshape(-1).view(np.uint8), _mpi().BYTE]


class StageLink:
    """Sends and receives lists of numpy arrays to and from other ranks of `comm`.

    Every rank of `comm` must create its link at the same time (the
    communicator is duplicated, a collective), and `close` it together.
    """

    def __init__(self, comm):
        if comm.mpi is None:
            raise ValueError("A pipeline of several stages needs an MPI job with one rank per "
                             "stage; start the script with kdist run -n N.")
        self._raw = comm.mpi.Dup()
        self.rank, self.size = comm.rank, comm.size
        self._in_flight = []  # (request, buffer kept alive until the send completes)
        self.bytes_sent = 0
        # Seconds blocked until a message's header came (the sender was not there yet),
        # and seconds taking in its buffers once it had.
        self.seconds_waiting = 0.0
        self.seconds_receiving = 0.0

    def send(self, arrays, dest, tag):
        """Starts sending `arrays` (numpy arrays) to rank `dest`; returns at once."""
        arrays = [np.ascontiguousarray(a) for a in arrays]
        if len(arrays) > _MAX_TENSORS or any(a.ndim > _MAX_RANK for a in arrays):
            raise ValueError(f"A stage can pass on at most {_MAX_TENSORS} tensors of at most "
                             f"{_MAX_RANK} dimensions; got shapes {[a.shape for a in arrays]}.")
        header = np.zeros(_HEADER, np.int64)
        header[0] = len(arrays)
        for index, array in enumerate(arrays):
            start = 1 + index * (2 + _MAX_RANK)
            header[start] = _code(array.dtype)
            header[start + 1] = array.ndim
            header[start + 2:start + 2 + array.ndim] = array.shape
        for buffer in [header] + [a for a in arrays if a.size]:
            request = self._raw.Isend(_message(buffer), dest=dest, tag=tag)
            self._in_flight.append((request, buffer))
            self.bytes_sent += buffer.nbytes
        self._forget_finished()

    def recv(self, source, tag):
        """Waits for the arrays that rank `source` sent with `tag`; returns them as a list."""
        header = np.zeros(_HEADER, np.int64)
        start = time.perf_counter()
        _wait(self._raw.Irecv(_message(header), source=source, tag=tag),
              f"a pipeline message (tag {tag}) from rank {source}")
        arrived = time.perf_counter()
        self.seconds_waiting += arrived - start
        arrays = []
        for index in range(int(header[0])):
            start = 1 + index * (2 + _MAX_RANK)
            shape = tuple(int(d) for d in header[start + 2:start + 2 + header[start + 1]])
            arrays.append(np.empty(shape, _dtype(_DTYPES[header[start]])))
        requests = [self._raw.Irecv(_message(a), source=source, tag=tag)
                    for a in arrays if a.size]
        while requests:
            index = _wait_any(requests, f"a pipeline message (tag {tag}) from rank {source}")
            requests.pop(index)
        self.seconds_receiving += time.perf_counter() - arrived
        return arrays

    def _forget_finished(self):
        MPI = _mpi()
        self._in_flight = [(r, b) for r, b in self._in_flight if not MPI.Request.Test(r)]

    def flush(self):
        """Waits until every send has left this process's buffers."""
        while self._in_flight:
            request, _ = self._in_flight.pop()
            _wait(request, "a pipeline message to be taken")

    def close(self):
        """Finishes the sends and frees the duplicate communicator (together on every rank)."""
        if self._raw is None:
            return
        self.flush()
        self._raw.Free()
        self._raw = None
