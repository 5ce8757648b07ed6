"""The child's end of an exchange: one message up, one reply down."""

import numpy as np

from kdist.comm import p2p
from kdist.ps import protocol


class Link:
    """Exchanges flat buffers with this process's server (`parent`).

    `message.body` is filled by the caller; after `exchange`, `reply.body`
    holds the values the server sent back, until the next exchange.
    """

    def __init__(self, comm, parent, size):
        self.comm, self.parent = comm, parent
        self.message = protocol.Message(size)
        self.reply = protocol.Message(size)

    def exchange(self, kind, epoch=0, steps=0, logs=None):
        """Sends the message (and `logs` for an epoch end); returns the reply."""
        self.message.set(kind=kind, epoch=epoch, steps=steps)
        if kind == protocol.EPOCH_END:
            # Sent first so the server finds it as soon as it reads the message.
            p2p.send_object(self.comm, self.parent, _plain(logs), protocol.LOGS)
        p2p.exchange(self.comm, self.parent, self.message.raw, self.reply.raw,
                     protocol.UP, protocol.DOWN)
        return self.reply


def _plain(logs):
    """Epoch logs as floats, so they pickle without TensorFlow."""
    return {str(k): float(np.asarray(v)) for k, v in (logs or {}).items()
            if np.size(np.asarray(v)) == 1}
