"""The child's end of an exchange: one message up, one reply down."""

import numpy as np

from kdist.comm import p2p
from kdist.ps import protocol


class Link:
    """Exchanges flat buffers with this process's server (`parent`).

    `message.body` is filled by the caller; after `exchange`, `reply.body`
    holds the values the server sent back, until the next exchange. With
    `slots` (a `kdist.ps.shared.SharedSlots`) and the server on this node,
    both bodies live in memory the server reads and writes directly, and
    only headers travel.
    """

    def __init__(self, comm, parent, size, slots=None):
        self.comm, self.parent = comm, parent
        shared = slots.link_messages() if slots is not None else None
        self._slots = slots if shared is not None else None
        if shared is None:
            self.message, self.reply = protocol.Message(size), protocol.Message(size)
        else:
            self.message, self.reply = shared

    @property
    def shared(self):
        return self._slots is not None

    def exchange(self, kind, epoch=0, steps=0, logs=None):
        """Sends the message (and `logs` for an epoch end); returns the reply."""
        self.message.set(kind=kind, epoch=epoch, steps=steps)
        if kind == protocol.EPOCH_END:
            # Sent first so the server finds it as soon as it reads the message.
            p2p.send_object(self.comm, self.parent, _plain(logs), protocol.LOGS)
        if self._slots is not None:
            self._slots.sync()
        p2p.exchange(self.comm, self.parent, self.message.wire, self.reply.wire,
                     protocol.UP, protocol.DOWN)
        if self._slots is not None:
            self._slots.sync()
        return self.reply


def _plain(logs):
    """Epoch logs as floats, so they pickle without TensorFlow."""
    return {str(k): float(np.asarray(v)) for k, v in (logs or {}).items()
            if np.size(np.asarray(v)) == 1}
