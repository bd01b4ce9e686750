"""Packaged hardware presets and the loaders behind ``--hardware NAME_OR_FILE [--gpus N]``.

Preset files (``presets/devices.json``, ``presets/clusters.json``) map a preset name to a spec
object without its ``name`` (the key is the name). Cluster presets refer to devices by preset name.
``presets/aliases.json`` maps the short names people type (``a100``, ``h100``, ``dgx-a100``) to the
preset they mean: an unqualified A100 is the 80 GB SXM part that large training runs use.
The parsed presets are cached with ``lru_cache``: they are immutable package data, and the specs
are frozen, so sharing them is safe.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Mapping
from functools import lru_cache
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from types import MappingProxyType
from typing import Any, TypeVar

from coplan.errors import SpecError
from coplan.fileio import looks_like_file, read_text
from coplan.hardware._fields import kind, suggest
from coplan.hardware.cluster import ClusterSpec
from coplan.hardware.device import DeviceSpec
from coplan.limits import MAX_DEVICES, bounded_int

_T = TypeVar("_T")
_HINT = "run `coplan hardware` to list presets, or pass a path to a JSON file"


def _read_json(file: Traversable | Path, label: str) -> object:
    """Parse one JSON file; every failure is a one-line ``SpecError`` naming ``label``."""
    text = read_text(file, label) if isinstance(file, Path) else file.read_text(encoding="utf-8")
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        where = f"line {err.lineno}, column {err.colno}"
        raise SpecError(label, None, f"invalid JSON at {where}: {err.msg}") from None
    except ValueError as err:  # an integer of more digits than Python converts
        raise SpecError(label, None, f"invalid JSON: {err}") from None


def _preset_table(filename: str, build: Callable[[dict[str, Any], str, str], _T]) -> Mapping[str, _T]:
    file = resources.files("coplan.hardware") / "presets" / filename
    label = str(file)
    table = _read_json(file, label)
    if not isinstance(table, dict):
        raise SpecError(label, None, "expected an object mapping preset names to specs")
    out: dict[str, _T] = {}
    for name, entry in table.items():
        if not isinstance(entry, dict):
            raise SpecError(label, name, "expected a spec object")
        if entry.get("name", name) != name:
            raise SpecError(label, f"{name}.name", f"must match the preset key {name!r} (or be left out)")
        out[name] = build({**entry, "name": name}, label, name)
    return MappingProxyType(out)


@lru_cache(maxsize=1)
def _device_table() -> Mapping[str, DeviceSpec]:
    return _preset_table("devices.json", lambda d, src, path: DeviceSpec.from_dict(d, src, path=path))


@lru_cache(maxsize=1)
def _cluster_table() -> Mapping[str, ClusterSpec]:
    devices = _device_table()
    return _preset_table(
        "clusters.json", lambda d, src, path: ClusterSpec.from_dict(d, src, path=path, devices=devices)
    )


@lru_cache(maxsize=1)
def _alias_table() -> Mapping[str, str]:
    file = resources.files("coplan.hardware") / "presets" / "aliases.json"
    label = str(file)
    table = _read_json(file, label)
    if not isinstance(table, dict):
        raise SpecError(label, None, "expected an object mapping aliases to preset names")
    presets = {**_device_table(), **_cluster_table()}
    for alias, target in table.items():
        if alias in presets:
            raise SpecError(label, alias, "is a preset name; an alias may not shadow a preset")
        if not isinstance(target, str) or target not in presets:
            raise SpecError(label, alias, f"names no preset: {target!r}")
    return MappingProxyType(dict(table))


def hardware_aliases() -> dict[str, str]:
    """Short names accepted for presets (``a100`` -> ``a100-sxm-80gb``), alias -> preset name."""
    return dict(_alias_table())


def device_presets() -> dict[str, DeviceSpec]:
    """All packaged device presets by name, in file order (a fresh dict; the specs are shared)."""
    return dict(_device_table())


def cluster_presets() -> dict[str, ClusterSpec]:
    """All packaged cluster presets by name, in file order (a fresh dict; the specs are shared)."""
    return dict(_cluster_table())


def _is_path_like(text: str) -> bool:
    separators = {"/", os.sep} | ({os.altsep} if os.altsep else set())
    return text.endswith(".json") or any(sep in text for sep in separators)


def _use_file(text: str, names: Mapping[str, object]) -> bool:
    """A path-looking argument is a file; a bare word is a preset unless only a file has that name."""
    return _is_path_like(text) or (text not in names and looks_like_file(os.path.expanduser(text)))


def _load_file(text: str) -> DeviceSpec | ClusterSpec:
    data = _read_json(Path(text).expanduser(), text)
    if not isinstance(data, dict):
        raise SpecError(text, None, f"expected a JSON object (a cluster or a device spec), got {kind(data)}")
    if "groups" in data:
        return ClusterSpec.from_dict(data, text, devices=_device_table())
    if "peak_flops" in data:
        return DeviceSpec.from_dict(data, text)
    reason = "neither a cluster spec (needs 'groups') nor a device spec (needs 'peak_flops')"
    raise SpecError(text, None, reason)


def _unknown(text: str, names: Iterable[str], what: str) -> SpecError:
    reason = f"no such {what} preset or file{suggest(text, [*names, *_alias_table()])}; {_HINT}"
    return SpecError(f"hardware {text!r}", None, reason)


def get_device(name_or_path: str) -> DeviceSpec:
    """A device preset by name, or a device spec JSON file."""
    devices, aliases = _device_table(), _alias_table()
    if _use_file(name_or_path, {**devices, **aliases}):
        spec = _load_file(name_or_path)
        if not isinstance(spec, DeviceSpec):
            raise SpecError(name_or_path, None, "is a cluster spec; a device spec was expected")
        return spec
    name = aliases.get(name_or_path, name_or_path)
    if name in devices:
        return devices[name]
    raise _unknown(name_or_path, devices, "device")


def load_cluster(name_or_path: str, gpus: int | None = None) -> ClusterSpec:
    """Resolve ``--hardware`` (and ``--gpus``) to a cluster.

    ``name_or_path`` is a cluster preset, a device preset, or a JSON file holding either. A cluster
    is returned as is, or ``resized(gpus)``. A bare device becomes one node with one device; with
    ``gpus`` it is sized like the first homogeneous cluster preset built from that device (so
    ``h100-sxm`` with 16 GPUs is two DGX H100 nodes), or, when no preset uses it, one node of
    ``gpus`` devices on PCIe (``cluster.PCIE_GEN4_X16``).
    """
    if gpus is not None and (why := bounded_int(gpus, MAX_DEVICES)) is not None:
        raise SpecError("gpus", None, why)
    clusters, devices, aliases = _cluster_table(), _device_table(), _alias_table()
    known = {**devices, **clusters}
    spec: DeviceSpec | ClusterSpec
    name = aliases.get(name_or_path, name_or_path)
    if _use_file(name_or_path, {**known, **aliases}):
        spec = _load_file(name_or_path)
    elif name in clusters:  # clusters win over devices with the same name ("cpu")
        spec = clusters[name]
    elif name in devices:
        spec = devices[name]
    else:
        raise _unknown(name_or_path, known, "hardware")
    if isinstance(spec, ClusterSpec):
        return spec if gpus is None else spec.resized(gpus)
    if gpus is None:
        return ClusterSpec.single_node(spec)
    for cluster in clusters.values():
        if cluster.is_homogeneous and cluster.device == spec:
            return cluster.resized(gpus)
    return ClusterSpec.single_node(spec, gpus)
