"""What travels between a worker and its server: one buffer per exchange.

A message is a small float64 header followed by the float32 body: the
model's trainable values (or their update), then its non-trainable values.
Both directions use the same layout, so one buffer per peer serves every
exchange and nothing is allocated per message.
"""

import numpy as np

# MPI tags.
UP, DOWN, LOGS = 71, 72, 73

# Message kinds (header slot 0).
EXCHANGE, EPOCH_END, DONE = 1, 2, 3

# Header slots.
_KIND, _EPOCH, _STOP, _STEPS = 0, 1, 2, 3
HEADER_SLOTS = 8


class Message:
    """Views of one exchange buffer: `header` fields and the float32 `body`."""

    def __init__(self, body_size):
        self.raw = np.zeros(HEADER_SLOTS * 8 + body_size * 4, dtype=np.uint8)
        self.header = self.raw[:HEADER_SLOTS * 8].view(np.float64)
        self.body = self.raw[HEADER_SLOTS * 8:].view(np.float32)

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
