"""Vectors exchanged with a few neighbours, waiting for them or not.

Decentralised training averages each rank's weights with its neighbours' on
a sparse graph. `NeighbourExchange` moves one flat numpy vector per rank:
`exchange` sends this rank's to every neighbour and waits for all of theirs
(synchronous gossip); `offer` sends without waiting and returns whichever
neighbours' vectors have arrived since the last call (asynchronous gossip,
where no rank waits for a slow neighbour). The exchange runs on its own
duplicate of the communicator, so its messages never meet another layer's.
"""

import time

import numpy as np

from kdist.comm import watchdog
from kdist.comm.processes import _mpi

_TAG = 41


class NeighbourExchange:
    """Sends and receives vectors of `length` values of `dtype` to and from `neighbours`.

    Every rank of `comm` must create its exchange at the same time (the
    communicator is duplicated, a collective), and `close` it at the same
    time. `neighbours` must be symmetric: when j is among i's, i is among j's.

    Args:
        comm: the `kdist.comm.Communicator` the neighbours' ranks belong to.
        neighbours: this rank's neighbours (ranks of `comm`).
        length: values per vector.
        dtype: their numpy dtype.
    """

    def __init__(self, comm, neighbours, length, dtype="float32"):
        if comm.mpi is None:
            raise ValueError("Exchanging with neighbours needs an MPI job of at least 2 "
                             "ranks; start the script with kdist run -n N (N >= 2).")
        self.neighbours = sorted(int(n) for n in neighbours)
        if comm.rank in self.neighbours or not all(0 <= n < comm.size
                                                   for n in self.neighbours):
            raise ValueError(f"Rank {comm.rank}'s neighbours {self.neighbours} must be other "
                             f"ranks of the communicator (0 to {comm.size - 1}).")
        self._raw = comm.mpi.Dup()
        self.dtype = np.dtype(dtype)
        self._outgoing = np.zeros(length, self.dtype)
        self.length_bytes = self._outgoing.nbytes
        self._incoming = {n: np.zeros(length, self.dtype) for n in self.neighbours}
        self._latest = {n: np.zeros(length, self.dtype) for n in self.neighbours}
        self._pending = {}  # per neighbour, so that a slow one holds back no other
        self._receives = {}
        self._sends = {}
        self.received = {n: 0 for n in self.neighbours}
        self.sent = 0  # vectors sent, one per neighbour per round
        self.skipped_sends = 0

    def _message(self, buffer):
        return [buffer.view(np.uint8), _mpi().BYTE]

    def exchange(self, vector):
        """Sends `vector` to every neighbour; returns `{neighbour: its vector}` once all came."""
        if self._receives or self._sends:
            raise RuntimeError("exchange() and offer() cannot be mixed on one "
                               "NeighbourExchange.")
        np.copyto(self._outgoing, np.asarray(vector, self.dtype).reshape(-1))
        requests = [self._raw.Irecv(self._message(self._incoming[n]), source=n, tag=_TAG)
                    for n in self.neighbours]
        requests += [self._raw.Isend(self._message(self._outgoing), dest=n, tag=_TAG)
                     for n in self.neighbours]
        _wait_all(requests, f"the weights of neighbours {self.neighbours}")
        self.sent += len(self.neighbours)
        for n in self.neighbours:
            self.received[n] += 1
        return dict(self._incoming)

    def offer(self, vector):
        """Sends `vector` to each neighbour that has taken the previous copy, without
        waiting; returns `{neighbour: vector}` for the neighbours whose vectors
        arrived since the last call (the newest of each)."""
        if not self._receives:
            self._pending = {n: np.zeros_like(self._outgoing) for n in self.neighbours}
            for n in self.neighbours:
                self._receives[n] = self._raw.Irecv(self._message(self._incoming[n]),
                                                    source=n, tag=_TAG)
        fresh = {}
        for n in self.neighbours:
            # Drain: a faster neighbour may have sent several since the last call.
            while self._receives[n].Test():
                np.copyto(self._latest[n], self._incoming[n])
                fresh[n] = self._latest[n]
                self.received[n] += 1
                self._receives[n] = self._raw.Irecv(self._message(self._incoming[n]),
                                                    source=n, tag=_TAG)
        vector = np.asarray(vector, self.dtype).reshape(-1)
        for n in self.neighbours:
            if n in self._sends and not self._sends[n].Test():
                # This neighbour has not taken the previous copy yet: sending again
                # would overwrite what is in flight, and it will get a newer one later.
                self.skipped_sends += 1
                continue
            np.copyto(self._pending[n], vector)
            self._sends[n] = self._raw.Isend(self._message(self._pending[n]), dest=n, tag=_TAG)
            self.sent += 1
        return dict(fresh)

    def close(self):
        """Finishes the messages in flight and frees the communicator (all ranks together)."""
        MPI = _mpi()
        if self._sends or self._receives:
            if not self._receives:
                self._receives = {n: MPI.REQUEST_NULL for n in self.neighbours}
            # Keep receiving while our own sends complete and every rank gets
            # here; only then can no message still be on its way to us.
            barrier = None
            with watchdog.waiting(f"neighbours {self.neighbours} to finish their exchanges"):
                pause = 20e-6
                while True:
                    for n, request in list(self._receives.items()):
                        if request != MPI.REQUEST_NULL and request.Test():
                            self._receives[n] = self._raw.Irecv(
                                self._message(self._incoming[n]), source=n, tag=_TAG)
                    if barrier is None and all(r.Test() for r in self._sends.values()):
                        barrier = self._raw.Ibarrier()
                    if barrier is not None and barrier.Test():
                        break
                    time.sleep(pause)
                    pause = min(pause * 2, 1e-3)
            for n, request in self._receives.items():
                if request != MPI.REQUEST_NULL:
                    request.Cancel()
                    request.Wait()
                # Copies that arrived unmatched would otherwise outlive the
                # communicator, and could meet a later one that reuses its context.
                while self._raw.Iprobe(source=n, tag=_TAG):
                    self._raw.Recv(self._message(self._incoming[n]), source=n, tag=_TAG)
        self._receives, self._sends = {}, {}
        if self._raw is not None:
            self._raw.Free()
            self._raw = None


def _wait_all(requests, what):
    MPI = _mpi()
    with watchdog.waiting(what):
        start, pause = time.monotonic(), 20e-6
        while not MPI.Request.Testall(requests):
            if time.monotonic() - start > 1e-3:
                time.sleep(pause)
                pause = min(pause * 2, 1e-3)
