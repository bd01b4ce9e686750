"""Transformer Engine's userbuffers overlap, priced per GEMM and collective (coplan/cost/tp_overlap.py)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coplan.cost import ConfigError, CostModel, TrainingConfig
from coplan.cost.parts import Kernel
from coplan.cost.tp_overlap import TE_DEFAULTS, UbSlot, _pair, ub_slots, with_rows
from coplan.errors import SpecError
from coplan.hardware import DeviceSpec, load_cluster
from coplan.ir.types import Phase
from coplan.models.spec import ModelSpec

GEMM = Kernel(
    Phase.FORWARD, "matmul", 1, 2.0 * 4096 * 4096 * 4096, 0.0, (1.0, 0, 0, 0, 0, 0), dims=(4096, 4096, 4096)
)


def _rate(k: Kernel, rows: float) -> float:
    """A device whose GEMMs slow as rows shrink: rows / (rows + 256) of 1e15 FLOP/s."""
    c = with_rows(k, rows)
    return c.mm_flops / (1e15 * c.dims[0] / (c.dims[0] + 256))


T = _rate(GEMM, 4096)


def test_with_rows_keeps_the_flops_per_row():
    half = with_rows(GEMM, 2048)
    assert half.dims == (2048, 4096, 4096)
    assert half.mm_flops == GEMM.mm_flops / 2
    assert half.bytes[0] == 0.5


def test_ring_exchange_pays_for_chunks_that_no_stream_can_fill():
    ring = UbSlot("ring_exchange", num_sm=1)
    # TP2: both chunks run at once on two streams, the GPU sees all rows: nothing lost
    assert _pair(ring, GEMM, T, 0.0, 2, 132, _rate) == pytest.approx(0.0, abs=1e-12)
    # TP8: three chunks of 512 rows at a time, 1,536 rows where the GEMM had 4,096
    want = 8 / 3 * _rate(GEMM, 1536) - T
    assert _pair(ring, GEMM, T, 0.0, 8, 132, _rate) == pytest.approx(want)
    assert want > 0.05 * T
    # a ring too slow for the GEMM: the last chunk waits for the whole ring
    slow = 2 * T
    assert _pair(ring, GEMM, T, slow, 2, 132, _rate) == pytest.approx(slow + _rate(GEMM, 2048) - T)


def test_bulk_and_pipeline_lose_the_collectives_sms():
    bulk = UbSlot("bulk", num_sm=16, set_sm_margin=True)
    assert _pair(bulk, GEMM, T, 0.1 * T, 8, 132, _rate) == pytest.approx(T * 16 / 116)
    # without a margin only while the collective runs
    shared = UbSlot("bulk", num_sm=16)
    assert _pair(shared, GEMM, T, 0.1 * T, 8, 132, _rate) == pytest.approx(0.1 * T * 16 / 116)
    # a pipelined reduce-scatter always shows its last chunk
    pipe = UbSlot("pipeline", num_sm=16, num_splits=4)
    assert _pair(pipe, GEMM, T, 0.4 * T, 8, 132, _rate) > 0.1 * T
    # fewer SMs, less lost
    assert _pair(UbSlot("bulk", num_sm=4), GEMM, T, T, 8, 132, _rate) < _pair(
        shared, GEMM, T, T, 8, 132, _rate
    )


def test_recipe_settings_override_te_defaults_and_bad_ones_are_named():
    got = ub_slots([("fc1_dgrad", "bulk", 2, 0, False)])
    assert got["fc1_dgrad"] == UbSlot("bulk", 2, 0, False)
    assert got["qkv_fprop"] == TE_DEFAULTS["qkv_fprop"]
    with pytest.raises(ConfigError, match=r"tp_overlap_cfg.*unknown overlap slot"):
        TrainingConfig(tp_overlap_cfg=(("qkv", "bulk", 4, 0, False),))
    with pytest.raises(ConfigError, match=r"tp_overlap_cfg.*method"):
        TrainingConfig(tp_overlap_cfg=(("qkv_dgrad", "fast", 4, 0, False),))


SPEC = ModelSpec(name="t", n_layers=4, d_model=8192, n_heads=64, vocab_size=32768, seq_len=4096)


def _tp_comm(**changes: object) -> float:
    base = TrainingConfig(tp=8, dp=1, microbatch=1, global_batch=1, sequence_parallel=True, **changes)  # type: ignore[arg-type]
    return CostModel(spec=SPEC).estimate(load_cluster("dgx-h100", 8), base).breakdown_s["tp_comm"]


def test_overlap_costs_something_but_less_than_exposed_collectives():
    exposed = _tp_comm()
    overlapped = _tp_comm(tp_comm_overlap=True)
    assert 0.0 < overlapped < exposed
    # NeMo's tuned settings take fewer SMs for the bulk collectives than TE's default 16
    tuned = tuple((s, "bulk", 4, 0, False) for s in ("qkv_dgrad", "qkv_wgrad", "fc1_dgrad", "fc1_wgrad"))
    assert _tp_comm(tp_comm_overlap=True, tp_overlap_cfg=tuned) < overlapped


def test_one_cost_model_prices_each_overlap_setting_apart():
    # the per-template memo must not hand one setting's price to another
    cm, cluster = CostModel(spec=SPEC), load_cluster("dgx-h100", 8)
    base = TrainingConfig(tp=8, global_batch=1, sequence_parallel=True, tp_comm_overlap=True)
    fewer_sms = (("qkv_wgrad", "bulk", 2, 0, False), ("fc1_wgrad", "bulk", 2, 0, False))
    tuned = base.with_(tp_overlap_cfg=fewer_sms)
    first = cm.estimate(cluster, base).breakdown_s["tp_comm"]
    assert cm.estimate(cluster, tuned).breakdown_s["tp_comm"] < first
    assert cm.estimate(cluster, base).breakdown_s["tp_comm"] == first


def test_compute_units_round_trip_and_checks():
    h100 = load_cluster("dgx-h100", 8).groups[0].device
    assert h100.compute_units == 132
    assert DeviceSpec.from_dict(h100.to_dict()) == h100
    bad = h100.to_dict() | {"compute_units": -1}
    with pytest.raises(SpecError, match="compute_units"):
        DeviceSpec.from_dict(bad)


# --- `coplan estimate --tp-overlap-cfg` ------------------------------------------------------------

ARGS = ["--model", "llama2-70b", "--cluster", "dgx-h100", "--gpus", "64", "--tp", "4", "--pp", "4"]
ARGS += ["--vpp", "5", "--global-batch", "128", "--sequence-parallel", "--zero", "1", "--json"]


def test_a_recipes_settings_reach_the_estimate(tmp_path, cli):
    cfg = tmp_path / "ub.json"
    # NeMo's style: fewer SMs for the bulk collectives; keys that do not change the price are accepted
    bulk = {"method": "bulk", "num_sm": 2, "cga_size": 2, "set_sm_margin": 0}
    cfg.write_text(json.dumps({s: bulk for s in ("qkv_dgrad", "qkv_wgrad", "fc1_dgrad", "fc1_wgrad")}))
    code, out, _ = cli("estimate", *ARGS, "--tp-overlap-cfg", str(cfg))
    tuned = json.loads(out)
    assert code == 0 and ["qkv_dgrad", "bulk", 2, 0, False] in tuned["config"]["tp_overlap_cfg"]
    code, out, _ = cli("estimate", *ARGS)
    default = json.loads(out)
    assert default["config"]["tp_overlap_cfg"] == []
    assert tuned["breakdown_s"]["tp_comm"] < default["breakdown_s"]["tp_comm"]


def test_a_nemo_yaml_is_read(tmp_path, cli):
    pytest.importorskip("yaml")
    cfg = tmp_path / "ub_cfg_h100.yaml"
    cfg.write_text("proj_fprop:\n  method: pipeline\n  num_sm: 24\n  num_splits: 4\n  set_sm_margin: 1\n")
    code, out, _ = cli("estimate", *ARGS, "--tp-overlap-cfg", str(cfg))
    got = json.loads(out)["config"]["tp_overlap_cfg"]
    assert code == 0 and got == [["proj_fprop", "pipeline", 24, 4, True]]


@pytest.mark.parametrize(
    ("name", "text", "needle"),
    [
        ("a.json", '{"qkv": {"method": "bulk"}}', "unknown overlap slot 'qkv'"),
        ("b.json", '{"qkv_dgrad": {"method": "bulk", "num_sm": "x"}}', "num_sm must be an integer"),
        ("c.json", '{"fc2_fprop": {"method": "pipeline", "num_splits": 0}}', "fc2_fprop: num_splits"),
        ("d.json", '{"fc2_fprop": {"method": "pipeline", "color": 1}}', "fc2_fprop: unknown key 'color'"),
        ("e.json", "{not json", "not valid JSON"),
        ("missing.json", None, "no such file"),
    ],
)
def test_bad_overlap_settings_exit_2_with_one_line(tmp_path, cli, name, text, needle):
    cfg = tmp_path / name
    if text is not None:
        cfg.write_text(text)
    code, out, err = cli("estimate", *ARGS, "--tp-overlap-cfg", str(cfg))
    assert code == 2 and out == ""
    assert needle in err and "--tp-overlap-cfg" in err and len(err.strip().splitlines()) == 1


def test_the_terminal_says_which_settings_priced_the_overlap(tmp_path, cli):
    plain = [a for a in ARGS if a != "--json"]
    _, out, _ = cli("estimate", *plain)
    assert "tp-comm=on (TE's userbuffers defaults)" in out
    cfg = tmp_path / "ub.json"
    cfg.write_text(json.dumps({"fc1_wgrad": {"method": "bulk", "num_sm": 4}}))
    _, out, _ = cli("estimate", *plain, "--tp-overlap-cfg", str(cfg))
    assert "tp-comm=on (1 userbuffers slot tuned, the rest TE's defaults)" in out


@pytest.mark.parametrize(("model", "priced"), [("gpt-tiny", True), ("llama-tiny", True), ("moe-tiny", False)])
def test_only_megatrons_block_shape_is_priced_per_gemm(model, priced):
    # QKV -> attention -> projection -> FC1 (SwiGLU's gate and up as one) -> FC2; an MoE layer's
    # router and experts are no such FC1 and keep the older rule
    from coplan.cost.tp_overlap import block_overlap
    from coplan.models.spec import PRESETS

    spec = PRESETS[model]
    part = CostModel(spec=spec).profile(1, spec.seq_len).templates[0]
    times = [1e-4] * len(part.forward)
    comm = lambda n: 1e-5  # noqa: E731
    ends = (part.tp_entries, part.tp_exits)
    got = block_overlap(part.forward, times, *ends, comm, comm, 2, 132, TE_DEFAULTS, _rate)
    assert (got is not None) is priced


@settings(max_examples=200, deadline=None)
@given(
    method=st.sampled_from(["ring_exchange", "pipeline", "bulk"]),
    sms=st.integers(0, 32),
    splits=st.integers(1, 8),
    margin=st.booleans(),
    tp=st.sampled_from([2, 4, 8]),
    rows=st.sampled_from([512, 2048, 4096, 16384]),
    comm=st.floats(0.0, 5.0),
    more=st.floats(0.0, 5.0),
)
def test_an_overlap_never_saves_time_and_more_traffic_never_costs_less(
    method, sms, splits, margin, tp, rows, comm, more
):
    slot = UbSlot(method, sms, splits, margin)
    gemm = with_rows(GEMM, rows)
    t = _rate(gemm, rows)
    base = _pair(slot, gemm, t, comm * t, tp, 132, _rate)
    assert base >= -1e-12 * t
    assert _pair(slot, gemm, t, (comm + more) * t, tp, 132, _rate) >= base - 1e-12 * t


def test_async_tp_with_nothing_fused_is_the_exposed_collectives():
    # every slot exposed: the block pays each collective whole, as without any overlap: forward
    # two all-gathers and two reduce-scatters, backward the same (no re-gather for the weight gradient)
    from coplan.cost.tp_overlap import EXPOSED, block_overlap
    from coplan.models.spec import PRESETS

    spec = PRESETS["llama-tiny"]
    part = CostModel(spec=spec).profile(1, spec.seq_len).templates[0]
    times = [1e-4] * len(part.forward)
    gather = lambda n: 1e-9 * n  # noqa: E731
    scatter = lambda n: 2e-9 * n  # noqa: E731
    slots = {s: UbSlot(EXPOSED, 0, 0) for s in TE_DEFAULTS}
    fwd, bwd = block_overlap(
        part.forward, times, part.tp_entries, part.tp_exits, gather, scatter, 2, 132, slots, _rate
    )
    want = sum(gather(n) for n in part.tp_entries) + sum(scatter(n) for n in part.tp_exits)
    assert fwd == pytest.approx(want)
    assert bwd == pytest.approx(
        sum(gather(n) for n in part.tp_exits) + sum(scatter(n) for n in part.tp_entries)
    )


def test_collectives_async_tp_leaves_unfused_pay_the_stacks_relayout():
    # DTensor re-lays the sequence out around each plain collective; the fused pairs need none
    from coplan.cost.tp_overlap import async_tp_slots, block_overlap
    from coplan.models.spec import PRESETS

    spec = PRESETS["llama-tiny"]
    part = CostModel(spec=spec).profile(1, spec.seq_len).templates[0]
    times = [1e-4] * len(part.forward)
    comm = lambda n: 1e-9 * n  # noqa: E731
    copy = lambda n, gathered: (3e-10 if gathered else 5e-10) * n  # noqa: E731
    args = (part.forward, times, part.tp_entries, part.tp_exits, comm, comm, 2, 132)
    for gathers_fused in (True, False):
        slots = async_tp_slots(gathers_fused)
        plain = block_overlap(*args, slots, _rate)
        relaid = block_overlap(*args, slots, _rate, copy)
        assert plain is not None and relaid is not None
        # the input gradients' reduce-scatters, and under rowwise fp8 every all-gather too
        (e_attn, e_mlp), (x_attn, x_mlp) = part.tp_entries, part.tp_exits
        want_bwd = copy(e_attn, False) + copy(e_mlp, False)
        want_fwd = 0.0
        if not gathers_fused:
            want_fwd = copy(e_attn, True) + copy(e_mlp, True)
            want_bwd += copy(x_attn, True) + copy(x_mlp, True)
        assert relaid[0] - plain[0] == pytest.approx(want_fwd)
        assert relaid[1] - plain[1] == pytest.approx(want_bwd)


def test_async_tp_fuses_what_the_micro_pipeline_pass_matches():
    from coplan.cost.tp_overlap import EXPOSED, async_tp_slots

    fused = {s for s, v in async_tp_slots(True).items() if v.method != EXPOSED}
    assert fused == {"qkv_fprop", "fc1_fprop", "proj_fprop", "fc2_fprop", "proj_dgrad", "fc2_dgrad"}
    # rowwise fp8 casts between each all-gather and its GEMM: only the forward reduce-scatters fuse
    assert {s for s, v in async_tp_slots(False).items() if v.method != EXPOSED} == {"proj_fprop", "fc2_fprop"}
    # a recipe cannot name the exposed method (it is not Transformer Engine's)
    with pytest.raises(ValueError, match="overlap method"):
        ub_slots((("qkv_wgrad", EXPOSED, 0, 0, False),))


def test_async_tp_hides_less_than_userbuffers_and_more_under_tensorwise_than_rowwise_fp8():
    exposed = _tp_comm()
    te = _tp_comm(tp_comm_overlap=True)
    asynctp = _tp_comm(async_tp=True)
    # at 4,096 tokens a microbatch (512 rows a chunk) async TP's chunked GEMMs and its short
    # reduction give back about all it hides, as NCCL + cuBLAS beat it at such shapes
    # (pytorch/pytorch#143160 at 2,048 rows; meta-pytorch/kraken#19 at 512-2,048)
    assert te < exposed and te < asynctp
    assert asynctp == pytest.approx(exposed, rel=0.05)
    cm, cluster = CostModel(spec=SPEC), load_cluster("dgx-h100", 8)
    twice = TrainingConfig(tp=8, global_batch=2, microbatch=2, sequence_parallel=True)
    comm = {a: cm.estimate(cluster, twice.with_(async_tp=a)).breakdown_s["tp_comm"] for a in (False, True)}
    assert comm[True] < comm[False]  # at 8,192 tokens it hides more than it costs

    def saved(scaling: str, batch: int) -> float:
        c = TrainingConfig(tp=8, global_batch=batch, microbatch=batch, sequence_parallel=True, dtype="fp8")
        c = c.with_(fp8_scaling=scaling)
        plain = cm.estimate(cluster, c).step_time_s
        return plain - cm.estimate(cluster, c.with_(async_tp=True)).step_time_s

    # 8,192 tokens a microbatch, as torchtitan's published async-TP runs: the fused all-gathers
    # (tensorwise fp8 only) hide more than their chunked GEMMs cost
    assert saved("tensorwise", 2) > saved("rowwise", 2) > 0.0
    # at half that, each of the 8 chunk GEMMs (512 rows), one after another, gives back most of
    # what the gathers hide (pytorch/pytorch#143160: slower than NCCL + cuBLAS at 2,048 rows)
    assert saved("tensorwise", 1) < saved("rowwise", 1)
    with pytest.raises(ConfigError, match="async_tp"):
        TrainingConfig(tp=8, async_tp=True)
    with pytest.raises(ConfigError, match="async_tp"):
        TrainingConfig(tp=8, sequence_parallel=True, async_tp=True, tp_comm_overlap=True)


def test_async_tp_reduces_its_partial_sums_at_atens_short_reduction_rate(monkeypatch):
    """The fused reduce-scatters' ``torch.sum`` over the TP partials reads each GEMM output whole
    and writes its shard, at ``ASYNC_TP_REDUCE_PEAK`` of the HBM peak (pytorch/pytorch#191803:
    ATen's reduce_kernel, instruction-bound over 2-8 partials, reached 23-43% of it)."""
    from coplan.cost import partcost, tp_overlap

    assert 0.23 <= tp_overlap.ASYNC_TP_REDUCE_PEAK <= 0.43
    part = CostModel(spec=SPEC).profile(1, SPEC.seq_len).templates[0]
    element = 2.0  # bf16 partials
    moved = tp_overlap.async_tp_reduce_bytes(part.tp_exits, 8, element)
    assert moved == pytest.approx(sum(n * element * (1 + 1 / 8) for n in part.tp_exits))
    hbm = load_cluster("dgx-h100", 8).device.memory_bandwidth
    base = _tp_comm(async_tp=True)
    monkeypatch.setattr(partcost, "ASYNC_TP_REDUCE_PEAK", tp_overlap.ASYNC_TP_REDUCE_PEAK / 2)
    slower = _tp_comm(async_tp=True)
    # halving the rate adds the reduction's time once more, per block: forward only (no recompute)
    assert slower - base == pytest.approx(SPEC.n_layers * moved / (hbm * tp_overlap.ASYNC_TP_REDUCE_PEAK))


def test_async_tp_from_the_command_line(cli):
    args = ("estimate", "--model", "llama-tiny", "--gpus", "2", "--tp", "2", "--sequence-parallel")
    code, out, _ = cli(*args, "--async-tp", "--json")
    assert code == 0 and '"async_tp": true' in out and '"tp_comm_overlap": false' in out
    code, out, _ = cli(*args, "--async-tp")
    assert code == 0 and "tp-comm=async TP" in out
    code, out, err = cli("estimate", "--model", "llama-tiny", "--gpus", "2", "--tp", "2", "--async-tp")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and "sequence" in err
