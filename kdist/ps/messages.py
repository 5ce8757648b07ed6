"""What travels between a worker and its server: one buffer per exchange.

A message is a small float64 header followed by the float32 body: the
model's trainable values (or their update), then its non-trainable values.
Both directions use the same layout, so one buffer per peer serves every
exchange and nothing is allocated per message. When the body lives in memory
both sides share (`kdist.ps.shared`), only the header travels.
"""

import numpy as np

# MPI tags.
UP, DOWN, LOGS, SHARD = 71, 72, 73, 74

# Message kinds (header slot 0).
EXCHANGE, EPOCH_END, DONE = 1, 2, 3

# Header slots.
_KIND, _EPOCH, _STOP, _STEPS = 0, 1, 2, 3
HEADER_SLOTS = 8


class Message:
    """Views of one exchange buffer: `header` fields and the float32 `body`.

    `wire` is what MPI sends or receives: header and body in one buffer, or,
    given a `body` that both sides share, the header alone.
    """

    def __init__(self, body_size, body=None):
        if body is None:
            self.raw = np.zeros(HEADER_SLOTS * 8 + body_size * 4, dtype=np.uint8)
            self.header = self.raw[:HEADER_SLOTS * 8].view(np.float64)
            self.body = self.raw[HEADER_SLOTS * 8:].view(np.float32)
            self.wire = self.raw
        else:
            if body.dtype != np.float32 or body.shape != (body_size,):
                raise ValueError(f"A shared body must be {body_size} float32 values; got "
                                 f"{body.shape} {body.dtype}.")
            self.header = np.zeros(HEADER_SLOTS, dtype=np.float64)
            self.body = body
            self.wire = self.header.view(np.uint8)
            self.raw = None

    @property
    def shared(self):
        """True when only the header travels."""
        return self.raw is None

    def set(self, kind=None, epoch=None, stop=None, steps=None):
        for slot, value in ((_KIND, kind), (_EPOCH, epoch), (_STOP, stop), (_STEPS, steps)):
            if value is not None:
                self.header[slot] = value

    @property
    def kind(self):
        return int(self.header[_KIND])

    @property
    def epoch(self):
        return int(self.header[_EPOCH])

    @property
    def stop(self):
        return bool(self.header[_STOP])

    @property
    def steps(self):
        return int(self.header[_STEPS])
