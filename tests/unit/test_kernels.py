"""The cost model's kernel rules: the refinements a calibrated CPU opts into (vector families,
first-touch tier, per-dtype attention, tiled attention, GEMM call cost and operand layout, the host's
time for views), GPU attention occupancy and dropout, each priced exactly as its rule states."""

from __future__ import annotations

import pytest

from coplan.cost import CostModel, TrainingConfig
from coplan.hardware import load_cluster
from coplan.models.spec import PRESETS

# --- refinements a calibrated CPU opts into (devices without their keys price as before) ----------


def _kernel_rates(**efficiency: float) -> tuple[object, object]:
    from dataclasses import replace as _replace

    from coplan.cost.kernels import Rates
    from coplan.hardware import device_presets

    cpu = device_presets()["cpu"]
    device = _replace(cpu, efficiency={**cpu.efficiency, **efficiency})
    return device, Rates.of(device, "bf16")


def _vector_kernel(family: str = "elementwise", flops: float = 1e9, fresh: tuple = ()) -> object:
    from coplan.cost.parts import Kernel
    from coplan.hardware.device import VECTOR_FAMILIES
    from coplan.ir.types import Phase

    split = tuple(flops if f == family else 0.0 for f in VECTOR_FAMILIES)
    return Kernel(Phase.FORWARD, "vector", 0, 0.0, flops, (0, 0, 0, 0, 8.0, 0), vec_split=split, fresh=fresh)


_SCALE_BYTES = (2.0, 2.0, 4.0, 4.0, 1.0, 1.0)


def test_devices_without_the_refinement_keys_keep_one_vector_rate_and_no_tiers():
    from coplan.cost.kernels import Rates
    from coplan.hardware import device_presets

    for name, device in device_presets().items():
        for dtype in ("fp32", "bf16"):
            r = Rates.of(device, dtype)
            assert r.vec_rates == () and r.attn_head_half == 0.0 and r.first_touch == 0.0, name
            assert r.host_op_s == 0.0 and r.mm_tn == 1.0, name
            assert r.attn_bwd_flops == r.attn_flops, name


def test_vector_families_are_priced_at_their_own_rate():
    from coplan.cost.kernels import Scale, kernel_time

    device, rates = _kernel_rates(**{"vector": 0.1, "vector.transcendental.bf16": 0.025})
    scale = Scale(1, False, _SCALE_BYTES, 2, True)
    plain = kernel_time(_vector_kernel("elementwise"), rates, scale) - rates.launch_s
    gelu = kernel_time(_vector_kernel("transcendental"), rates, scale) - rates.launch_s
    assert plain == pytest.approx(1e9 / (device.vector_flops * 0.1))
    assert gelu == pytest.approx(4 * plain)  # a quarter of the rate per counted FLOP
    assert device.vector_efficiency("transcendental", "fp32") == 0.1  # other dtypes fall back


def test_fresh_tensors_as_large_as_the_cache_pay_the_first_touch_tier():
    from coplan.cost.kernels import Scale, kernel_time

    device, rates = _kernel_rates(first_touch=0.01)
    scale = Scale(1, False, _SCALE_BYTES, 2, True)
    elements = device.sram_bytes / 4  # an fp32-class slot (index 2): exactly the cache's size
    big = (0.0, 0.0, float(elements), 0.0, 0.0, 0.0)
    small = (0.0, 0.0, float(elements - 1), 0.0, 0.0, 0.0)
    base = kernel_time(_vector_kernel(flops=1e3), rates, scale)
    extra = kernel_time(_vector_kernel(flops=1e3, fresh=(big,)), rates, scale) - base
    assert extra == pytest.approx(device.sram_bytes / (device.memory_bandwidth * 0.01))
    assert kernel_time(_vector_kernel(flops=1e3, fresh=(small,)), rates, scale) == base


def test_a_measured_attention_efficiency_per_dtype_also_derates_the_head_dimension():
    from dataclasses import replace as _replace

    from coplan.cost.kernels import Scale, kernel_time, shape_factor
    from coplan.cost.parts import Kernel
    from coplan.ir.types import Phase

    scale = Scale(1, False, _SCALE_BYTES, 2, True)

    def per_flop(rates: object, d: int, phase: Phase = Phase.FORWARD) -> float:
        flops = 4.0 * 8 * 256 * 256 * d
        k = Kernel(phase, "attention", 0, flops, 0.0, (0, 0, 0, 0, 0, 0), attn=(8, 256, 256, d))
        return (kernel_time(k, rates, scale) - rates.launch_s) / flops  # type: ignore[attr-defined]

    _, old = _kernel_rates(matmul=0.5, attention=0.2)
    old = _replace(old, half_dim=32.0)
    assert per_flop(old, 32) == pytest.approx(per_flop(old, 128))
    _, new = _kernel_rates(**{"attention.bf16": 0.2, "attention_backward.bf16": 0.1})
    new = _replace(new, half_dim=32.0, attn_head_half=32.0)
    ratio = shape_factor((128,), 32.0) / shape_factor((32,), 32.0)
    assert per_flop(new, 32) / per_flop(new, 128) == pytest.approx(ratio)
    assert per_flop(new, 64, Phase.BACKWARD) == pytest.approx(2 * per_flop(new, 64))


def test_flash_attention_dropout_slowdown():
    from coplan.cost.kernels import FLASH_DROPOUT_COST, Rates, Scale, kernel_time
    from coplan.cost.parts import Kernel
    from coplan.hardware import get_device
    from coplan.ir.types import Phase

    rates = Rates.of(get_device("h100-sxm"), "bf16")
    scale = Scale(1, False, _SCALE_BYTES, 2, True)
    flops = 4.0 * 32 * 4096 * 4096 * 128
    k = Kernel(Phase.FORWARD, "attention", 1, flops, 0.0, (0.0,) * 6, attn=(32, 4096, 4096, 128))
    kd = Kernel(
        Phase.FORWARD, "attention", 1, flops, 0.0, (0.0,) * 6, attn=(32, 4096, 4096, 128), dropout=0.1
    )
    t, td = (kernel_time(x, rates, scale) - rates.launch_s for x in (k, kd))
    assert td == pytest.approx(t * (1 + FLASH_DROPOUT_COST))


def _attention_kernel(phase: object, b: int, h: int, s: int, d: int, dropout: float = 0.0) -> object:
    from coplan.cost.parts import TP, Kernel
    from coplan.ir.types import Phase

    flops = 4.0 * b * h * s * s * d * (2.5 if phase is Phase.BACKWARD else 1.0)
    return Kernel(phase, "attention", TP, flops, 0.0, (0.0,) * 6, attn=(b * h, s, s, d), dropout=dropout)


def test_a_forced_attention_kernel_is_priced_at_its_own_rates():
    """``attention_kernel="flash2"`` on an H100 prices FlashAttention-2 at the preset's own
    fractions and dropout cost; "auto" and the device's own name price its default (cuDNN)."""
    from coplan.cost.kernels import FLASH_DROPOUT_COST, Rates, Scale, kernel_time
    from coplan.hardware import get_device
    from coplan.ir.types import Phase

    h100 = get_device("h100-sxm")
    auto, own, fa2 = (Rates.of(h100, "bf16", k) for k in ("auto", "cudnn", "flash2"))
    assert own == auto and auto.attn_dropout == FLASH_DROPOUT_COST
    fwd, bwd, dropout = h100.attention_rates("flash2")  # type: ignore[misc]
    scale = Scale(4, True, _SCALE_BYTES, 2, True)
    for phase, eff in ((Phase.FORWARD, fwd), (Phase.BACKWARD, bwd)):
        kind = "attention" if phase is Phase.FORWARD else "attention_backward"
        default_eff = h100.efficiency_of(kind, "bf16")
        for p in (0.0, 0.1):
            k = _attention_kernel(phase, 1, 96, 2048, 128, p)
            slow = (1 + dropout) / (1 + FLASH_DROPOUT_COST) if p else 1.0
            t_auto, t_fa2 = (kernel_time(k, r, scale) - r.launch_s for r in (auto, fa2))
            assert t_fa2 == pytest.approx(t_auto * default_eff / eff * slow, rel=1e-12)
    # fp8 training keeps attention in 16 bits: the same FlashAttention-2 rates
    assert Rates.of(h100, "fp8", "flash2").attn_flops == fa2.attn_flops


def test_h100_flash2_rates_reproduce_the_measured_kernels():
    """The preset's FlashAttention-2 fractions, under the shape and occupancy deratings every fused
    kernel shares, give PyTorch's FlashAttention-2 times on one H100
    (benchmarks/data/h100_microbench.json) within 8% per point, dropout included."""
    import json
    from pathlib import Path

    from coplan.cost.kernels import Rates, Scale, kernel_time
    from coplan.hardware import get_device
    from coplan.ir.types import Phase

    data = Path(__file__).parents[2] / "benchmarks" / "data" / "h100_microbench.json"
    rates = Rates.of(get_device("h100-sxm"), "bf16", "flash2")
    scale = Scale(1, False, _SCALE_BYTES, 2, True)
    points = json.loads(data.read_text())["attention"]
    assert len(points) >= 6
    for m in points:
        args = (m["b"], m["h"], m["s"], m["d"], m["dropout"])
        fwd = kernel_time(_attention_kernel(Phase.FORWARD, *args), rates, scale)
        bwd = kernel_time(_attention_kernel(Phase.BACKWARD, *args), rates, scale)
        assert fwd + bwd == pytest.approx(m["fwd_bwd_s"], rel=0.08), m
        assert fwd == pytest.approx(m["fwd_s"], rel=0.08), m


def test_an_attention_kernel_the_device_cannot_price_is_a_config_error():
    from coplan.cost import ConfigError
    from coplan.cost.kernels import Rates
    from coplan.hardware import get_device

    with pytest.raises(ConfigError, match="'b200' has no rates for 'flash2'") as info:
        Rates.of(get_device("b200"), "bf16", "flash2")
    assert info.value.field == "attention_kernel"
    with pytest.raises(ConfigError, match="must be one of auto, cudnn, flash2, flash3, triton"):
        TrainingConfig(attention_kernel="sdpa")


@pytest.mark.parametrize(
    ("q", "kv", "causal", "tiles"),
    [
        (64, 64, True, 2),  # two 32-row tiles, each over all 64 keys (one key tile)
        (128, 128, True, 4),
        (191, 191, True, 6),  # last 32-row threshold: ceil(191 / 32) query tiles
        (192, 192, True, 3),  # 64-row tiles from 192
        (1024, 1024, True, 6),  # 256-row tiles from 768: key tiles 1, 1, 2, 2 (512 keys each)
        (4096, 4096, False, 128),  # 16 query tiles x 8 key tiles
        (0, 128, True, 0),
    ],
)
def test_torch_cpu_flash_tile_counts(q: int, kv: int, causal: bool, tiles: int) -> None:
    from coplan.hardware.tiling import TORCH_CPU_FLASH

    assert TORCH_CPU_FLASH.tiles(q, kv, causal) == tiles


def test_a_tiled_attention_kernel_costs_its_flops_plus_its_tiles():
    """time = causal FLOPs / rate + (batch x heads / tp) x tiles x tile cost + launch, with no shape
    derating; the tile cost is per phase and dtype."""
    from dataclasses import replace as _replace

    from coplan.cost.kernels import Rates, Scale, kernel_time
    from coplan.cost.parts import TP, Kernel
    from coplan.hardware.tiling import TORCH_CPU_FLASH
    from coplan.ir.types import Phase

    device, _ = _kernel_rates(**{"attention.bf16": 0.2, "attention_backward.bf16": 0.1})
    costs = {"forward.bf16": 5e-6, "backward.bf16": 4e-5}
    device = _replace(device, attention_tiles=TORCH_CPU_FLASH.with_costs(costs), matmul_half_dim=32.0)
    rates = Rates.of(device, "bf16")
    peak = device.peak("bf16")
    for tp in (1, 2):
        scale = Scale(tp, False, _SCALE_BYTES, 2, True)
        for phase, eff, cost, mult in ((Phase.FORWARD, 0.2, 5e-6, 1.0), (Phase.BACKWARD, 0.1, 4e-5, 2.5)):
            flops = mult * 4.0 * 16 * 128 * 128 * 32
            k = Kernel(phase, "attention", TP, flops, 0.0, (0, 0, 0, 0, 0, 0), attn=(16, 128, 128, 32))
            want = 0.5 * flops / tp / (peak * eff) + 16 / tp * 4 * cost + rates.launch_s
            assert kernel_time(k, rates, scale) == pytest.approx(want, rel=1e-12)
    # an fp32 run has no tile cost given: its FLOPs alone
    fp32 = Rates.of(device, "fp32")
    assert fp32.attn_tiling is not None and fp32.attn_tile_s == fp32.attn_bwd_tile_s == 0.0


def test_fused_attention_slows_with_few_query_tiles_per_gpu():
    """``attention_parallel_half``: u query tiles (local batch x heads x seq / 128) reach
    u / (u + half) of the full rate, per phase; tensor parallelism divides the heads, so the same
    layer at tp 4 runs each GPU's quarter at a lower rate."""
    from dataclasses import replace as _replace

    from coplan.cost.kernels import Rates, Scale, kernel_time
    from coplan.cost.parts import TP, Kernel
    from coplan.hardware import device_presets
    from coplan.ir.types import Phase

    h100 = device_presets()["h100-sxm"]
    plain = _replace(h100, attention_parallel_half={})
    fast, slow = Rates.of(plain, "bf16"), Rates.of(h100, "bf16")
    halves = {Phase.FORWARD: 424.0, Phase.BACKWARD: 185.0}
    assert dict(h100.attention_parallel_half) == {"forward": 424.0, "backward": 185.0}
    for tp in (1, 4):
        scale = Scale(tp, False, _SCALE_BYTES, 2, True)
        for phase, half in halves.items():
            k = Kernel(
                phase, "attention", TP, 4.0 * 16 * 4096**2 * 128, 0.0, (0,) * 6, attn=(16, 4096, 4096, 128)
            )
            tiles = 16 / tp * 4096 / 128
            want = (kernel_time(k, fast, scale) - fast.launch_s) * (tiles + half) / tiles
            assert kernel_time(k, slow, scale) - slow.launch_s == pytest.approx(want, rel=1e-12)


# --- GEMM operand layout (weight gradients) ---------------------------------------------------------


def _tn_marks(prof: object) -> list[tuple[str, tuple[int, int, int], bool]]:
    parts = (prof.templates[0], prof.post)  # type: ignore[attr-defined]
    return [
        (k.phase.value, k.dims, k.tn)
        for part in parts
        for k in (*part.forward, *part.backward)
        if k.kind == "matmul"
    ]


def test_weight_gradient_gemms_and_only_they_have_a_transposed_left_operand():
    # one per Linear of a block (QKV, output projection, MLP up and down) and the LM head's;
    # the forward GEMMs (x @ W.T) and input gradients (g @ W) keep a contiguous left operand
    from coplan.capture.api import capture_spec
    from coplan.capture.synthetic import build_graph

    spec, b, s = PRESETS["gpt-tiny"], 2, 32
    for graph in (capture_spec(spec, b, s), build_graph(spec, b, s)):
        marks = _tn_marks(CostModel(graph=graph).profile(b, s, "none"))
        tn = [m for m in marks if m[2]]
        assert len(tn) == 5 and all(phase == "backward" for phase, _, _ in tn)
        # a weight gradient reduces over the tokens: K = batch x sequence
        assert all(dims[2] == b * s for _, dims, _ in tn)
        assert not any(m[2] for m in marks if m[0] == "forward")


def test_a_transposed_left_operand_runs_at_its_own_fraction_of_the_gemm_rate():
    from dataclasses import replace as _replace

    from coplan.cost.kernels import Scale, kernel_time
    from coplan.cost.parts import Kernel
    from coplan.ir.types import Phase

    device, rates = _kernel_rates(**{"matmul.bf16": 0.8, "matmul_tn.bf16": 0.75})
    rates = _replace(rates, half_dim=0.0, mm_call_s=0.0)
    scale = Scale(1, False, _SCALE_BYTES, 2, True)
    flops = 2.0 * 4096**3  # compute-bound: memory time is far below
    k = Kernel(Phase.BACKWARD, "matmul", 0, flops, 0.0, (0, 0, 0, 0, 0, 0), dims=(4096, 4096, 4096))
    plain = kernel_time(k, rates, scale) - rates.launch_s
    assert plain == pytest.approx(flops / (device.peak("bf16") * 0.8))
    assert kernel_time(_replace(k, tn=True), rates, scale) - rates.launch_s == pytest.approx(plain / 0.75)
    assert _kernel_rates()[1].mm_tn == 1.0  # absent: no penalty (every preset)


def test_views_cost_the_host_in_eager_steps_only():
    # a CPU's eager step dispatches and records every view; a compiled graph (explicit fusion
    # groups) and a GPU (host_op_s 0: the host runs ahead) pay nothing for them
    from dataclasses import replace as _replace

    from coplan.capture.api import capture_spec

    spec, b, s = PRESETS["gpt-tiny"], 2, 32
    graph = capture_spec(spec, b, s)
    cm = CostModel(graph=graph)
    prof = cm.profile(b, s, "none")
    parts = [(t, len(t.blocks)) for t in prof.templates] + [(prof.pre, 1), (prof.post, 1)]
    views = sum(
        n for part, n in parts for k in (*part.forward, *part.backward, *part.optimizer) if k.kind == "free"
    )
    assert views > 0
    cpu = load_cluster("cpu", 1)
    host = _replace(cpu, groups=(_replace(cpu.groups[0], device=_replace(cpu.device, host_op_s=2e-6)),))
    config = TrainingConfig(microbatch=b, global_batch=b, seq=s, fusion="none", dtype="fp32")
    extra = cm.estimate(host, config).step_time_s - cm.estimate(cpu, config).step_time_s
    assert extra == pytest.approx(views * 2e-6, rel=1e-9)
    groups = tuple((op.id,) for op in graph.ops)  # every op its own group: compiled, not eager
    compiled = config.with_(fusion=groups)
    assert cm.estimate(host, compiled).step_time_s == pytest.approx(cm.estimate(cpu, compiled).step_time_s)


def test_synchronous_launches_add_each_kernels_host_time() -> None:
    # CUDA_LAUNCH_BLOCKING=1: every launched kernel (none for a view) adds the host's issue time
    from dataclasses import replace as _replace

    from coplan.cost.kernels import Rates, Scale, kernel_time, launches
    from coplan.cost.optimizer import FOR_LOOP_OP_S

    cm = CostModel(spec=PRESETS["gpt2-124m"])
    config = TrainingConfig(microbatch=2, global_batch=2, flash_attention=False)
    prof = cm.profile(2, 1024, "megatron")
    rates = Rates.of(load_cluster("dgx-a100-80gb", 1).groups[0].device, "bf16")
    scale = Scale.of(config)
    blocking = Scale.of(config.with_(launch_blocking=True))
    assert blocking == _replace(scale, launch_blocking=True)
    kinds = set()
    for k in (*prof.templates[0].forward, *prof.templates[0].backward, *prof.post.forward):
        kinds.add(k.kind)
        extra = kernel_time(k, rates, blocking) - kernel_time(k, rates, scale)
        assert extra == pytest.approx(launches(k, scale) * FOR_LOOP_OP_S)
    assert {"matmul", "attention"} <= kinds
    slow = cm.estimate(load_cluster("dgx-a100-80gb", 1), config.with_(launch_blocking=True))
    fast = cm.estimate(load_cluster("dgx-a100-80gb", 1), config)
    assert slow.step_time_s > fast.step_time_s
    assert config.with_(launch_blocking=True).to_dict()["launch_blocking"] is True
    assert "launch_blocking" not in config.to_dict()


# --- wave quantization of library GEMMs (``DeviceSpec.gemm_tiles``) --------------------------------


@pytest.mark.parametrize(
    ("m", "n", "expected"),
    [
        (2048, 7168, 448 / 540),  # 8 x 56 tiles either way: 5 waves of 108, the last 16 full
        (8192, 7168, 1792 / 1836),  # 32 x 56 = 1,792 tiles: 17 waves
        (13824, 1024, 1.0),  # 54 x 8 = 432 tiles: exactly 4 waves (BigScience's 864-multiple width)
        (1024, 1024, 1.0),  # 32 tiles, fewer than SMs: cuBLAS splits K instead
        (2304, 4096, 288 / 324),  # 9 x 32 = 288 tiles (and 18 x 16): 3 waves
        (2048, 2176, 144 / 216),  # 128 x 256: 16 x 9 = 144 tiles beat 256 x 128's 8 x 17 = 136
    ],
)
def test_wave_efficiency_is_the_busy_share_of_the_best_tiles_waves(m: int, n: int, expected: float) -> None:
    from coplan.cost.kernels import wave_efficiency

    tiles = ((256, 128), (128, 256))
    assert wave_efficiency(m, n, tiles, 108) == pytest.approx(expected)


def test_a100_gemms_pay_for_their_last_wave_and_hopper_gemms_do_not() -> None:
    """The A100 presets give cuBLAS's Ampere tiles: a compute-bound GEMM takes its shape-derated
    time over its wave efficiency; the Hopper presets give none (persistent kernels), so their
    GEMMs price as the shape derating alone."""
    from dataclasses import replace as _replace

    from coplan.cost.kernels import Rates, Scale, kernel_time, wave_efficiency
    from coplan.cost.parts import ZERO, Kernel
    from coplan.ir.types import Phase

    m, n, k = 2048, 7168, 14336
    gemm = Kernel(Phase.FORWARD, "matmul", 0, 2.0 * m * n * k, 0.0, ZERO, dims=(m, n, k))
    scale = Scale.of(TrainingConfig(microbatch=1, global_batch=1, seq=2048))
    a100 = load_cluster("dgx-a100-80gb", 1).device
    assert a100.gemm_tiles and a100.compute_units == 108
    plain = _replace(a100, gemm_tiles=())
    with_waves = kernel_time(gemm, Rates.of(a100, "bf16"), scale)
    without = kernel_time(gemm, Rates.of(plain, "bf16"), scale)
    launch = a100.kernel_launch_s
    wave = wave_efficiency(m, n, a100.gemm_tiles, 108)
    assert wave < 1.0
    assert with_waves - launch == pytest.approx((without - launch) / wave)
    assert not load_cluster("dgx-h100", 1).device.gemm_tiles
