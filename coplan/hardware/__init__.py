"""Hardware as data: device and cluster specs, packaged presets, and their loaders.

Units are SI everywhere in the data model: bytes, bytes/s, FLOP/s, seconds. Bandwidths of links are
per device and per direction.
"""

from coplan.hardware.cluster import (
    PCIE_GEN4_X16,
    SCOPES,
    TOPOLOGIES,
    ClusterSpec,
    InterconnectLevel,
    NodeGroup,
)
from coplan.hardware.device import DTYPES, EFFICIENCY_KINDS, DeviceSpec, canonical_dtype
from coplan.hardware.registry import (
    cluster_presets,
    device_presets,
    get_device,
    hardware_aliases,
    load_cluster,
)

__all__ = [
    "DTYPES",
    "EFFICIENCY_KINDS",
    "PCIE_GEN4_X16",
    "SCOPES",
    "TOPOLOGIES",
    "ClusterSpec",
    "DeviceSpec",
    "InterconnectLevel",
    "NodeGroup",
    "canonical_dtype",
    "cluster_presets",
    "device_presets",
    "get_device",
    "hardware_aliases",
    "load_cluster",
]
