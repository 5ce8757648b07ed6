"""Decentralised training: replicas averaged with their neighbours on a graph.

Each rank trains its own replica with a plain optimizer; the
`GossipAveraging` callback averages it every few steps with its neighbours'
on a `Topology` (ring, torus, exponential graph, complete graph or one of
your own), synchronously or, with `asynchronous=True`, without ever waiting.
Apart from measuring the consensus distance once per epoch (which
`consensus_every=0` turns off), no collective spans the job during training.
The gossip guide covers topologies and the synchronous and asynchronous
modes.
"""

from kdist._exports import declare as _declare

_EXPORTS = {
    "GossipAveraging": "kdist.gossip.averaging",
    "Topology": "kdist.gossip.topology",
}

__all__, __getattr__, __dir__ = _declare(__name__, _EXPORTS)
