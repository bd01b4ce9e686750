"""Properties every estimate must have, over random models, devices and layouts: the numbers coplan
prints are never absurd. MFU against the peak of the precision the devices run lies in (0, 1], and
so does MFU against the 16-bit dense peak except under fp8 (whose GEMMs may outrun the 16-bit
peak); the step time is finite and positive, and a configuration said to fit has its peak memory
within the capacity (an estimate) or the budget (a plan).
"""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from coplan.cost import CostModel, TrainingConfig
from coplan.cost.config import DTYPES, LOSS_FUSIONS, RECOMPUTE_MODES
from coplan.cost.parts import CAUSAL_FRACTION
from coplan.errors import CoplanError
from coplan.hardware import device_presets, load_cluster
from coplan.ir.types import OpKind, Phase
from coplan.models.spec import PRESETS, ModelSpec
from coplan.plan import PlanContext
from coplan.search import DEFAULT_STRATEGIES, run_strategy

#: Every device preset (each as the homogeneous cluster ``load_cluster`` sizes it into), and the
#: mixed cluster preset.
HARDWARE = (*sorted(device_presets()), "mixed-h100-a100")
SEQS = (128, 512, 2048, 4096, 8192, 32768, 131072)
#: About half the drawn jobs are combinations the library refuses (heads or layers not divisible,
#: a cluster size its nodes cannot make); each example builds a graph
QUIET = [HealthCheck.filter_too_much, HealthCheck.too_slow]


@st.composite
def specs(draw: st.DrawFn, max_layers: int) -> ModelSpec:
    heads = draw(st.sampled_from([1, 2, 4, 8, 16, 32, 64, 128]))
    head_dim = draw(st.sampled_from([32, 64, 128, 256]))
    kv = draw(st.sampled_from([None, *(k for k in (1, 2, 4, 8) if heads % k == 0)]))
    experts = draw(st.sampled_from([0, 0, 2, 4, 8, 16]))
    seq = draw(st.sampled_from(SEQS))
    d = heads * head_dim
    return ModelSpec(
        name="drawn",
        n_layers=draw(st.integers(1, max_layers)),
        d_model=d,
        n_heads=heads,
        n_kv_heads=kv,
        vocab_size=draw(st.integers(256, 262_144)),
        seq_len=seq,
        ffn_hidden=draw(st.sampled_from([None, d, 2 * d, 64 * max(1, 8 * d // 3 // 64)])),
        activation=draw(st.sampled_from(["gelu", "swiglu", "relu2"])),
        norm=draw(st.sampled_from(["layernorm", "rmsnorm"])),
        position=draw(st.sampled_from(["learned", "rope"])),
        tied_embeddings=draw(st.booleans()),
        bias=draw(st.booleans()),
        n_experts=experts,
        top_k=draw(st.integers(1, min(2, experts))) if experts > 1 else 1,
        capacity_factor=draw(st.sampled_from([1.0, 1.25, 2.0])),
        hidden_dropout=draw(st.sampled_from([0.0, 0.1])),
        attention_dropout=draw(st.sampled_from([0.0, 0.1])),
    )


@st.composite
def jobs(draw: st.DrawFn, max_layers: int) -> tuple[ModelSpec, str, TrainingConfig]:
    """A model, hardware and a layout drawn from the values the library accepts; combinations it
    rejects (its own validation errors) are skipped by the test."""
    spec = draw(specs(max_layers))
    hardware = draw(st.sampled_from(HARDWARE))
    tp = draw(st.sampled_from([1, 2, 4, 8]))
    pp = draw(st.sampled_from([1, 2, 4]))
    # the mixed preset has 16 devices and cannot be resized
    mixed = hardware.startswith("mixed") and tp * pp <= 16
    dp = 16 // (tp * pp) if mixed else draw(st.sampled_from([1, 2, 4]))
    dtype = draw(st.sampled_from(DTYPES))
    sp = tp > 1 and draw(st.booleans())
    microbatch = draw(st.sampled_from([1, 2, 4]))
    config = TrainingConfig(
        tp=tp,
        pp=pp,
        dp=dp,
        vpp=draw(st.sampled_from([1, 2])) if pp > 1 else 1,
        microbatch=microbatch,
        global_batch=microbatch * dp * draw(st.integers(1, 8)),
        seq=spec.seq_len,
        sequence_parallel=sp,
        recompute=draw(st.sampled_from(RECOMPUTE_MODES)),
        zero=draw(st.integers(0, 3)),
        dtype=dtype,
        flash_attention=draw(st.booleans()),
        fusion=draw(st.sampled_from(["megatron", "megatron", "none"])),
        tp_comm_overlap=sp and draw(st.booleans()),
        overlap_grad_reduce=draw(st.booleans()),
        overlap_param_gather=draw(st.booleans()),
        fp8_params=dtype == "fp8" and draw(st.booleans()),
        loss_fusion=draw(st.sampled_from(LOSS_FUSIONS)),
        grad_reduce_fp32=draw(st.booleans()),
    )
    return spec, hardware, config


def _estimate(spec: ModelSpec, hardware: str, config: TrainingConfig):
    try:
        cluster = load_cluster(hardware, config.gpus)
        return CostModel(spec=spec).estimate(cluster, config)
    except CoplanError:
        assume(False)  # a combination the library refuses, as it would refuse the user
        raise


def _check_sane(spec: ModelSpec, hardware: str, config: TrainingConfig) -> None:
    est = _estimate(spec, hardware, config)
    assert math.isfinite(est.step_time_s) and est.step_time_s > 0
    assert 0 < est.mfu_dtype_peak <= 1
    # against the 16-bit peak MFU is at most 1 unless the devices run the dtype faster than 16 bits
    # (fp8 GEMMs above half their peak outrun the bf16 peak, as NVIDIA's fp8 runs nearly do)
    assert 0 < est.mfu <= max(1.0, est.peak_flops / est.peak_flops_16bit)
    if config.dtype != "fp8":
        assert est.mfu <= 1
    # the two MFUs are one throughput against two peaks
    assert est.mfu == pytest.approx(est.mfu_dtype_peak * est.peak_flops / est.peak_flops_16bit)
    for st_ in est.stages:
        mem = st_.memory
        assert min(mem.params_bytes, mem.grads_bytes, mem.optimizer_bytes, mem.activations_bytes) >= 0
        assert mem.transient_bytes >= 0
        if est.fits:
            assert mem.peak_bytes <= mem.capacity_bytes
    if est.fits:
        assert est.memory.peak_bytes <= est.memory.capacity_bytes


@settings(max_examples=80, deadline=None, suppress_health_check=QUIET)
@given(job=jobs(max_layers=4))
def test_estimates_are_never_absurd(job):
    _check_sane(*job)


@pytest.mark.slow
@settings(max_examples=600, deadline=None, suppress_health_check=QUIET)
@given(job=jobs(max_layers=24))
def test_estimates_are_never_absurd_at_length(job):
    _check_sane(*job)


# --- the convention MFU rests on -------------------------------------------------------------------


def test_model_flops_count_the_causal_half_of_attention():
    """Model FLOPs are the graph's matrix FLOPs (what ``FlopCounterMode`` counts: full attention)
    with attention taken at the causal share its kernels are priced at."""
    spec = ModelSpec(name="t", n_layers=2, d_model=256, n_heads=4, vocab_size=1024, seq_len=4096)
    prof = CostModel(spec=spec).profile(1, 4096)
    ops = [op for op in prof.graph.ops if op.phase is not Phase.OPTIMIZER]
    attention = sum(op.flops for op in ops if op.kind is OpKind.ATTENTION)
    assert attention > 0
    assert prof.model_flops == pytest.approx(sum(op.flops for op in ops) - (1 - CAUSAL_FRACTION) * attention)


def test_a_long_sequence_mfu_stays_below_one():
    """At 131,072 tokens attention is nearly all of the work: counted in full against the causal
    half the kernels are priced for, MFU would double past the devices' peaks."""
    spec = ModelSpec(
        name="long",
        n_layers=2,
        d_model=1024,
        n_heads=16,
        n_kv_heads=4,
        vocab_size=32000,
        seq_len=131072,
        activation="swiglu",
        norm="rmsnorm",
        position="rope",
        tied_embeddings=False,
        bias=False,
    )
    for hardware in ("a100-sxm-80gb", "tpu-v5e", "l4", "mi300x", "h100-sxm"):
        est = CostModel(spec=spec).estimate(load_cluster(hardware, 1), TrainingConfig(recompute="full"))
        assert 0 < est.mfu <= 1, hardware


def test_mfu_is_against_the_16bit_peak_with_the_dtypes_beside_it():
    spec = ModelSpec(name="t", n_layers=2, d_model=1024, n_heads=8, vocab_size=8192, seq_len=2048)
    cluster = load_cluster("h100-sxm", 1)
    dev = cluster.device
    fp8 = CostModel(spec=spec).estimate(cluster, TrainingConfig(dtype="fp8", microbatch=2, global_batch=2))
    assert (fp8.peak_flops_16bit, fp8.peak_dtype_16bit) == (dev.peak("bf16"), "bf16")
    assert (fp8.peak_flops, fp8.peak_dtype) == (dev.peak("fp8"), "fp8")
    per_gpu = fp8.model_tflops_per_gpu * 1e12
    assert fp8.mfu == pytest.approx(per_gpu / dev.peak("bf16"))
    assert fp8.mfu_dtype_peak == pytest.approx(per_gpu / dev.peak("fp8"))
    assert fp8.mfu > fp8.mfu_dtype_peak
    out = fp8.to_dict()
    assert out["mfu"] == fp8.mfu and out["mfu_dtype_peak"] == fp8.mfu_dtype_peak
    assert out["peak_flops_16bit_per_gpu"] == dev.peak("bf16") and out["peak_dtype"] == "fp8"
    # fp32 runs at fp32's peak, far below the 16-bit one MFU is reported against
    fp32 = CostModel(spec=spec).estimate(cluster, TrainingConfig(dtype="fp32", microbatch=2, global_batch=2))
    assert fp32.peak_dtype == "fp32" and fp32.mfu < fp32.mfu_dtype_peak


# --- plans -----------------------------------------------------------------------------------------


@settings(max_examples=8, deadline=None)
@given(
    strategy=st.sampled_from(DEFAULT_STRATEGIES),
    model=st.sampled_from(["gpt-tiny", "llama-tiny", "moe-tiny"]),
    hardware=st.sampled_from(["a100-sxm-80gb", "h100-sxm", "l4", "tpu-v5e"]),
    gpus=st.sampled_from([1, 2]),
    budget_mib=st.sampled_from([None, 24, 64]),
)
def test_plans_report_fits_and_mfu_from_one_sane_estimate(strategy, model, hardware, gpus, budget_mib):
    spec = PRESETS[model]
    ctx = PlanContext(
        model=CostModel(spec=spec),
        cluster=load_cluster(hardware, gpus),
        global_batch=4,
        seq=spec.seq_len,
        budget_bytes=None if budget_mib is None else budget_mib * 2**20,
    )
    res = run_strategy(strategy, ctx)
    est = res.estimate
    assert est is ctx.price(res.plan)
    assert 0 < est.mfu <= 1 and 0 < est.mfu_dtype_peak <= 1
    assert math.isfinite(est.step_time_s) and est.step_time_s > 0
    if res.fits:
        assert all(s.memory.peak_bytes <= ctx.budget for s in est.stages)
    out = res.to_dict()
    assert out["mfu"] == est.mfu and out["fits"] == res.fits
