"""Decentralised training: replicas averaged with their neighbours on a graph."""

from kdist.gossip.averaging import GossipAveraging
from kdist.gossip.topology import Topology

__all__ = ["GossipAveraging", "Topology"]
