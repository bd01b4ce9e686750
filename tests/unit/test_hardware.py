"""Hardware specs: presets, validation, resizing, loaders and their one-line errors."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coplan.errors import SpecError
from coplan.hardware import (
    DTYPES,
    ClusterSpec,
    DeviceSpec,
    InterconnectLevel,
    NodeGroup,
    canonical_dtype,
    cluster_presets,
    device_presets,
    get_device,
    hardware_aliases,
    load_cluster,
)

GiB = 2**30
DEVICE_NAMES = list(device_presets())
CLUSTER_NAMES = list(cluster_presets())


def _device(**overrides: Any) -> DeviceSpec:
    fields: dict[str, Any] = {
        "name": "toy",
        "vendor": "test",
        "peak_flops": {"bf16": 1e12},
        "vector_flops": 1e11,
        "memory_bytes": GiB,
        "memory_bandwidth": 1e11,
        "sram_bytes": 2**20,
        "kernel_launch_s": 1e-6,
    }
    fields.update(overrides)
    return DeviceSpec(**fields)


def _write(tmp_path: Path, data: object, name: str = "spec.json") -> str:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


# --- presets -------------------------------------------------------------------------------------


def test_required_presets_exist() -> None:
    assert {
        "a100-sxm-40gb", "a100-sxm-80gb", "h100-sxm", "h200", "b200",
        "mi300x", "tpu-v5e", "trainium2", "l4", "cpu",
    } <= set(DEVICE_NAMES)  # fmt: skip
    assert {
        "dgx-a100-40gb", "dgx-a100-80gb", "dgx-h100", "dgx-h200", "dgx-b200", "mi300x-node",
        "tpu-v5e-pod", "trn2-node", "l4-node", "cpu", "mixed-h100-a100",
    } <= set(CLUSTER_NAMES)  # fmt: skip


@pytest.mark.parametrize("name", DEVICE_NAMES)
def test_device_preset_is_valid_and_documented(name: str) -> None:
    device = get_device(name)
    assert device.name == name
    assert len(device.source) > 40, "every preset must say where its numbers come from"
    assert set(device.peak_flops) <= set(DTYPES)
    assert all(0.0 < f <= 1.0 for f in device.efficiency.values())
    # A dense peak for a wider type never exceeds a narrower one on the same matrix units.
    peaks = [device.peak(d) for d in ("fp32", "bf16", "fp8") if device.supports(d)]
    assert peaks == sorted(peaks)


@pytest.mark.parametrize("name", CLUSTER_NAMES)
def test_cluster_preset_is_valid(name: str) -> None:
    cluster = load_cluster(name)
    assert cluster.name == name and cluster.source
    assert cluster.num_devices >= 1
    assert cluster.inter_node is not None  # every preset can be sized past one node
    for group in cluster.groups:
        assert group.device == device_presets()[group.device.name]
        assert group.intra_node.scope == "node"


def test_data_sheet_numbers() -> None:
    h100, a100 = get_device("h100-sxm"), get_device("a100-sxm-80gb")
    assert h100.peak("bf16") == 989.4e12
    assert h100.peak("fp16") == 989.4e12
    assert h100.peak("tf32") == 494.7e12
    assert h100.peak("fp8") == 1978.9e12
    assert h100.memory_bytes == 80 * GiB and h100.memory_bandwidth == 3.35e12
    assert a100.peak("bf16") == 312e12 and a100.peak("fp32") == 19.5e12
    assert a100.memory_bandwidth == 2039e9
    assert get_device("a100-sxm-40gb").memory_bandwidth == 1555e9
    assert get_device("h200").memory_bytes == 141 * GiB
    assert get_device("h200").peak("bf16") == h100.peak("bf16")
    assert get_device("b200").peak("bf16") == 2.25e15
    assert get_device("mi300x").peak("fp8") == 2614.9e12
    assert get_device("tpu-v5e").peak("bf16") == 197e12
    assert get_device("trainium2").peak("fp8") == 1299e12
    assert get_device("l4").peak("fp8") == 242.5e12
    dgx = load_cluster("dgx-h100")
    assert dgx.groups[0].intra_node.bandwidth == 450e9
    assert dgx.inter_node is not None and dgx.inter_node.bandwidth == 50e9
    assert load_cluster("dgx-b200").groups[0].intra_node.bandwidth == 900e9


def test_unsupported_dtypes() -> None:
    a100 = get_device("a100-sxm-40gb")
    assert not a100.supports("fp8") and a100.peak("fp8") == 0.0
    assert not get_device("tpu-v5e").supports("fp8")
    assert get_device("h100-sxm").supports("float8_e4m3fn")


def test_dtype_spellings() -> None:
    assert canonical_dtype("torch.bfloat16") == "bf16"
    assert canonical_dtype("float32") == "fp32"
    assert get_device("h100-sxm").peak("half") == 989.4e12
    with pytest.raises(SpecError, match="int8"):
        get_device("h100-sxm").peak("int8")


def test_cpu_preset_is_one_device_cluster() -> None:
    cpu = load_cluster("cpu")
    assert cpu.num_devices == 1 and cpu.num_nodes == 1
    assert cpu.device == get_device("cpu")
    assert cpu.groups[0].intra_node.name == "loopback"


# --- resizing and heterogeneity ------------------------------------------------------------------


def test_resized_across_nodes() -> None:
    big = load_cluster("dgx-h100").resized(16)
    assert big.num_nodes == 2 and big.num_devices == 16 and big.groups[0].devices_per_node == 8
    assert load_cluster("dgx-h100", gpus=16) == big


def test_resized_within_a_node() -> None:
    small = load_cluster("dgx-h100").resized(4)
    assert small.num_nodes == 1 and small.num_devices == 4
    same = load_cluster("dgx-h100")
    assert same.resized(8) is same


@pytest.mark.parametrize("gpus", [12, 0, -8])
def test_resized_rejects_bad_counts(gpus: int) -> None:
    with pytest.raises(SpecError) as info:
        load_cluster("dgx-h100").resized(gpus)
    assert "dgx-h100" in str(info.value)
    if gpus == 12:
        assert "multiple of 8" in str(info.value)


def test_resized_needs_inter_node_link() -> None:
    one = ClusterSpec.single_node(get_device("h100-sxm"))
    with pytest.raises(SpecError, match="no inter-node"):
        one.resized(2)


def test_cpu_preset_sizes_to_host_processes() -> None:
    two = load_cluster("cpu", gpus=2)
    assert two.num_devices == 2 and two.inter_node is not None
    assert two.inter_node.name == "loopback"


def test_heterogeneous_cluster() -> None:
    mixed = load_cluster("mixed-h100-a100")
    assert not mixed.is_homogeneous
    assert {d.name for d in mixed.devices} == {"h100-sxm", "a100-sxm-80gb"}
    assert mixed.num_devices == 16 and mixed.num_nodes == 2
    with pytest.raises(SpecError, match="mixes device kinds"):
        _ = mixed.device
    with pytest.raises(SpecError, match="mixes device kinds"):
        mixed.resized(8)


def test_bare_device_becomes_cluster(tmp_path: Path) -> None:
    one = load_cluster("h100-sxm")
    assert one.num_devices == 1 and one.device == get_device("h100-sxm")
    assert load_cluster("h100-sxm", gpus=16).num_nodes == 2  # shaped like dgx-h100
    custom = _write(tmp_path, {**_device(name="custom").to_dict()})
    four = load_cluster(custom, gpus=4)
    assert four.num_devices == 4 and four.num_nodes == 1 and four.groups[0].intra_node.name == "pcie"


# --- direct construction -------------------------------------------------------------------------


def test_specs_are_hashable_and_normalised() -> None:
    a = _device(peak_flops={"bf16": 1e12, "fp8": 0})
    b = _device(peak_flops={"bf16": 1e12})
    assert a == b and hash(a) == hash(b) and not a.supports("fp8")
    assert len({a, b}) == 1
    with pytest.raises(TypeError):
        a.peak_flops["bf16"] = 2.0  # type: ignore[index]


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"name": ""}, "name"),
        ({"memory_bytes": -1}, "memory_bytes"),
        ({"memory_bytes": 1.5}, "memory_bytes"),
        ({"memory_bandwidth": float("nan")}, "memory_bandwidth"),
        ({"peak_flops": {"int8": 1e12}}, "peak_flops.int8"),
        ({"peak_flops": {"fp32": 0}}, "peak_flops"),
        ({"vector_flops": True}, "vector_flops"),
        ({"efficiency": {"matmul": 1.5}}, "efficiency.matmul"),
        ({"efficiency": {"typo": 0.5}}, "efficiency.typo"),
        ({"gemm_tiles": [[256, 0]], "compute_units": 108}, "gemm_tiles[0]"),
        ({"gemm_tiles": [[256]], "compute_units": 108}, "gemm_tiles[0]"),
        ({"gemm_tiles": "256x128", "compute_units": 108}, "gemm_tiles"),
        ({"gemm_tiles": [[256, 128]]}, "gemm_tiles"),  # no SMs to count waves over
    ],
)
def test_device_validation(overrides: dict[str, Any], field: str) -> None:
    with pytest.raises(SpecError) as info:
        _device(**overrides)
    assert info.value.field == field


def test_gemm_tiles_round_trip_through_json() -> None:
    dev = _device(gemm_tiles=[[256, 128], [128, 256]], compute_units=108)
    assert dev.gemm_tiles == ((256, 128), (128, 256))
    again = DeviceSpec.from_dict(json.loads(json.dumps(dev.to_dict())))
    assert again == dev and hash(again) == hash(dev)
    assert "gemm_tiles" not in _device().to_dict()


def test_cluster_validation() -> None:
    level = InterconnectLevel("nvlink", 1e11, 1e-6, "switch", "node")
    group = NodeGroup(_device(), 8, 2, level)
    with pytest.raises(SpecError, match="inter_node"):
        ClusterSpec("x", (group,), None)
    with pytest.raises(SpecError, match="scope"):
        ClusterSpec("x", (group,), level)  # a node-scope level between nodes
    with pytest.raises(SpecError, match="topology"):
        InterconnectLevel("nvlink", 1e11, 1e-6, "mesh", "node")
    with pytest.raises(SpecError, match="groups"):
        ClusterSpec("x", (), None)


# --- files and their errors ----------------------------------------------------------------------


def _error(tmp_path: Path, data: object) -> tuple[str, SpecError]:
    path = _write(tmp_path, data)
    with pytest.raises(SpecError) as info:
        load_cluster(path)
    message = str(info.value)
    assert path in message and "\n" not in message
    return message, info.value


def test_invalid_json_reports_position(tmp_path: Path) -> None:
    message, _ = _error(tmp_path, '{\n  "name": "x",\n  "groups": [,]\n}')
    assert "invalid JSON at line 3, column" in message


def test_missing_file() -> None:
    with pytest.raises(SpecError, match="no such file"):
        load_cluster("does/not/exist.json")


def test_unknown_field(tmp_path: Path) -> None:
    data = _device().to_dict() | {"memory_gb": 80}
    message, err = _error(tmp_path, data)
    assert err.field == "memory_gb" and "unknown field" in message


def test_missing_field(tmp_path: Path) -> None:
    data = _device().to_dict()
    del data["memory_bandwidth"]
    message, err = _error(tmp_path, data)
    assert err.field == "memory_bandwidth" and "missing required field" in message


def test_wrong_type_in_nested_device(tmp_path: Path) -> None:
    cluster = load_cluster("dgx-h100").to_dict()
    cluster["groups"][0]["device"]["memory_bytes"] = "80GB"
    message, err = _error(tmp_path, cluster)
    assert err.field == "groups[0].device.memory_bytes" and "expected an integer" in message


def test_bad_value_in_file_is_anchored_to_file(tmp_path: Path) -> None:
    cluster = load_cluster("dgx-h100").to_dict()
    cluster["inter_node"]["scope"] = "node"
    _, err = _error(tmp_path, cluster)
    assert err.field == "inter_node.scope"


def test_unknown_device_name_in_cluster_file(tmp_path: Path) -> None:
    cluster = {"name": "c", "groups": [{"device": "h100", "devices_per_node": 8, "nodes": 1,
               "intra_node": InterconnectLevel.loopback(1e9).to_dict()}]}  # fmt: skip
    message, err = _error(tmp_path, cluster)
    assert err.field == "groups[0].device" and "h100-sxm" in message


def test_neither_cluster_nor_device(tmp_path: Path) -> None:
    message, _ = _error(tmp_path, {"name": "x"})
    assert "neither" in message
    message, _ = _error(tmp_path, [1, 2])
    assert "JSON object" in message


def test_unknown_preset_suggests_and_hints() -> None:
    with pytest.raises(SpecError) as info:
        load_cluster("dgx-h10")
    message = str(info.value)
    assert "'dgx-h100'" in message and "coplan hardware" in message
    with pytest.raises(SpecError, match="h100-sxm"):
        get_device("h100-pcie")


@pytest.mark.parametrize(("alias", "preset"), [("a100", "a100-sxm-80gb"), ("h100", "h100-sxm")])
def test_short_device_names_are_the_presets_they_alias(alias: str, preset: str) -> None:
    assert get_device(alias) == get_device(preset)
    # sized like the preset: 16 H100 are two DGX H100 nodes
    assert load_cluster(alias, 16) == load_cluster(preset, 16)


def test_dgx_a100_is_the_80gb_system() -> None:
    assert load_cluster("dgx-a100", 64) == load_cluster("dgx-a100-80gb", 64)
    with pytest.raises(SpecError, match="device"):
        get_device("dgx-a100")  # a cluster alias is not a device


def test_aliases_name_presets_and_shadow_none() -> None:
    aliases = hardware_aliases()
    presets = {**device_presets(), **cluster_presets()}
    assert aliases and all(target in presets for target in aliases.values())
    assert not set(aliases) & set(presets)


def test_cluster_file_and_device_file(tmp_path: Path) -> None:
    spec = load_cluster("mixed-h100-a100")
    assert load_cluster(_write(tmp_path, spec.to_dict(), "c.json")) == spec
    device = get_device("l4")
    assert get_device(_write(tmp_path, device.to_dict(), "d.json")) == device


# --- round trips ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", DEVICE_NAMES)
def test_device_round_trip(name: str) -> None:
    device = get_device(name)
    assert DeviceSpec.from_dict(json.loads(json.dumps(device.to_dict()))) == device


@pytest.mark.parametrize("name", CLUSTER_NAMES)
def test_cluster_round_trip(name: str) -> None:
    original = load_cluster(name)
    variants = (original, original.resized(1)) if original.is_homogeneous else (original,)
    for cluster in variants:
        assert ClusterSpec.from_dict(json.loads(json.dumps(cluster.to_dict()))) == cluster


_positive = st.floats(min_value=1e-3, max_value=1e18, allow_nan=False, allow_infinity=False)


@settings(max_examples=50, deadline=None)
@given(
    peaks=st.dictionaries(st.sampled_from(DTYPES), _positive, min_size=1),
    memory=st.integers(min_value=1, max_value=2**50),
    launch=st.floats(min_value=0, max_value=1e-3),
    matmul=st.floats(min_value=0.01, max_value=1.0),
)
def test_random_device_round_trip(peaks: dict[str, float], memory: int, launch: float, matmul: float) -> None:
    efficiency = {"matmul": matmul}
    device = _device(peak_flops=peaks, memory_bytes=memory, kernel_launch_s=launch, efficiency=efficiency)
    again = DeviceSpec.from_dict(json.loads(json.dumps(device.to_dict())))
    assert again == device and hash(again) == hash(device)


@pytest.mark.parametrize(
    ("tiles", "field"),
    [
        ({"query_blocks": [[0, 32], [192, 0]], "kv_block": 512}, "attention_tiles.query_blocks[1][1]"),
        ({"query_blocks": [[16, 32]], "kv_block": 512}, "attention_tiles.query_blocks"),
        ({"query_blocks": [[0, 32], [0, 64]], "kv_block": 512}, "attention_tiles.query_blocks"),
        ({"query_blocks": [[0]], "kv_block": 512}, "attention_tiles.query_blocks[0]"),
        ({"query_blocks": [[0, 32]], "kv_block": 0}, "attention_tiles.kv_block"),
        (
            {"query_blocks": [[0, 32]], "kv_block": 8, "tile_s": {"fwd.fp32": 1e-6}},
            "attention_tiles.tile_s.fwd.fp32",
        ),
        (
            {"query_blocks": [[0, 32]], "kv_block": 8, "tile_s": {"forward.fp32": -1}},
            "attention_tiles.tile_s.forward.fp32",
        ),
        ({"query_blocks": [[0, 32]], "kv_block": 8, "extra": 1}, "attention_tiles.extra"),
    ],
)
def test_attention_tiles_bad_input_names_the_field(tmp_path: Path, tiles: dict[str, Any], field: str) -> None:
    data = {**device_presets()["cpu"].to_dict(), "attention_tiles": tiles}
    with pytest.raises(SpecError) as info:
        DeviceSpec.from_dict(data, "dev.json")
    assert info.value.field == field


def test_attention_tiles_round_trip_and_stay_out_of_the_presets() -> None:
    from coplan.hardware.tiling import TORCH_CPU_FLASH

    cpu = device_presets()["cpu"]
    assert all(d.attention_tiles is None for d in device_presets().values())
    assert "attention_tiles" not in cpu.to_dict()
    tiled = replace(cpu, attention_tiles=TORCH_CPU_FLASH.with_costs({"backward.bf16": 8e-5}))
    again = DeviceSpec.from_dict(json.loads(json.dumps(tiled.to_dict())))
    assert again == tiled and hash(again) == hash(tiled)


def test_matmul_call_costs_validate_and_round_trip() -> None:
    cpu = device_presets()["cpu"]
    assert "matmul_call_s" not in cpu.to_dict()
    timed = replace(cpu, matmul_call_s={"bf16": 1.5e-5, "fp32": 4e-6}, host_op_s=2.5e-6)
    assert DeviceSpec.from_dict(json.loads(json.dumps(timed.to_dict()))) == timed
    assert "host_op_s" not in cpu.to_dict() and cpu.host_op_s == 0.0
    for key, bad, field in (
        ("host_op_s", -1e-6, "host_op_s"),
        ("host_op_s", "fast", "host_op_s"),
        ("matmul_call_s", {"int8": 1e-6}, "matmul_call_s.int8"),
        ("matmul_call_s", {"bf16": -1.0}, "matmul_call_s.bf16"),
        ("attention_parallel_half", {"fwd": 100}, "attention_parallel_half.fwd"),
        ("attention_parallel_half", {"forward": "x"}, "attention_parallel_half.forward"),
    ):
        with pytest.raises(SpecError) as info:
            DeviceSpec.from_dict({**cpu.to_dict(), key: bad}, "dev.json")
        assert info.value.field == field
    h100 = device_presets()["h100-sxm"]
    assert DeviceSpec.from_dict(json.loads(json.dumps(h100.to_dict()))) == h100


def test_attention_kernels_validate_round_trip_and_name_what_the_presets_price() -> None:
    h100 = device_presets()["h100-sxm"]
    assert h100.attention_kernel == "cudnn" and h100.attention_rates("flash2") == (0.414, 0.3, 0.148)
    assert h100.attention_rates("flash3") is None
    assert device_presets()["a100-sxm-80gb"].attention_kernel == "flash2"
    # MPT's Triton kernel: FlashAttention-2's rates over what llm-foundry's own sequence sweep
    # measured it at (1.768x on the H100, 1.732x on the A100; no dropout path)
    fwd, bwd, dropout = h100.attention_rates("triton")
    assert fwd == pytest.approx(0.414 / 1.768, abs=5e-4) and bwd == pytest.approx(0.3 / 1.768, abs=5e-4)
    assert dropout == 0.0
    a100 = device_presets()["a100-sxm-80gb"]
    assert a100.attention_rates("triton")[0] == pytest.approx(a100.efficiency["attention"] / 1.732, abs=5e-4)
    assert DeviceSpec.from_dict(json.loads(json.dumps(h100.to_dict()))) == h100
    # a kernel without its backward runs the forward fraction both ways, dropout free
    bare = replace(h100, attention_kernels={"flash3.forward": 0.6})
    assert bare.attention_rates("flash3") == (0.6, 0.6, 0.0)
    for bad, field in (
        ({"flash4.forward": 0.4}, "attention_kernels.flash4.forward"),
        ({"flash2.fwd": 0.4}, "attention_kernels.flash2.fwd"),
        ({"flash2.forward": 1.5}, "attention_kernels.flash2.forward"),
        ({"flash2.forward": 0.0}, "attention_kernels.flash2.forward"),
        ({"flash2.forward": 0.4, "flash2.dropout": -0.1}, "attention_kernels.flash2.dropout"),
        ({"flash2.backward": 0.4}, "attention_kernels.flash2.forward"),
        ({"cudnn.forward": 0.5}, "attention_kernels.cudnn.forward"),  # the device's own kernel
        ([0.4], "attention_kernels"),
    ):
        with pytest.raises(SpecError) as info:
            DeviceSpec.from_dict({**h100.to_dict(), "attention_kernels": bad}, "dev.json")
        assert info.value.field == field, bad
    with pytest.raises(SpecError) as info:
        DeviceSpec.from_dict({**h100.to_dict(), "attention_kernel": "xformers"}, "dev.json")
    assert info.value.field == "attention_kernel"


def test_oversubscription_slows_groups_that_leave_a_leaf() -> None:
    from dataclasses import replace

    from coplan.cost.comm import Group

    cluster = load_cluster("dgx-h100", 1024)  # 128 nodes, 32 a leaf, non-blocking
    inter = cluster.inter_node
    assert inter is not None and inter.leaf_nodes == 32 and inter.oversubscription == 1.0
    tapered = replace(cluster, inter_node=replace(inter, oversubscription=2.0))
    # one rank a node: the group's whole ring runs over the network
    wide, narrow = (1024 // 8, 8), (16, 8)  # 128 nodes; 16 nodes, inside one leaf
    bytes_ = 1e9
    for size, stride in (wide, narrow):
        flat = Group.of(cluster, size, stride, 1.0).all_gather(bytes_)
        slow = Group.of(tapered, size, stride, 1.0).all_gather(bytes_)
        latency = Group.of(cluster, size, stride, 1.0)._ring_latency()
        if size > 32:
            # the bandwidth term doubles, the latency stays
            assert slow - latency == pytest.approx(2 * (flat - latency), rel=1e-9)
        else:
            assert slow == flat
    got = InterconnectLevel.from_dict(replace(inter, oversubscription=2.0).to_dict())
    assert got.oversubscription == 2.0 and got.leaf_nodes == 32
    with pytest.raises(SpecError, match="oversubscription"):
        replace(inter, oversubscription=0.5)
    with pytest.raises(SpecError, match="leaf_nodes"):
        replace(inter, leaf_nodes=0)
