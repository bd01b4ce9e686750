"""``coplan hardware``: the packaged device and cluster presets."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from coplan.cli.common import print_json, stdout

if TYPE_CHECKING:
    from coplan.hardware import ClusterSpec, DeviceSpec


def hardware(
    json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")] = False,
) -> None:
    """List the device and cluster presets (usable as --cluster NAME in `coplan plan`)."""
    from coplan.hardware import cluster_presets, device_presets, hardware_aliases

    devices, clusters, aliases = device_presets(), cluster_presets(), hardware_aliases()
    if json:
        print_json(
            {
                "devices": {name: d.to_dict() for name, d in devices.items()},
                "clusters": {name: c.to_dict() for name, c in clusters.items()},
                "aliases": aliases,
            }
        )
        return
    console = stdout()
    render_devices(devices, console)
    console.print()
    render_clusters(clusters, console)
    console.print()
    console.print("aliases: " + ", ".join(f"{a} = {t}" for a, t in aliases.items()), soft_wrap=True)


def _num(value: float, digits: int = 1) -> str:
    return f"{value:,.{digits}f}"


def render_devices(devices: dict[str, DeviceSpec], console: Console) -> None:
    table = Table(title="devices", title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    table.add_column("name", style="cyan", no_wrap=True)
    table.add_column("vendor")
    table.add_column("bf16\nTFLOP/s", justify="right")
    table.add_column("fp8", justify="center")
    table.add_column("memory\nGiB", justify="right")
    table.add_column("memory\nTB/s", justify="right")
    table.add_column("launch\nµs", justify="right")
    for name, d in devices.items():
        bf16 = d.peak_flops.get("bf16", 0.0)
        table.add_row(
            name,
            d.vendor,
            _num(bf16 / 1e12) if bf16 else "-",
            "yes" if d.peak_flops.get("fp8", 0.0) > 0 else "no",
            _num(d.memory_bytes / 2**30, 0),
            _num(d.memory_bandwidth / 1e12, 2),
            _num(d.kernel_launch_s * 1e6),
        )
    console.print(table)


def _link(bandwidth: float, name: str) -> str:
    return f"{bandwidth / 1e9:.3g} {name}"


def render_clusters(clusters: dict[str, ClusterSpec], console: Console) -> None:
    title = "clusters (GB/s per device, per direction)"
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    table.add_column("name", style="cyan", no_wrap=True)
    table.add_column("per node\n× nodes", no_wrap=True)
    table.add_column("device", no_wrap=True)
    table.add_column("intra-node\nGB/s", no_wrap=True)
    table.add_column("inter-node\nGB/s", no_wrap=True)
    for name, c in clusters.items():
        table.add_row(
            name,
            "\n".join(f"{g.devices_per_node} × {g.nodes}" for g in c.groups),
            "\n".join(g.device.name for g in c.groups),
            "\n".join(_link(g.intra_node.bandwidth, g.intra_node.name) for g in c.groups),
            _link(c.inter_node.bandwidth, c.inter_node.name) if c.inter_node else "-",
        )
    console.print(table)
