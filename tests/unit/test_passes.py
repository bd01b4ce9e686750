"""The four decision passes with their runner.

Ops are found by the tensors they produce (``h.0.mlp.gelu``), not by their numbered names.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from plan_contexts import TINY, make_ctx, producer

from coplan.hardware import load_cluster
from coplan.hardware.cluster import ClusterSpec
from coplan.ir.types import OpKind, Phase
from coplan.models.spec import PRESETS
from coplan.passes import DEFAULT_ORDER, PASSES, run_passes
from coplan.passes.fusion import fusion_pass
from coplan.passes.parallel import candidates, parallel_pass
from coplan.passes.precision import precision_pass
from coplan.passes.remat import remat_pass, saved_names, with_remat
from coplan.plan import (
    FusionPlan,
    Plan,
    PlanContext,
    check,
    is_valid,
)
from coplan.plan.checker import ANCHORS


def test_runner_records_every_pass(gpt):
    start = gpt.default_plan()
    plan, records = run_passes(start, gpt)
    assert [r.name for r in records] == list(DEFAULT_ORDER)
    assert records[0].before == start.fingerprint
    assert records[-1].after == plan.fingerprint
    for a, b in itertools.pairwise(records):
        assert a.after == b.before
        assert a.step_after_s == b.step_before_s
        assert a.peak_after_bytes == b.peak_before_bytes
    for r in records:
        assert r.seconds >= 0
        assert r.changed == (r.before != r.after)
        assert r.to_dict()["name"] == r.name
    # on this job every pass changes something: greedy fusion, the layout, bf16 (remat: no)
    assert {r.name for r in records if r.changed} == {"fusion", "parallel", "precision"}
    final = gpt.price(plan)
    assert records[-1].step_after_s == final.step_time_s
    assert final.step_time_s < records[0].step_before_s


def test_runner_disables_by_name(gpt):
    plan, records = run_passes(gpt.default_plan(), gpt, disable=("precision", "remat"))
    assert [r.name for r in records] == ["fusion", "parallel"]
    assert plan.precision.compute == "fp32"
    plan, records = run_passes(gpt.default_plan(), gpt, order=("precision",))
    assert [r.name for r in records] == ["precision"]
    assert plan.precision.compute == "bf16"


@pytest.mark.parametrize(("order", "disable"), [(("fusion", "nope"), ()), (DEFAULT_ORDER, ("nope",))])
def test_runner_refuses_unknown_pass(gpt, order, disable):
    with pytest.raises(ValueError, match="unknown pass 'nope'"):
        run_passes(gpt.default_plan(), gpt, order, disable)
    assert set(DEFAULT_ORDER) == set(PASSES)


def _tight(model: str = "gpt-tiny", gpus: int = 1) -> tuple[PlanContext, Plan, float, float]:
    """A context, a bf16 greedy-fused plan, and its peak with every saved tensor recomputed and
    with none (the budget is the caller's)."""
    ctx = make_ctx(model, gpus=gpus)
    plan = precision_pass(ctx.index.graph, fusion_pass(ctx.index.graph, ctx.default_plan(), ctx), ctx)
    full = ctx.price(with_remat(plan, frozenset(saved_names(ctx)))).memory.peak_bytes
    none = ctx.price(with_remat(plan, frozenset())).memory.peak_bytes
    assert full < none
    return ctx, plan, full, none


@pytest.mark.parametrize("model", TINY)
@pytest.mark.parametrize("where", [0.0, 0.5, 0.9])
def test_remat_pass_fits_a_budget_that_needs_recomputation(model, where):
    ctx, plan, full, none = _tight(model)
    ctx.budget_bytes = full + where * (none - full)
    out = remat_pass(ctx.index.graph, plan, ctx)
    assert out.remat.recompute, "the budget is below the peak with nothing recomputed"
    assert check(out, ctx) == []
    # only the remat decision changed (with the pointwise recomputation a compiled fusion plan
    # takes into its backward kernels)
    assert out.with_(remat=plan.remat, fusion=plan.fusion) == plan
    assert out.fusion.groups == plan.fusion.groups


def test_remat_pass_recomputes_nothing_while_the_plan_fits():
    ctx, plan, _, none = _tight()
    ctx.budget_bytes = none
    start = with_remat(plan, frozenset(saved_names(ctx)))
    assert remat_pass(ctx.index.graph, start, ctx).remat.recompute == frozenset()


@pytest.mark.parametrize("model", TINY)
def test_fusion_pass_output_passes_the_checker(model):
    ctx = make_ctx(model)
    plan = fusion_pass(ctx.index.graph, ctx.default_plan(), ctx)
    assert plan.fusion.groups
    assert plan.fusion.label == "greedy"
    assert check(plan, ctx) == []
    # Inductor's default: GEMMs and attention stay library kernels
    kinds = {ctx.index.op_by_name[n].kind for g in plan.fusion.groups for n in g}
    assert not kinds & ANCHORS
    assert plan.with_(fusion=FusionPlan()) == ctx.default_plan()
    # fewer kernels than eager
    assert ctx.price(plan).kernels_per_step < ctx.price(ctx.default_plan()).kernels_per_step


@pytest.mark.parametrize(
    ("model", "gpus", "global_batch"), [("gpt-tiny", 8, 16), ("llama-tiny", 4, 8), ("moe-tiny", 2, 6)]
)
def test_parallel_candidates_use_every_gpu(model, gpus, global_batch):
    ctx = make_ctx(model, gpus=gpus, global_batch=global_batch)
    spec = PRESETS[model]
    layouts = list(candidates(ctx))
    assert layouts
    assert len(set(layouts)) == len(layouts)
    for p in layouts:
        assert p.tp * p.pp * p.dp == gpus
        assert spec.n_heads % p.tp == 0
        assert spec.n_layers % (p.pp * p.vpp) == 0
        assert global_batch % (p.microbatch * p.dp) == 0
        assert is_valid(ctx.default_plan().with_(parallel=p), ctx), p
    assert {p.tp for p in layouts} > {1}
    out = parallel_pass(ctx.index.graph, ctx.default_plan(), ctx)
    assert out.parallel in layouts
    assert check(out, ctx) == []
    assert ctx.price(out).step_time_s <= min(
        ctx.price(ctx.default_plan().with_(parallel=p)).step_time_s for p in layouts[:5]
    )


def test_precision_pass_follows_amp():
    h100 = make_ctx()
    out = precision_pass(h100.index.graph, h100.default_plan(), h100)
    assert out.precision.compute == "bf16"  # never fp8: that takes a TE recipe
    # autocast's fp32 list: every norm, the log-softmax and the loss keep fp32, nothing else
    kinds = {h100.index.op_by_name[n].kind for n, _ in out.precision.ops}
    assert {d for _, d in out.precision.ops} == {"fp32"}
    assert OpKind.NORM in kinds and OpKind.LOSS in kinds
    assert kinds <= {OpKind.NORM, OpKind.LOSS, OpKind.SOFTMAX, OpKind.ELEMENTWISE}
    ops = h100.index.op_by_name.values()
    norms = [op for op in ops if op.kind is OpKind.NORM and op.phase is Phase.FORWARD]
    assert {op.name for op in norms} <= {n for n, _ in out.precision.ops}
    assert check(out, h100) == []
    device = load_cluster("dgx-a100-80gb", 1).devices[0]
    no_bf16 = dataclasses.replace(
        device, name="no-bf16", peak_flops={k: v for k, v in device.peak_flops.items() if k != "bf16"}
    )
    ctx = make_ctx(cluster=ClusterSpec.single_node(no_bf16, 1), gpus=1)
    out = precision_pass(ctx.index.graph, ctx.default_plan(), ctx)
    assert (out.precision.compute, out.precision.loss_scaling) == ("fp16", True)
    assert check(out, ctx) == []


def test_norms_and_gemms_are_what_the_rules_say(gpt):
    # the fixtures above rely on these kinds; fail here, not with a confusing message there
    assert gpt.index.op_by_name[producer(gpt, "h.0.ln_2.out")].kind is OpKind.NORM
    assert gpt.index.op_by_name[producer(gpt, "h.0.mlp.c_fc.out")].kind is OpKind.MATMUL
    assert gpt.index.op_by_name[producer(gpt, "h.0.mlp.gelu")].kind is OpKind.ELEMENTWISE


def test_memory_violation_reads_in_units_that_fit_the_model():
    ctx = make_ctx(gpus=1)
    est = ctx.price(ctx.default_plan())
    ctx.budget_bytes = est.memory.peak_bytes / 2
    (v,) = [v for v in check(ctx.default_plan(), ctx) if v.rule == "memory"]
    assert "0.0 GiB" not in v.message and "MiB" in v.message, v.message
