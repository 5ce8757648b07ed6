"""Ranks asking each other what they are doing, for the watchdog's reports.

Each rank's monitor thread keeps a receive posted on a communicator of its
own and answers questions with a small JSON value (the watchdog sends what
this rank is doing: running, waiting for other ranks, moving a collective's
data, or leaving the job, with the wait's name and length). A rank that asks
and hears nothing back within a few seconds reports the silent ranks as
stopped or dead: a process stopped by a signal or killed cannot answer, while
one that computes or waits still does.
"""

import json
import time

import numpy as np

_QUERY_TAG = 1
_REPLY_TAG = 1000
_REPLY_BYTES = 512


def _mpi():
    from mpi4py import MPI

    return MPI


def _cancel(request, wait=True):
    """Cancels a pending request; an MPI error (a peer that died) leaves nothing to do."""
    try:
        request.Cancel()
        if wait:
            request.Wait()
    except _mpi().Exception:
        pass


class PeerStatus:
    """Answers other ranks' questions and asks them in turn.

    Args:
        comm: an mpi4py communicator used only for these messages.
        rank: this process's rank in it.
    """

    def __init__(self, comm, rank):
        self.comm = comm
        self.rank = rank
        self.size = comm.Get_size()
        self._question = np.zeros(1, dtype=np.int64)
        self._incoming = self._listen()
        self._sends = []
        self._asked = 0
        self._acknowledged = 0

    def _listen(self):
        return self.comm.Irecv(self._question, source=_mpi().ANY_SOURCE, tag=_QUERY_TAG)

    def answer(self, text):
        """Answers every question that has arrived with `text` (any JSON value)."""
        MPI = _mpi()
        status = MPI.Status()
        try:
            while self._incoming is not None and self._incoming.Test(status):
                self._send(status.Get_source(), _REPLY_TAG + int(self._question[0]) % 1000,
                           text)
                self._incoming = self._listen()
            self._sends = [(request, buffer) for request, buffer in self._sends
                           if not request.Test()]
        except MPI.Exception:
            if not self._acknowledge_deaths():
                self._abandon()

    def _acknowledge_deaths(self):
        """True if the error came from peers that just died, and listening goes on.

        In a fault-tolerant job a dead peer fails the receive from any rank
        (MPI_ERR_PROC_FAILED_PENDING) until its death is acknowledged. Listening
        on keeps this thread calling MPI, and so keeps Open MPI's failure
        detector beating while the main thread computes: a rank that makes no
        MPI call for longer than the detector's timeout is taken for dead.
        """
        try:
            acknowledged = self.comm.Ack_failed()
        except (AttributeError, NotImplementedError, _mpi().Exception):
            return False
        if acknowledged > self._acknowledged:
            self._acknowledged = acknowledged
            return True
        return False

    def _abandon(self):
        """Stops listening after an MPI error on this channel that is not a new death,
        so the watchdog carries on without answering, rather than fail."""
        if self._incoming is not None:
            _cancel(self._incoming, wait=False)
        self._incoming = None
        self._sends = []

    def _send(self, peer, tag, text):
        buffer = np.zeros(_REPLY_BYTES, dtype=np.uint8)
        data = json.dumps(text).encode()
        if len(data) >= _REPLY_BYTES and isinstance(text, dict) and "what" in text:
            # A long description: shorten it, keep the answer whole.
            text = dict(text, what=str(text["what"])[:_REPLY_BYTES // 2])
            data = json.dumps(text).encode()
        data = data[:_REPLY_BYTES - 1]
        buffer[:len(data)] = np.frombuffer(data, dtype=np.uint8)
        self._sends.append((self.comm.Isend(buffer, dest=peer, tag=tag), buffer))

    def ask(self, status, grace=3.0):
        """Asks every other rank; returns rank -> its answer, or None if it said nothing.

        `status()` gives this rank's own answer to questions that arrive meanwhile
        (other ranks may be asking at the same moment).
        """
        self._asked += 1
        tag = _REPLY_TAG + self._asked % 1000
        replies = {}
        MPI = _mpi()
        answers = {}
        for peer in range(self.size):
            if peer == self.rank:
                continue
            question = np.array([self._asked], dtype=np.int64)
            buffer = np.zeros(_REPLY_BYTES, dtype=np.uint8)
            try:
                self._sends.append((self.comm.Isend(question, dest=peer, tag=_QUERY_TAG),
                                    question))
                replies[peer] = (self.comm.Irecv(buffer, source=peer, tag=tag), buffer)
            except MPI.Exception:
                answers[peer] = None  # a dead peer, in a fault-tolerant job
        deadline = time.monotonic() + grace
        while len(answers) < self.size - 1 and time.monotonic() < deadline:
            self.answer(status())
            for peer, (request, buffer) in replies.items():
                if peer in answers:
                    continue
                try:
                    if request.Test():
                        answers[peer] = _decode(buffer)
                except MPI.Exception:
                    answers[peer] = None
            time.sleep(0.02)
        for peer, (request, _) in replies.items():
            if peer not in answers:
                _cancel(request)
                answers[peer] = None
        return answers

    def close(self):
        if self._incoming is not None:
            _cancel(self._incoming)
        self._incoming = None


def _decode(buffer):
    text = buffer.tobytes().rstrip(b"\0").decode(errors="replace")
    try:
        return json.loads(text)
    except ValueError:
        return text
