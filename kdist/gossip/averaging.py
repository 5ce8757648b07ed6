"""Training without a centre: local steps, then averaging with neighbours.

    rank 0 ── rank 1          every `period` steps each rank replaces its
      │          │            weights w_i by  a_ii w_i + sum_j a_ij w_j
    rank 3 ── rank 2          over its neighbours j (Metropolis weights)

No rank talks to more than its neighbours and no collective spans the job
during training, so the cost per rank stays flat as the job grows, and with
`asynchronous=True` no rank ever waits for another: it mixes in whichever
neighbours' weights have arrived and sends its own when the previous copy
has left.
"""

import logging

import keras
import numpy as np

from kdist import _args
from kdist.comm import neighbours as neighbours_lib
from kdist.comm import processes
from kdist.comm.communicator import Average
from kdist.coordination import model_state, team
from kdist.gossip.topology import resolve
from kdist.ps.layout import Layout

logger = logging.getLogger(__name__)


class GossipAveraging(keras.callbacks.Callback):
    """Averages each rank's weights with its neighbours' every `period` batches.

    A Keras callback. Every `period` training batches, each rank replaces its
    weights by the Metropolis-weighted average of its own and its neighbours'
    on `topology` (`kdist.gossip.Topology`). Compile the model with a plain
    (local) optimizer: each rank trains its own replica on its own shard, and
    this callback mixes the replicas. At each epoch's end it adds
    `consensus_distance` to the logs, the root-mean-square distance of the
    replicas from their mean (one allreduce; 0 means every rank holds the
    same weights).

    For custom loops, `average()` runs one round and `consensus_distance()`
    measures (a collective). After training, `rounds` counts this rank's
    averagings, `mixed` the neighbours' vectors it mixed in, and `bytes_sent`
    what it sent.

    Args:
        topology: `"ring"`, `"torus"` (the squarest grid of the job's size),
            `"exponential"`, `"complete"` or a `kdist.gossip.Topology` over
            the job's ranks.
        period: local steps between two averagings (a whole number, at
            least 1).
        asynchronous: mix in whichever neighbours' weights have arrived, never
            waiting (weight not given to a neighbour that sent nothing stays
            with this rank); else every averaging waits for all neighbours.
        final_average: at the end of training, replace every replica by the
            mean of all (one allreduce), so every rank saves the same model.
        include_non_trainable: mix floating-point non-trainable weights too
            (normalisation statistics).
        consensus_every: measure the consensus distance every this many
            epochs; 0 never (the measurement is a collective, which makes
            every rank wait for the slowest once per epoch: turn it off where
            asynchronous ranks should never wait).
        comm: the `kdist.comm.Communicator` (the world by default).

    Raises:
        ValueError: `period` below 1 or `consensus_every` below 0 (when
            created); when training starts, a model compiled with
            `kdist.DistributedOptimizer`, a job of one rank, an unknown
            topology name or a `Topology` of another size.

    Example:

        >>> from kdist.gossip import GossipAveraging
        >>> gossip = GossipAveraging("ring", period=4)
    """

    def __init__(self, topology="ring", period=1, asynchronous=False, final_average=False,
                 include_non_trainable=True, consensus_every=1, comm=None):
        super().__init__()
        self.topology = topology
        self.period = _args.whole_number(period, "period", minimum=1)
        self.asynchronous = bool(asynchronous)
        self.final_average = bool(final_average)
        self.include_non_trainable = bool(include_non_trainable)
        self.consensus_every = _args.whole_number(consensus_every, "consensus_every",
                                                  minimum=0)
        self._comm = comm
        self._exchange = None
        self._graph = None
        self._step = 0
        self.rounds = 0
        self.mixed = 0  # neighbour vectors mixed in
        self.bytes_sent = 0

    @property
    def comm(self):
        return self._comm if self._comm is not None else processes.world()

    def _shared(self):
        """This rank's weights as one vector (a fresh copy) and the part of it that is
        mixed: the trainable values first, then, if included, the others."""
        own = self._layout.read()
        return own, own if self.include_non_trainable else own[:self._layout.trainable_size]

    def _connect(self):
        """Lays the weights out and opens the exchange (all ranks together)."""
        self._layout = Layout(self.model)
        length = self._shared()[1].size
        self._exchange = neighbours_lib.NeighbourExchange(
            self.comm, self._graph.neighbours(self.comm.rank), length)

    def on_train_begin(self, logs=None):
        if any(team.reducing_core(o) is not None for o in _optimizers(self.model)):
            raise ValueError("Gossip trains each replica with its own optimizer; compile the "
                             "model with a plain Keras optimizer, not kdist."
                             "DistributedOptimizer (which would average every step).")
        comm = self.comm
        if comm.size < 2:
            raise ValueError("Gossip averages replicas on 2 ranks or more; start the script "
                             "with kdist run -n N.")
        # Each replica steps on its own: no rank can be caught in a step's collective,
        # so the epoch-end join of kdist's callbacks must not hold ranks together.
        team.steps_independently(self.model)
        self._graph = resolve(self.topology, comm.size)
        self._exchange = None
        if model_state.built(self.model):
            self._connect()
        # else a model without Input: it has its weights after the first step.
        self._weights = self._graph.weights(comm.rank)
        self._step = 0
        if comm.rank == 0:
            logger.info("gossip on %r every %d step(s)%s; spectral gap %.3f", self._graph,
                        self.period, ", asynchronous" if self.asynchronous else "",
                        self._graph.spectral_gap())

    def on_train_batch_end(self, batch, logs=None):
        self._step += 1
        if self._step % self.period == 0:
            self.average()

    def average(self):
        """One round of mixing with the neighbours (what the callback does every `period`
        steps; call it yourself in a custom training loop)."""
        if self._exchange is None:
            self._connect()
        own, shared = self._shared()
        if self.asynchronous:
            arrived = self._exchange.offer(shared)
        else:
            arrived = self._exchange.exchange(shared)
        if not arrived:
            return
        # Weight not given to a neighbour that sent nothing stays with this rank.
        mixed = shared * (1.0 - sum(self._weights[n] for n in arrived))
        for n, vector in arrived.items():
            mixed += self._weights[n] * vector
        shared[:] = mixed
        self._layout.write(own)
        self.rounds += 1
        self.mixed += len(arrived)

    def consensus_distance(self):
        """Root-mean-square distance of the replicas from their mean (a collective)."""
        own = self._shared()[1]
        mean = self.comm.allreduce_(own.copy(), op=Average, label="gossip consensus")
        spread = np.array([np.sum((own - mean) ** 2)], np.float64)
        self.comm.allreduce_(spread, op=Average, label="gossip consensus spread")
        return float(np.sqrt(spread[0]))

    def on_epoch_end(self, epoch, logs=None):
        if self.consensus_every and (epoch + 1) % self.consensus_every == 0:
            distance = self.consensus_distance()
            if logs is not None:
                logs["consensus_distance"] = distance

    def on_train_end(self, logs=None):
        try:
            if self._exchange is not None:
                self._exchange.close()
                self.bytes_sent += self._exchange.sent * self._exchange.length_bytes
        finally:
            self._exchange = None
            team.steps_independently(self.model, False)
        if self.final_average:
            own, shared = self._shared()
            shared[:] = self.comm.allreduce_(shared.copy(), op=Average,
                                             label="gossip final average")
            self._layout.write(own)


def _optimizers(model):
    found = [getattr(model, "optimizer", None)]
    found += list(getattr(model, "optimizers", None) or [])
    return [o for o in found if o is not None]

