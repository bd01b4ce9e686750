"""The cost model: closed-form activation memory, invariants of the step-time model, config errors."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coplan.cli import main
from coplan.cost import BREAKDOWN_KEYS, ConfigError, CostModel, TrainingConfig
from coplan.hardware import load_cluster
from coplan.models.spec import PRESETS, ModelSpec

GPT = ModelSpec(name="gpt-test", n_layers=4, d_model=1024, n_heads=16, vocab_size=8192, seq_len=1024)


def _one_layer_activations(config: TrainingConfig, spec: ModelSpec = GPT) -> float:
    """Activation bytes of one layer for one microbatch: the difference between 2 and 1 layers."""
    cluster = load_cluster("dgx-a100-80gb", config.gpus)
    two = CostModel(spec=ModelSpec(**{**spec.to_dict(), "n_layers": 2})).estimate(cluster, config)
    one = CostModel(spec=ModelSpec(**{**spec.to_dict(), "n_layers": 1})).estimate(cluster, config)
    return two.memory.activations_bytes - one.memory.activations_bytes


@pytest.mark.parametrize(
    ("tp", "sp", "recompute", "closed_form"),
    [
        # Korthikanti et al. 2022 (arXiv 2205.05198), Sec. 4, per layer in 16-bit bytes, without
        # the dropout terms (coplan's GPT has no dropout): attention 10sbh + 2as^2b (softmax output),
        # MLP 18sbh, norms 4sbh -> 32sbh + 2as^2b.
        (1, False, "none", lambda s, b, h, a, t: s * b * h * 32 + 2 * a * s * s * b),
        # tensor parallel: norm inputs, QKV and fc1 inputs stay replicated (8sbh), the rest /t
        (4, False, "none", lambda s, b, h, a, t: s * b * h * (8 + 24 / t) + 2 * a * s * s * b / t),
        # plus sequence parallel: everything /t
        (4, True, "none", lambda s, b, h, a, t: s * b * h * 32 / t + 2 * a * s * s * b / t),
        # selective recompute of the attention core drops the a s^2 b term
        (4, True, "selective", lambda s, b, h, a, t: s * b * h * 32 / t),
        # full recompute keeps the layer input only
        (1, False, "full", lambda s, b, h, a, t: 2 * s * b * h),
    ],
)
def test_activation_memory_matches_closed_form(tp, sp, recompute, closed_form):
    b, s, h, a = 2, 1024, GPT.d_model, GPT.n_heads
    config = TrainingConfig(
        tp=tp,
        microbatch=b,
        global_batch=b,
        seq=s,
        sequence_parallel=sp,
        recompute=recompute,
        dtype="bf16",
        flash_attention=False,
    )
    got = _one_layer_activations(config)
    want = closed_form(s, b, h, a, tp)
    # coplan also keeps the norms' fp32 mean and rstd (4 x 4 sb bytes), which the formula leaves out
    assert got == pytest.approx(want, rel=0.01)


def _est(config: TrainingConfig, spec: ModelSpec = GPT, cluster: str = "dgx-h100"):
    return CostModel(spec=spec).estimate(load_cluster(cluster, config.gpus), config)


def test_breakdown_sums_to_step_time_and_keys():
    config = TrainingConfig(
        tp=2,
        pp=2,
        dp=2,
        microbatch=2,
        global_batch=16,
        seq=512,
        recompute="selective",
        sequence_parallel=True,
        zero=1,
    )
    est = _est(config)
    assert tuple(est.breakdown_s) == BREAKDOWN_KEYS
    assert sum(est.breakdown_s.values()) == pytest.approx(est.step_time_s, rel=1e-9)
    assert est.tokens_per_s == pytest.approx(16 * 512 / est.step_time_s)
    assert 0 < est.mfu < 1


def test_recompute_trades_memory_for_time():
    base = TrainingConfig(microbatch=4, global_batch=8, seq=1024)
    none, sel, full = (_est(base.with_(recompute=r)) for r in ("none", "selective", "full"))
    assert full.memory.activations_bytes < sel.memory.activations_bytes <= none.memory.activations_bytes
    assert full.step_time_s > sel.step_time_s >= none.step_time_s
    assert full.breakdown_s["recompute"] > 0 and none.breakdown_s["recompute"] == 0


def test_flash_attention_saves_memory_and_time():
    base = TrainingConfig(microbatch=2, global_batch=2, seq=1024)
    on, off = _est(base), _est(base.with_(flash_attention=False))
    assert off.memory.activations_bytes > on.memory.activations_bytes
    assert off.step_time_s > on.step_time_s


def test_zero_shards_optimizer_gradients_parameters():
    base = TrainingConfig(dp=8, microbatch=1, global_batch=8, seq=256)
    z = [_est(base.with_(zero=k)).memory for k in range(4)]
    assert z[1].optimizer_bytes == pytest.approx(z[0].optimizer_bytes / 8)
    assert z[2].grads_bytes == pytest.approx(z[0].grads_bytes / 8)
    assert z[3].params_bytes == pytest.approx(z[0].params_bytes / 8)
    # Megatron mixed precision: 2 + 4 + 12 bytes per parameter without sharding
    p = z[0].params_bytes / 2
    assert z[0].grads_bytes == pytest.approx(4 * p) and z[0].optimizer_bytes == pytest.approx(12 * p)


def test_first_pipeline_stage_holds_most_microbatches():
    config = TrainingConfig(pp=4, dp=2, microbatch=1, global_batch=32, seq=512)
    est = _est(config)
    assert [s.in_flight for s in est.stages] == [4, 3, 2, 1]
    inter = _est(config.with_(vpp=2, pp=2, dp=4))
    assert inter.stages[0].in_flight > inter.stages[1].in_flight


def test_interleaving_shrinks_the_bubble():
    base = TrainingConfig(pp=2, dp=4, microbatch=1, global_batch=32, seq=512)
    plain, inter = _est(base), _est(base.with_(vpp=2))
    assert inter.breakdown_s["pipeline_bubble"] < plain.breakdown_s["pipeline_bubble"]


def test_fusion_reduces_kernels_and_time_on_a_captured_graph():
    from coplan.capture.api import capture_spec

    graph = capture_spec(PRESETS["gpt-tiny"], 2, 32)
    cm = CostModel(graph=graph)
    cluster = load_cluster("h100-sxm")
    eager = cm.estimate(cluster, TrainingConfig(microbatch=2, global_batch=2, seq=32, fusion="none"))
    fused = cm.estimate(cluster, TrainingConfig(microbatch=2, global_batch=2, seq=32, fusion="megatron"))
    assert fused.kernels_per_step < eager.kernels_per_step
    assert fused.step_time_s < eager.step_time_s
    with pytest.raises(ConfigError):
        cm.estimate(cluster, TrainingConfig(microbatch=4, global_batch=4, seq=32))


def test_recompute_any_tensor_set():
    cm = CostModel(spec=GPT)
    cluster = load_cluster("h100-sxm")
    config = TrainingConfig(microbatch=2, global_batch=2, seq=512)
    prof = cm.profile(2, 512)
    part = prof.templates[0]
    gelu_out = next(name for _, name, _ in part.saved_items if "gelu" in name or "mlp" in name)
    base = cm.estimate(cluster, config)
    some = cm.estimate(cluster, config.with_(recompute=frozenset({gelu_out})))
    assert some.memory.activations_bytes < base.memory.activations_bytes
    assert some.breakdown_s["recompute"] > 0
    with pytest.raises(ConfigError, match="not saved"):
        cm.estimate(cluster, config.with_(recompute=frozenset({"no-such-tensor"})))


def test_tensor_parallel_adds_collectives_and_splits_memory():
    base = TrainingConfig(microbatch=2, global_batch=16, seq=512, dp=8)
    dp8, tp8 = _est(base), _est(base.with_(tp=8, dp=1, global_batch=2))
    assert tp8.breakdown_s["tp_comm"] > 0 and dp8.breakdown_s["tp_comm"] == 0
    assert tp8.memory.params_bytes < dp8.memory.params_bytes / 4


def test_model_flops_match_the_6nd_rule_for_a_large_model():
    spec = PRESETS["gpt3-175b"]
    config = TrainingConfig(tp=8, pp=8, dp=16, microbatch=1, global_batch=1024, seq=2048)
    est = _est(config, spec, "dgx-a100-80gb")
    flops = est.model_tflops_per_gpu * 1e12 * est.step_time_s * config.gpus
    n, tokens = spec.param_count(), 1024 * 2048
    s, L, h = 2048, spec.n_layers, spec.d_model
    # 6ND plus attention (12 L h s per token, forward and backward)
    assert flops == pytest.approx(6 * n * tokens + 12 * L * h * s * tokens, rel=0.02)


@settings(max_examples=25, deadline=None)
@given(
    tp=st.sampled_from([1, 2, 4]),
    pp=st.sampled_from([1, 2]),
    mb=st.sampled_from([1, 2]),
    m=st.integers(1, 4),
    rec=st.sampled_from(["none", "selective", "full"]),
    zero=st.integers(0, 3),
    sp=st.booleans(),
)
def test_estimates_are_finite_and_consistent(tp, pp, mb, m, rec, zero, sp):
    dp = 8 // (tp * pp)
    config = TrainingConfig(
        tp=tp,
        pp=pp,
        dp=dp,
        microbatch=mb,
        global_batch=mb * dp * m * pp,
        seq=256,
        recompute=rec,
        zero=zero,
        sequence_parallel=sp and tp > 1,
    )
    est = _est(config)
    assert math.isfinite(est.step_time_s) and est.step_time_s > 0
    assert all(v >= 0 for v in est.breakdown_s.values())
    assert sum(est.breakdown_s.values()) == pytest.approx(est.step_time_s, rel=1e-9)
    mem = est.memory
    assert mem.peak_bytes >= mem.params_bytes + mem.grads_bytes + mem.optimizer_bytes + mem.activations_bytes


# --- CLI contract ----------------------------------------------------------------------------------


def _run(capsys, *args):
    with pytest.raises(SystemExit) as exc:
        main(["estimate", *args])
    out = capsys.readouterr()
    return exc.value.code, out.out, out.err


def test_estimate_json_contract(capsys):
    code, out, _ = _run(
        capsys,
        "--model",
        "gpt2-124m",
        "--cluster",
        "dgx-h100",
        "--gpus",
        "8",
        "--tp",
        "2",
        "--pp",
        "2",
        "--microbatch",
        "2",
        "--global-batch",
        "16",
        "--recompute",
        "selective",
        "--sequence-parallel",
        "--zero",
        "1",
        "--dtype",
        "bf16",
        "--no-flash-attention",
        "--json",
    )
    assert code == 0
    data = json.loads(out)
    for key in (
        "step_time_s",
        "tokens_per_s",
        "model_tflops_per_gpu",
        "mfu",
        "fits",
        "memory",
        "breakdown_s",
    ):
        assert key in data
    for key in ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "peak_bytes"):
        assert data["memory"][key] > 0
    assert set(BREAKDOWN_KEYS) <= set(data["breakdown_s"])
    assert data["config"]["dp"] == 2


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--gpus", "8", "--tp", "3"], "does not divide"),
        (["--gpus", "8", "--tp", "2", "--pp", "2", "--dp", "4"], "does not equal"),
        (["--gpus", "8", "--tp", "8", "--model", "gpt-tiny"], "attention heads"),
        (["--gpus", "8", "--pp", "8", "--dp", "1", "--model", "gpt2-124m"], "not divisible by pp"),
        (["--gpus", "8", "--global-batch", "12", "--microbatch", "1"], "not divisible by microbatch"),
        (["--gpus", "2", "--pp", "2", "--vpp", "4", "--global-batch", "8"], "not divisible by pp"),
    ],
)
def test_inconsistent_configs_exit_2(capsys, args, needle):
    code, _, err = _run(capsys, *args)
    assert code == 2
    assert needle in err and err.count("\n") == 1 and "Traceback" not in err


def test_a_config_that_does_not_fit_still_prints(capsys):
    code, out, _ = _run(capsys, "--model", "llama2-70b", "--gpus", "8", "--tp", "8", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["fits"] is False and data["memory"]["peak_bytes"] > data["memory"]["capacity_bytes"]


def test_multi_node_ring_runs_both_levels_concurrently() -> None:
    # NCCL's ring crosses NVLink and the NICs in one pipeline: the slower level sets the time
    from coplan.cost.comm import Group

    cluster = load_cluster("dgx-h100", 32)
    g = Group.of(cluster, 16, 2, 1.0)  # 4 members per node on 4 nodes
    assert (g.local, g.nodes) == (4, 4)
    nbytes = 4e9
    nic = cluster.inter_node
    assert nic is not None
    sent = 15 / 16 * nbytes
    expected = sent / 4 / (nic.bandwidth * nic.efficiency)  # the NICs are the slower level here
    lat = math.ceil(math.log2(4)) * (cluster.groups[0].intra_node.latency_s + nic.latency_s)
    assert g.reduce_scatter(nbytes) == pytest.approx(expected + lat)
    assert g.all_reduce(nbytes) == pytest.approx(2 * (expected + lat))


def test_fp8_sequence_parallel_gathers_one_byte_elements() -> None:
    # Transformer Engine gathers fp8-quantised GEMM inputs; reduce-scatters stay 16-bit
    spec = ModelSpec(
        name="t", n_layers=8, d_model=4096, n_heads=32, vocab_size=4096, seq_len=4096, activation="gelu"
    )
    cluster = load_cluster("dgx-h100", 8)
    base = TrainingConfig(tp=8, dp=1, microbatch=1, global_batch=1, seq=4096, sequence_parallel=True)
    bf16 = CostModel(spec=spec).estimate(cluster, base).stages[0].tp_comm_s
    fp8 = CostModel(spec=spec).estimate(cluster, base.with_(dtype="fp8")).stages[0].tp_comm_s
    # all-gathers are half of the block's collectives by bytes: fp8 saves at most a quarter overall
    assert 0.6 * bf16 < fp8 < 0.9 * bf16


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


def test_the_step_counter_math_of_a_captured_optimizer_launches_nothing():
    from coplan.capture.api import capture_spec

    graph = capture_spec(PRESETS["gpt-tiny"], 2, 32)
    prof = CostModel(graph=graph).profile(2, 32, "none")
    parts = (*prof.templates, prof.pre, prof.post)
    kernels = [k for part in parts for k in part.optimizer]
    scalar = [
        k for k in kernels if all(not graph.tensors[t].shape for i in k.ops for t in graph.ops[i].inputs)
    ]
    assert scalar and all(k.kind == "free" for k in scalar)  # bias corrections on 0-d tensors
    assert any(k.kind == "vector" for k in kernels)  # the updates themselves are priced


def test_gemm_dims_of_the_attention_output_projection_gradient():
    # the input gradient of the output projection comes out in the head layout (b, heads, s, hd);
    # the GEMM is still (b * s) x (heads * hd) x d_model, not (b * heads * s) x hd x d_model
    from coplan.capture.synthetic import build_graph
    from coplan.cost.profile import profile_graph

    spec = PRESETS["gpt2-124m"]
    b, s, d = 2, 128, spec.d_model
    prof = profile_graph(build_graph(spec, b, s))
    g = prof.graph
    for k in prof.templates[0].backward:
        if k.kind != "matmul":
            continue
        op = g.ops[next(i for i in k.ops if g.ops[i].kind.value == "matmul")]
        if op.module_path.endswith("attn.c_proj") and op.target == "linear_bwd_input":
            assert k.dims == (b * s, d, d)
            assert k.mm_flops == 2 * b * s * d * d
            break
    else:
        raise AssertionError("no input-gradient GEMM of the attention output projection")
