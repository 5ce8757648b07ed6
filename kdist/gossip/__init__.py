"""Decentralised training: replicas averaged with their neighbours on a graph."""

from kdist._exports import declare as _declare

_EXPORTS = {
    "GossipAveraging": "kdist.gossip.averaging",
    "Topology": "kdist.gossip.topology",
}

__all__, __getattr__, __dir__ = _declare(__name__, _EXPORTS)
