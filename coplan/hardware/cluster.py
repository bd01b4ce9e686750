"""Clusters as data: groups of identical nodes, the interconnect inside a node and between nodes.

A cluster is a tuple of ``NodeGroup``s. One group is the usual homogeneous cluster; several groups
with different devices express a heterogeneous one (e.g. an H100 node next to an A100 node). All
bandwidths are bytes/s *per device, per direction*, because that is what a collective's cost model
divides by: a ring all-reduce of S bytes over n devices moves 2·S·(n-1)/n bytes through each
device's link in each direction.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from coplan.errors import SpecError
from coplan.hardware._fields import (
    Reader,
    anchored,
    check_choice,
    check_int,
    check_number,
    check_str,
    fail,
    kind,
    suggest,
)
from coplan.hardware.device import DeviceSpec
from coplan.limits import MAX_DEVICES, MAX_DEVICES_PER_NODE, bounded_int

TOPOLOGIES: tuple[str, ...] = ("switch", "ring", "torus", "fully-connected", "tree")
SCOPES: tuple[str, ...] = ("node", "cluster")


@dataclass(frozen=True, slots=True)
class InterconnectLevel:
    """One level of the network hierarchy.

    Attributes:
        name: link technology, e.g. ``"nvlink"``, ``"infiniband"``, ``"pcie"``, ``"ici"``,
            ``"neuronlink"``, ``"ethernet"``, ``"loopback"``.
        bandwidth: bytes/s per device, one direction (a "900 GB/s bidirectional" link is 450e9).
        latency_s: small-message end-to-end latency in seconds (the alpha of an alpha-beta model).
        topology: one of ``TOPOLOGIES``; ``"tree"`` includes fat-trees, ``"switch"`` means any pair
            talks at full bandwidth through a crossbar (NVSwitch).
        scope: ``"node"`` for links inside a node, ``"cluster"`` for links between nodes.
        efficiency: fraction of ``bandwidth`` that large collectives achieve on this link (NCCL's
            bus bandwidth over the link rate), in (0, 1].
        leaf_nodes: nodes under one leaf switch (a rail-optimized fat tree's scalable unit): traffic
            of a group spanning more nodes climbs to the spine. None: every node is one hop away.
        oversubscription: leaf downlink over uplink bandwidth (1: a non-blocking fat tree; 2: a 2:1
            tree): a group spanning more than ``leaf_nodes`` nodes gets ``bandwidth /
            oversubscription`` per device, the share its uplinks carry when every device sends.
        comm_sms: streaming multiprocessors one collective over this level occupies on each device
            while it runs (NCCL runs one thread block per channel and never shares an SM with a
            compute kernel): compute overlapping the collective runs on the others. 0: the level's
            collectives take no compute units (a CPU's gloo, copy engines, unknown).
    """

    name: str
    bandwidth: float
    latency_s: float
    topology: str
    scope: str
    efficiency: float = 1.0
    leaf_nodes: int | None = None
    oversubscription: float = 1.0
    comm_sms: int = 0

    def __post_init__(self) -> None:
        src = f"interconnect {self.name!r}" if isinstance(self.name, str) else "interconnect"
        check_str(src, "name", self.name)
        object.__setattr__(self, "bandwidth", check_number(src, "bandwidth", self.bandwidth))
        object.__setattr__(self, "latency_s", check_number(src, "latency_s", self.latency_s, strict=False))
        check_choice(src, "topology", self.topology, TOPOLOGIES)
        check_choice(src, "scope", self.scope, SCOPES)
        eff = check_number(src, "efficiency", self.efficiency)
        if eff > 1.0:
            fail(src, "efficiency", f"must be a fraction in (0, 1], got {self.efficiency!r}")
        object.__setattr__(self, "efficiency", eff)
        if self.leaf_nodes is not None:
            check_int(src, "leaf_nodes", self.leaf_nodes, maximum=MAX_DEVICES)
        over = check_number(src, "oversubscription", self.oversubscription)
        if over < 1.0:
            fail(
                src, "oversubscription", f"must be >= 1 (downlink over uplink), got {self.oversubscription!r}"
            )
        object.__setattr__(self, "oversubscription", over)
        check_int(src, "comm_sms", self.comm_sms, minimum=0)

    def bandwidth_across(self, nodes: int) -> float:
        """Bytes/s per device for a collective over ``nodes`` nodes: the link rate within a leaf,
        divided by the oversubscription once the group climbs to the spine."""
        if self.leaf_nodes is not None and nodes > self.leaf_nodes:
            return self.bandwidth / self.oversubscription
        return self.bandwidth

    @classmethod
    def loopback(cls, bandwidth: float) -> InterconnectLevel:
        """The trivial level of a one-device node: a "transfer" is a copy in device memory
        (``bandwidth`` bytes/s), with no network latency."""
        return cls("loopback", bandwidth, 0.0, "fully-connected", "node")

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "bandwidth": self.bandwidth,
            "latency_s": self.latency_s,
            "topology": self.topology,
            "scope": self.scope,
            "efficiency": self.efficiency,
            **({"leaf_nodes": self.leaf_nodes} if self.leaf_nodes is not None else {}),
            **({"oversubscription": self.oversubscription} if self.oversubscription != 1.0 else {}),
            **({"comm_sms": self.comm_sms} if self.comm_sms else {}),
        }

    @classmethod
    def from_dict(cls, data: object, source: str = "<dict>", *, path: str = "") -> InterconnectLevel:
        r = Reader(data, source, path)
        r.check_keys(
            ("name", "bandwidth", "latency_s", "topology", "scope"),
            ("efficiency", "leaf_nodes", "oversubscription", "comm_sms"),
        )
        name, bandwidth = r.text("name"), r.number("bandwidth")
        latency, topology, scope = r.number("latency_s", strict=False), r.text("topology"), r.text("scope")
        eff = r.number("efficiency") if "efficiency" in r.data else 1.0
        leaf = r.data.get("leaf_nodes")
        over = r.number("oversubscription") if "oversubscription" in r.data else 1.0
        sms = r.integer("comm_sms", minimum=0) if "comm_sms" in r.data else 0
        with anchored(source, path):
            return cls(name, bandwidth, latency, topology, scope, eff, leaf, over, sms)


#: Assumed between devices of a bare device spec asked to form a multi-device node, when no preset
#: says better: PCIe Gen4 x16 is 16 GT/s x 16 lanes x 128/130 coding = 31.5 GB/s per direction;
#: a peer-to-peer hop through a PCIe switch or the host bridge costs a few microseconds.
PCIE_GEN4_X16 = InterconnectLevel("pcie", 31.5e9, 5e-6, "tree", "node")


@dataclass(frozen=True, slots=True)
class NodeGroup:
    """``nodes`` identical nodes, each with ``devices_per_node`` copies of ``device`` linked by
    ``intra_node`` (whose scope must be ``"node"``)."""

    device: DeviceSpec
    devices_per_node: int
    nodes: int
    intra_node: InterconnectLevel

    def __post_init__(self) -> None:
        src = "node group"
        if not isinstance(self.device, DeviceSpec):
            fail(src, "device", f"expected a DeviceSpec, got {type(self.device).__name__}")
        check_int(src, "devices_per_node", self.devices_per_node, maximum=MAX_DEVICES_PER_NODE)
        check_int(src, "nodes", self.nodes, maximum=MAX_DEVICES)
        if not isinstance(self.intra_node, InterconnectLevel):
            fail(src, "intra_node", f"expected an InterconnectLevel, got {type(self.intra_node).__name__}")
        if self.intra_node.scope != "node":
            scope = self.intra_node.scope
            fail(src, "intra_node.scope", f"must be 'node' for the level inside a node, got {scope!r}")

    @property
    def num_devices(self) -> int:
        return self.devices_per_node * self.nodes

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device.to_dict(),
            "devices_per_node": self.devices_per_node,
            "nodes": self.nodes,
            "intra_node": self.intra_node.to_dict(),
        }

    @classmethod
    def from_dict(
        cls,
        data: object,
        source: str = "<dict>",
        *,
        path: str = "",
        devices: Mapping[str, DeviceSpec] | None = None,
    ) -> NodeGroup:
        """``device`` may be a device preset name (looked up in ``devices``, the table the
        registry's ``load_cluster`` passes) or an inline device object."""
        r = Reader(data, source, path)
        r.check_keys(("device", "devices_per_node", "nodes", "intra_node"))
        device = _device_ref(r, devices)
        per_node = r.integer("devices_per_node", maximum=MAX_DEVICES_PER_NODE)
        nodes = r.integer("nodes", maximum=MAX_DEVICES)
        intra = InterconnectLevel.from_dict(r.data["intra_node"], source, path=r.at("intra_node"))
        with anchored(source, path):
            return cls(device, per_node, nodes, intra)


def _device_ref(r: Reader, devices: Mapping[str, DeviceSpec] | None) -> DeviceSpec:
    value, where = r.data["device"], r.at("device")
    if isinstance(value, Mapping):
        return DeviceSpec.from_dict(value, r.source, path=where)
    if not isinstance(value, str):
        fail(r.source, where, f"expected a device preset name or a device object, got {kind(value)}")
    if devices is None:  # the presets are the registry's to resolve (``load_cluster``)
        fail(r.source, where, f"device preset {value!r} named without a table of presets to find it in")
    if value not in devices:
        fail(r.source, where, f"unknown device preset {value!r}{suggest(value, devices)}")
    return devices[value]


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    """A whole cluster. ``inter_node`` (scope ``"cluster"``) links nodes, across groups too; it may
    be ``None`` only when the cluster has a single node. ``source`` names where the topology and
    link numbers come from."""

    name: str
    groups: tuple[NodeGroup, ...]
    inter_node: InterconnectLevel | None
    source: str = ""

    def __post_init__(self) -> None:
        named = isinstance(self.name, str) and bool(self.name.strip())
        src = f"cluster {self.name!r}" if named else "cluster"
        check_str(src, "name", self.name)
        if isinstance(self.groups, NodeGroup) or not isinstance(self.groups, tuple | list):
            fail(src, "groups", f"expected a sequence of NodeGroup, got {type(self.groups).__name__}")
        object.__setattr__(self, "groups", tuple(self.groups))
        if not self.groups:
            fail(src, "groups", "needs at least one node group")
        for i, group in enumerate(self.groups):
            if not isinstance(group, NodeGroup):
                fail(src, f"groups[{i}]", f"expected a NodeGroup, got {type(group).__name__}")
        if self.num_devices > MAX_DEVICES:
            reason = f"{self.num_devices:,} devices in all; coplan's bound is {MAX_DEVICES:,}"
            fail(src, "groups", reason)
        if self.inter_node is None:
            if self.num_nodes > 1:
                fail(src, "inter_node", f"required: the cluster has {self.num_nodes} nodes")
        elif not isinstance(self.inter_node, InterconnectLevel):
            got = type(self.inter_node).__name__
            fail(src, "inter_node", f"expected an InterconnectLevel or None, got {got}")
        elif self.inter_node.scope != "cluster":
            scope = self.inter_node.scope
            fail(src, "inter_node.scope", f"must be 'cluster' for links between nodes, got {scope!r}")
        check_str(src, "source", self.source, allow_empty=True)

    # --- shape ---------------------------------------------------------------------------------

    @property
    def num_devices(self) -> int:
        return sum(g.num_devices for g in self.groups)

    @property
    def num_nodes(self) -> int:
        return sum(g.nodes for g in self.groups)

    @property
    def devices(self) -> tuple[DeviceSpec, ...]:
        """The device spec of each group, in group order."""
        return tuple(g.device for g in self.groups)

    @property
    def is_homogeneous(self) -> bool:
        return len(set(self.devices)) == 1

    @property
    def device(self) -> DeviceSpec:
        """The one device spec of a homogeneous cluster; ``SpecError`` for a heterogeneous one."""
        if not self.is_homogeneous:
            reason = f"{self._mix_reason()}, so it has no single device; use .devices or .groups"
            raise SpecError(f"cluster {self.name!r}", None, reason)
        return self.groups[0].device

    def resized(self, gpus: int) -> ClusterSpec:
        """The same kind of cluster with ``gpus`` devices (``--gpus N``); homogeneous clusters only.

        N <= devices per node gives one node with N devices; a larger N must be a multiple of the
        devices per node and gives N / devices-per-node full nodes.
        """
        src = f"cluster {self.name!r}"
        why = bounded_int(gpus, MAX_DEVICES)
        if why is not None:
            raise SpecError(src, "gpus", why)
        first = self.groups[0]
        if not self.is_homogeneous:
            raise SpecError(src, None, f"cannot resize to {gpus} devices: {self._mix_reason()}")
        if len({(g.devices_per_node, g.intra_node) for g in self.groups}) > 1:
            reason = "cannot resize: its node groups differ in node size or intra-node link"
            raise SpecError(src, None, reason)
        per = first.devices_per_node
        if gpus <= per:
            group = NodeGroup(first.device, gpus, 1, first.intra_node)
        elif gpus % per:
            lower, upper = gpus // per * per, (gpus // per + 1) * per
            raise SpecError(
                src,
                None,
                f"cannot use {gpus} devices: nodes hold {per}, so ask for at most {per} or a multiple "
                f"of {per} (e.g. {lower} or {upper})",
            )
        elif self.inter_node is None:
            raise SpecError(src, None, f"cannot span {gpus // per} nodes: it has no inter-node interconnect")
        else:
            group = NodeGroup(first.device, per, gpus // per, first.intra_node)
        if (group,) == self.groups:
            return self
        return ClusterSpec(f"{self.name}[{gpus}]", (group,), self.inter_node, self.source)

    def _mix_reason(self) -> str:
        return "it mixes device kinds " + ", ".join(dict.fromkeys(d.name for d in self.devices))

    @classmethod
    def single_node(
        cls,
        device: DeviceSpec,
        count: int = 1,
        intra_node: InterconnectLevel | None = None,
        name: str | None = None,
    ) -> ClusterSpec:
        """One node of ``count`` copies of ``device``. Without ``intra_node``: loopback for one
        device, else the conservative ``PCIE_GEN4_X16`` assumption."""
        if intra_node is None:
            intra_node = InterconnectLevel.loopback(device.memory_bandwidth) if count == 1 else PCIE_GEN4_X16
        label = name or (device.name if count == 1 else f"{device.name}[{count}]")
        note = f"one node of {count} x {device.name}; links: {intra_node.name}"
        return cls(label, (NodeGroup(device, count, 1, intra_node),), None, note)

    def summary(self) -> str:
        """One human-readable line."""
        parts = [f"{g.nodes}x{g.devices_per_node} {g.device.name} ({g.intra_node.name})" for g in self.groups]
        inter = f", nodes linked by {self.inter_node.name}" if self.inter_node else ""
        count = f"{self.num_devices} device" + ("s" if self.num_devices != 1 else "")
        return f"{self.name}: {count} = " + " + ".join(parts) + inter

    # --- serialisation -------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict with devices inline; ``ClusterSpec.from_dict(c.to_dict()) == c``."""
        return {
            "name": self.name,
            "source": self.source,
            "groups": [g.to_dict() for g in self.groups],
            "inter_node": self.inter_node.to_dict() if self.inter_node else None,
        }

    @classmethod
    def from_dict(
        cls,
        data: object,
        source: str = "<dict>",
        *,
        path: str = "",
        devices: Mapping[str, DeviceSpec] | None = None,
    ) -> ClusterSpec:
        """Build from a parsed JSON object; groups' ``device`` may be a preset name (looked up in
        ``devices``, the table the registry's ``load_cluster`` passes) or an inline device object. Errors are
        ``SpecError(source, field, reason)`` with the full field path (prefixed by ``path``)."""
        r = Reader(data, source, path)
        r.check_keys(("name", "groups"), ("inter_node", "source"))
        name, text = r.text("name"), r.text("source", default="")
        raw = r.data["groups"]
        if not isinstance(raw, list) or not raw:
            fail(source, r.at("groups"), f"expected a non-empty array of node groups, got {kind(raw)}")
        groups = tuple(
            NodeGroup.from_dict(g, source, path=r.at(f"groups[{i}]"), devices=devices)
            for i, g in enumerate(raw)
        )
        inter = r.data.get("inter_node")
        level = None if inter is None else InterconnectLevel.from_dict(inter, source, path=r.at("inter_node"))
        with anchored(source, path):
            return cls(name, groups, level, text)
