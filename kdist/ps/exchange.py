"""The child's end of an exchange: one message up to each server, one reply down."""

import numpy as np

from kdist.comm import p2p
from kdist.ps import messages
from kdist.ps.hierarchy import shard_bounds


class _Whole:
    """The whole model's values on one side of an exchange."""

    def __init__(self, body):
        self.body = body
        self.stop = False


class ServerExchange:
    """Exchanges a flat buffer with this process's server(s).

    `message.body` is filled by the caller; after `exchange`, `reply.body`
    holds the values the servers sent back, until the next exchange, and
    `reply.stop` says whether one of them asked to stop.

    Args:
        comm: the job's `kdist.comm.Communicator`.
        servers: the server's rank, or the ranks of the servers that each
            hold one shard (`kdist.ps.hierarchy.shard_bounds`) of the values.
        size: values in the whole buffer.
        slots: a `kdist.ps.shared.SharedSlots`: the bodies then live in memory
            the servers on this node read and write directly, and only
            headers travel to them.
    """

    def __init__(self, comm, servers, size, slots=None):
        self.comm = comm
        self.servers = [servers] if np.isscalar(servers) else list(servers)
        self.bounds = shard_bounds(size, len(self.servers))
        shared = slots.link_bodies() if slots is not None else None
        self._slots = slots if shared is not None else None
        if shared is None and len(self.servers) == 1:
            # One server by message: the bodies are the message buffers themselves.
            self._out, self._in = [messages.Message(size)], [messages.Message(size)]
            body, reply_body = self._out[0].body, self._in[0].body
        else:
            body, reply_body = shared or (np.zeros(size, np.float32),
                                          np.zeros(size, np.float32))
            self._out, self._in = [], []
            for server, (start, stop) in zip(self.servers, self.bounds):
                local = self._slots is not None and slots.on_node(server)
                for wire, whole in ((self._out, body), (self._in, reply_body)):
                    wire.append(messages.Message(stop - start, body=whole[start:stop])
                                if local else messages.Message(stop - start))
        self.message, self.reply = _Whole(body), _Whole(reply_body)
        # Shards sent by message travel in their own buffers, copied at each exchange.
        self._copied = [not (m.shared or m.body is body) for m in self._out]

    @property
    def shared(self):
        """True when every server reads and writes this child's bodies directly."""
        return all(m.shared for m in self._out)

    def exchange(self, kind, epoch=0, steps=0, logs=None):
        """Sends the message (and `logs` for an epoch end, to the first server);
        returns the reply."""
        if kind == messages.EPOCH_END:
            # Sent first so the server finds it as soon as it reads the message.
            p2p.send_object(self.comm, self.servers[0], _plain(logs), messages.LOGS)
        for out, copied, (start, stop) in zip(self._out, self._copied, self.bounds):
            out.set(kind=kind, epoch=epoch, steps=steps)
            if copied:
                np.copyto(out.body, self.message.body[start:stop])
        if self._slots is not None:
            self._slots.sync()
        p2p.exchange(self.comm, self.servers, [m.wire for m in self._out],
                          [m.wire for m in self._in], messages.UP, messages.DOWN)
        if self._slots is not None:
            self._slots.sync()
        for incoming, copied, (start, stop) in zip(self._in, self._copied, self.bounds):
            if copied:
                np.copyto(self.reply.body[start:stop], incoming.body)
        self.reply.stop = any(m.stop for m in self._in)
        return self.reply


def _plain(logs):
    """Epoch logs as floats, so they pickle without TensorFlow."""
    return {str(k): float(np.asarray(v)) for k, v in (logs or {}).items()
            if np.size(np.asarray(v)) == 1}
