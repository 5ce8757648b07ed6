"""Point-to-point messages of fixed-size byte buffers, for parameter servers.

A server keeps one receive outstanding per peer (`Mailbox`) and serves
whichever peer's message lands first; a client sends one buffer to each of
its servers and waits for their replies (`exchange`). Buffers are numpy
arrays that MPI reads and writes in place, so a message of any size costs no
extra copy in Python.
Small picklable objects (per-epoch logs) travel beside them on another tag
(`send_object`, `recv_object`). Every wait shows in the watchdog's stall reports and
counts towards `KDIST_COLLECTIVE_TIMEOUT`, and a long wait sleeps between tests
instead of holding a core. Everything here needs an MPI job of at least 2 ranks
(`ValueError` in a world of one).

Under Open MPI's fault tolerance (`mpiexec --with-ft ulfm`), a peer that dies
surfaces as `PeerFailed` naming it, so a server can carry on without it. The
failure shows about a second after the death with the failure detector's own
thread (`--mca mpi_ft_detector_thread true`), else once the server idles.
"""

import time

import numpy as np

from kdist.comm import watchdog
from kdist.comm.processes import _mpi


def _raw(comm):
    if comm.mpi is None:
        raise ValueError("Point-to-point messages need an MPI job of at least 2 ranks; "
                         "start the script with mpiexec -n N (N >= 2) or kdist run -n N.")
    return comm.mpi


class PeerFailed(RuntimeError):
    """Peers of a `Mailbox` died (seen only when MPI runs with fault tolerance)."""

    def __init__(self, ranks):
        self.ranks = sorted(ranks)
        super().__init__(f"process(es) {self.ranks} failed")


def _is_process_failure(error):
    MPI = _mpi()
    codes = {getattr(MPI, "ERR_PROC_FAILED", None), getattr(MPI, "ERR_PROC_FAILED_PENDING", None)}
    return isinstance(error, MPI.Exception) and error.Get_error_class() in codes


def failed_ranks(comm):
    """The ranks of `comm` that MPI knows have died; acknowledges them."""
    MPI = _mpi()
    raw = _raw(comm)
    group = raw.Get_failed()
    raw.Ack_failed()
    if group.Get_size() == 0:
        return []
    return list(MPI.Group.Translate_ranks(group, list(range(group.Get_size())),
                                          raw.Get_group()))


def _bytes(buffer):
    return [buffer.reshape(-1).view(np.uint8), _mpi().BYTE]


class Mailbox:
    """One outstanding receive per peer into that peer's own buffer.

    Args:
        comm: the `kdist.comm.Communicator` the peers belong to.
        buffers: peer rank (in `comm`) -> the contiguous numpy buffer that
            peer's messages land in.
        tag: the MPI tag the peers send with.
    """

    def __init__(self, comm, buffers, tag):
        self._comm = _raw(comm)
        self._comm_wrapper = comm
        self.peers = list(buffers)
        self.tag = tag
        self.buffers = dict(buffers)
        self._requests = [_mpi().REQUEST_NULL] * len(self.peers)
        for index in range(len(self.peers)):
            self.rearm(self.peers[index])

    def rearm(self, peer):
        """Posts the next receive from `peer` into its buffer."""
        index = self.peers.index(peer)
        self._requests[index] = self._comm.Irecv(_bytes(self.buffers[peer]), source=peer,
                                                 tag=self.tag)

    def wait_any(self):
        """Blocks until some peer's message arrived; returns that peer.

        Returns None when no receive is outstanding any more. Under Open MPI's fault
        tolerance, raises `PeerFailed` (with `.ranks`) when peers died; their
        receives are dropped.
        """
        MPI = _mpi()
        try:
            index = _wait_any(self._requests, f"a message from any of ranks {self.peers}")
        except MPI.Exception as error:
            if not _is_process_failure(error):
                raise
            dead = [p for p in failed_ranks(self._comm_wrapper) if p in self.peers]
            for peer in dead:
                self._requests[self.peers.index(peer)] = MPI.REQUEST_NULL
            raise PeerFailed(dead) from error
        if index == MPI.UNDEFINED:
            return None
        self._requests[index] = MPI.REQUEST_NULL
        return self.peers[index]

    def close(self):
        """Cancels the receives that are still outstanding."""
        MPI = _mpi()
        for index, request in enumerate(self._requests):
            if request != MPI.REQUEST_NULL:
                request.Cancel()
                request.Wait()
                self._requests[index] = MPI.REQUEST_NULL


class Outbox:
    """Non-blocking sends, at most one in flight per peer.

    Args:
        comm: the `kdist.comm.Communicator` the peers belong to.
        tag: the MPI tag to send with.
    """

    def __init__(self, comm, tag):
        self._comm = _raw(comm)
        self.tag = tag
        self._requests = {}

    def wait(self, peer):
        """Returns once the last send to `peer` finished, so its buffer may change."""
        previous = self._requests.pop(peer, None)
        if previous is not None:
            _wait(previous, f"sending to rank {peer}")

    def forget(self, peer):
        """Drops the send to a peer that died; MPI completes it with an error."""
        self._requests.pop(peer, None)

    def send(self, peer, buffer):
        """Starts sending `buffer` to `peer`; the buffer must stay untouched until
        `wait(peer)`, the next `send` to the same peer, or `flush`."""
        self.wait(peer)
        self._requests[peer] = self._comm.Isend(_bytes(buffer), dest=peer, tag=self.tag)

    def flush(self):
        """Returns once every send in flight has finished."""
        for peer, request in self._requests.items():
            _wait(request, f"sending to rank {peer}")
        self._requests.clear()


def exchange(comm, peers, messages, replies, up_tag, down_tag):
    """Sends `messages[i]` to `peers[i]` and waits for each one's `replies[i]`
    (numpy buffers). Every send and receive is posted before any is waited
    for, so several peers serve in parallel."""
    raw = _raw(comm)
    receives = [raw.Irecv(_bytes(reply), source=peer, tag=down_tag)
                for peer, reply in zip(peers, replies)]
    sends = [raw.Isend(_bytes(message), dest=peer, tag=up_tag)
             for peer, message in zip(peers, messages)]
    for peer, request in zip(peers, sends):
        _wait(request, f"sending to rank {peer}")
    for peer, request in zip(peers, receives):
        _wait(request, f"the reply of rank {peer}")
    return replies


def _wait(request, what):
    """Completes one request, visible to the watchdog and without holding a core."""
    _wait_any([request], what)


def _wait_any(requests, what):
    """Index of the first request of `requests` to complete (MPI.UNDEFINED if none is active).

    Tests in a loop for the first millisecond, then sleeps between tests with a
    growing pause, so a rank that waits long (a server between updates) leaves
    the core to others. The pause stops at 0.2 ms for the first 50 ms of a wait:
    a worker waiting for the reply to a 10M-parameter update (a few ms) would
    otherwise wake up to 1 ms late, which cost the master over 40% of its time
    in `benchmarks/ps_throughput.py`. A longer wait (a master whose workers take
    a tenth of a second per step) is rarely late by a millisecond, so its
    pause grows to 2 ms and its waiting costs about 1% of a core, not 8%.
    """
    MPI = _mpi()
    with watchdog.waiting(what):
        start, pause, longest = time.monotonic(), 20e-6, 2e-4
        while True:
            index, done = MPI.Request.Testany(requests)
            if done:
                return index
            waited = time.monotonic() - start
            if waited > 1e-3:
                if waited > 5e-2:
                    longest = 2e-3
                time.sleep(pause)
                pause = min(pause * 2, longest)


def send_object(comm, peer, obj, tag):
    """Sends a small picklable object to rank `peer` of `comm` (blocking)."""
    _raw(comm).send(obj, dest=peer, tag=tag)


def recv_object(comm, peer, tag):
    """Receives the object that rank `peer` sent with `tag` (a wait the watchdog sees)."""
    with watchdog.waiting(f"an object from rank {peer}"):
        return _raw(comm).recv(source=peer, tag=tag)


def try_recv_object(comm, peer, tag):
    """`(True, obj)` if `peer` has sent this rank an object with `tag`, else `(False, None)`.

    Under fault tolerance, raises `PeerFailed` once `peer` is known dead.
    """
    raw = _raw(comm)
    try:
        if not raw.Iprobe(source=peer, tag=tag):
            return False, None
        return True, raw.recv(source=peer, tag=tag)
    except _mpi().Exception as error:
        if _is_process_failure(error):
            raise PeerFailed([peer]) from error
        raise


def poll_object(comm, tag, poll_seconds=0.05):
    """`(source, obj)` of the next object sent to this rank with `tag`, from anyone.

    Polls with `Iprobe` and sleeps in between, so a rank that mostly waits
    (a search's master) leaves the cores to the ranks that compute; a
    blocking receive would spin on one.
    """
    import time

    raw = _raw(comm)
    mpi = _mpi()
    status = mpi.Status()
    while not raw.Iprobe(source=mpi.ANY_SOURCE, tag=tag, status=status):
        time.sleep(poll_seconds)
    source = status.Get_source()
    return source, raw.recv(source=source, tag=tag)
