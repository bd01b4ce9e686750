"""Collectives over a cluster's two-level network (links inside a node, NICs between nodes).

Ranks are laid out as Megatron-LM does (tensor-parallel fastest, then data-parallel, then
pipeline), so a process group is ``size`` ranks ``stride`` apart. A collective over a group that
spans nodes runs as NCCL's ring does: one ring over all ``n`` members, each node's members
consecutive, with one ring per NIC (channel) so that each of the ``r`` local members' NICs carries
``1/r`` of the data. Bandwidth terms follow the ring algorithm (all-reduce moves ``2(n-1)/n`` of the
buffer out of each member, all-gather and reduce-scatter ``(n-1)/n``); the NVLink hops and the NIC
hops are stages of the same pipelined ring, so they run concurrently and the slower level sets the
time (nccl-tests' multi-node bus bandwidth is the NICs' rate, not a harmonic mix of NVLink and
NIC rates). All-reduce latency follows a tree (``log2 n`` hops), which NCCL picks for small
messages; all-gather and reduce-scatter have only the ring algorithm in NCCL, whose ``n - 1``
steps each pay a hop latency, the ``nodes - 1`` node-crossing steps the network's (NCCL
src/enqueue.cc: AllGather/ReduceScatter use ``ncclPatternRing``, ``nstepsPerLoop = nRanks - 1``;
src/graph/tuning.cc prices ring latency as ``(nsteps - nInterSteps) * intraLat + nInterSteps *
interLat`` with ``nInterSteps = nNodes - 1`` for these two collectives).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from coplan.hardware.cluster import ClusterSpec, InterconnectLevel


@dataclass(frozen=True, slots=True)
class Group:
    """A process group's placement: ``local`` members per node over ``nodes`` nodes."""

    size: int
    local: int
    nodes: int
    intra: InterconnectLevel
    inter: InterconnectLevel | None
    efficiency: float
    per_node: int = 0  # devices per node (0: ``local``)

    @classmethod
    def of(cls, cluster: ClusterSpec, size: int, stride: int, efficiency: float) -> Group:
        first = cluster.groups[0]
        per_node = first.devices_per_node
        if size <= 1:
            return cls(1, 1, 1, first.intra_node, cluster.inter_node, efficiency, per_node)
        local = max(1, min(size, per_node // stride)) if stride < per_node else 1
        nodes = math.ceil(size / local)
        inter = cluster.inter_node
        if nodes > 1 and inter is None:  # a single-node cluster cannot span nodes; keep it inside
            local, nodes = size, 1
        return cls(size, local, nodes, first.intra_node, inter, efficiency, per_node)

    @property
    def comm_sms(self) -> int:
        """SMs one collective over the group holds on each member (``InterconnectLevel.comm_sms``):
        the node's links' inside a node; once the ring crosses nodes, the network's channels, which
        NCCL opens two per NIC the node's members drive (its maintainer, NVIDIA/nccl issue #689: 2
        SMs for one NIC, 16 for a DGX's 8), so a group with ``local`` of a node's devices (one
        NIC each) holds that share of a full node's, at least the two of one NIC."""
        if self.nodes > 1 and self.inter is not None:
            full = self.inter.comm_sms
            share = full * self.local / max(self.local, self.per_node or self.local)
            return min(full, max(2, round(share)))
        return self.intra.comm_sms

    def _ring_latency(self) -> float:
        """Latency of one ring pass (all-gather, reduce-scatter): ``n - 1`` steps, of which
        ``nodes - 1`` cross the network."""
        inter = self.inter.latency_s if self.inter is not None and self.nodes > 1 else 0.0
        cross = self.nodes - 1 if inter else 0
        return (self.size - 1 - cross) * self.intra.latency_s + cross * inter

    def _tree_latency(self) -> float:
        """Latency of one tree pass: ``log2`` hops inside the node and between nodes."""
        t = 0.0
        if self.local > 1:
            t += math.ceil(math.log2(self.local)) * self.intra.latency_s
        if self.nodes > 1 and self.inter is not None:
            t += math.ceil(math.log2(self.nodes)) * self.inter.latency_s
        return t

    def _bandwidth_time(self, bytes_: float, factor: float) -> float:
        """Seconds of moving ``factor * (n-1)/n`` of ``bytes_`` out of each member, no latency."""
        e = self.efficiency
        if self.local > 1 and self.nodes > 1 and self.inter is not None:
            # one pipelined ring over both levels: of the (n-1)/n of the buffer each member sends,
            # (r-1)/r leaves over NVLink and 1/r over the node's r NICs, concurrently
            n, r = self.size, self.local
            sent = factor * (n - 1) / n * bytes_
            intra, inter = self.intra, self.inter
            t_intra = sent * (r - 1) / r / (intra.bandwidth * intra.efficiency * e)
            t_inter = sent / r / (inter.bandwidth_across(self.nodes) * inter.efficiency * e)
            return max(t_intra, t_inter)
        t = 0.0
        if self.local > 1:
            lvl = self.intra
            t += factor * (self.local - 1) / self.local * bytes_ / (lvl.bandwidth * lvl.efficiency * e)
        if self.nodes > 1 and self.inter is not None:
            lvl = self.inter
            sent = factor * (self.nodes - 1) / self.nodes * bytes_ / self.local
            t += sent / (lvl.bandwidth_across(self.nodes) * lvl.efficiency * e)
        return t

    def _phase(self, bytes_: float, factor: float, ring: bool = False) -> float:
        """Time for a ring-style collective moving ``factor * (n-1)/n`` of ``bytes_`` per link,
        with a tree's latency per pass (``factor`` passes), or the ring's steps (``ring``)."""
        latency = self._ring_latency() if ring else factor * self._tree_latency()
        return self._bandwidth_time(bytes_, factor) + latency

    def all_reduce(self, bytes_: float) -> float:
        """All-reduce of a ``bytes_`` buffer held by every member."""
        return 0.0 if self.size <= 1 else self._phase(bytes_, 2.0)

    def all_gather(self, bytes_: float) -> float:
        """All-gather producing a ``bytes_`` buffer on every member (each contributes 1/n)."""
        return 0.0 if self.size <= 1 else self._phase(bytes_, 1.0, ring=True)

    def reduce_scatter(self, bytes_: float) -> float:
        """Reduce-scatter of a ``bytes_`` buffer (each member keeps a reduced 1/n)."""
        return 0.0 if self.size <= 1 else self._phase(bytes_, 1.0, ring=True)


def p2p_time(cluster: ClusterSpec, bytes_: float, cross_node: bool, efficiency: float) -> float:
    """One point-to-point send between neighbouring pipeline stages."""
    if cross_node and cluster.inter_node is not None:
        lvl = cluster.inter_node
    else:
        lvl = cluster.groups[0].intra_node
    return bytes_ / (lvl.bandwidth * lvl.efficiency * efficiency) + lvl.latency_s
