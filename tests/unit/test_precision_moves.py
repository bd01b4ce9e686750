"""Per-op precision in joint (``search.joint.refine_precision``): one op's dtype changed at a time
from the variant the search started from, accepted only when the true score improves and the plan
stays valid; left alone where the stack's own kernels fix the dtypes."""

from __future__ import annotations

from dataclasses import replace

import pytest

from coplan.cost import CostModel, load_stack
from coplan.hardware import load_cluster
from coplan.models.spec import PRESETS
from coplan.passes.base import score
from coplan.passes.precision import op_moves, precision_variant
from coplan.plan import PlanContext, check
from coplan.plan.checker import SENSITIVE_16BIT_ERROR
from coplan.plan.types import ParallelPlan
from coplan.search.joint import refine_precision
from coplan.search.space import fusion_option


def ctx_for(stack: str, tolerance: float | None = None) -> PlanContext:
    ctx = PlanContext(
        CostModel(spec=PRESETS["gpt-tiny"]), load_cluster("dgx-h100", 1), 8, 64, stack=load_stack(stack)
    )
    if tolerance is not None:
        ctx.numerics = replace(ctx.numerics, tolerance=tolerance)
    return ctx


def start(ctx: PlanContext, variant: str):
    fusion = fusion_option(ctx, "greedy" if "greedy" in ctx.stack.fusion else ctx.stack.fusion[0])
    return ctx.default_plan().with_(
        parallel=ParallelPlan(microbatch=8), precision=precision_variant(ctx, "bf16", variant), fusion=fusion
    )


@pytest.mark.parametrize("tolerance", [None, SENSITIVE_16BIT_ERROR])
def test_moves_change_one_op_and_the_descent_never_loses(tolerance):
    ctx = ctx_for("coplan", tolerance)
    plan = start(ctx, "autocast")
    for move in op_moves(ctx, plan.precision):
        assert len(set(move.ops) ^ set(plan.precision.ops)) in (1, 2)  # one op added, dropped or changed
        assert move.compute == plan.precision.compute
    best = refine_precision(plan, ctx)
    assert check(best, ctx) == []
    assert score(best, ctx) <= score(plan, ctx)
    # no single move improves the result any more (a local optimum of the true score)
    assert all(score(best.with_(precision=m), ctx) >= score(best, ctx) for m in op_moves(ctx, best.precision))
    if tolerance is None:  # 16-bit sensitive ops need a tolerance: none is ever chosen
        assert all(d == "fp32" for _, d in best.precision.ops)


def test_a_stack_with_its_own_kernels_keeps_its_dtypes():
    ctx = ctx_for("megatron")
    plan = start(ctx, "fused")
    assert refine_precision(plan, ctx) is plan
    assert op_moves(ctx, replace(plan.precision, compute="fp32")) == []


def test_megatron_prices_its_own_loss_kernels_under_fp32_loss_overrides():
    """Megatron computes the cross-entropy on fp32 logits: an fp32 override of the loss path (what
    autocast chooses) changes nothing, and a 16-bit one leaves Megatron's loss kernels."""
    from coplan.passes.precision import loss16_ops

    ctx = ctx_for("megatron")
    fused = start(ctx, "fused")
    loss32 = tuple((name, "fp32") for name, _ in loss16_ops(ctx, "bf16"))
    assert loss32
    as_fp32 = fused.with_(precision=replace(fused.precision, ops=loss32))
    assert ctx.price(as_fp32).step_time_s == pytest.approx(ctx.price(fused).step_time_s, rel=1e-12)
    as_bf16 = fused.with_(precision=replace(fused.precision, ops=loss16_ops(ctx, "bf16")))
    assert ctx.price(as_bf16).step_time_s != pytest.approx(ctx.price(fused).step_time_s, rel=1e-6)


def test_block_assignments_enumerate_every_block_dtype_and_keep_the_outside():
    """joint-exact's per-op precision space: each of the block template's autocast-list ops (GPT's
    two LayerNorms) in fp32 or fused, 2^2 assignments, the ops outside the blocks as the variant
    has them; fp32 steps have nothing to choose."""
    from coplan.passes.precision import block_assignments

    ctx = ctx_for("coplan")
    auto = precision_variant(ctx, "bf16", "autocast")
    fused = precision_variant(ctx, "bf16", "fused")
    assert auto is not None and fused is not None
    idx = ctx.index
    in_blocks = {op.name for r in set(idx.ref_of.values()) for op in idx.block_ops[r]}
    block_ops = sorted(n for n, _ in auto.ops if n in in_blocks)
    outside = {(n, d) for n, d in auto.ops if n not in in_blocks}
    assert len(block_ops) == 2 and outside
    got = block_assignments(ctx, auto)
    assert len(got) == 4 and len(set(got)) == 4
    assert {frozenset(n for n, _ in p.ops if n in in_blocks) for p in got} == {
        frozenset(),
        frozenset(block_ops[:1]),
        frozenset(block_ops[1:]),
        frozenset(block_ops),
    }
    assert all(outside <= set(p.ops) for p in got)
    assert auto in got and fused in block_assignments(ctx, fused)
    assert block_assignments(ctx, replace(fused, compute="fp32")) == [replace(fused, compute="fp32")]
    # joint-exact's outer loop takes them; joint's does not (its local search moves single ops)
    from coplan.search.space import SearchSpace

    space = SearchSpace(dtypes=("bf16",), fusion=("greedy",), zero=(0,), stages=False)
    base = ctx.default_plan()
    assert len(space.plans(ctx, base, per_op_dtypes=True)) > len(space.plans(ctx, base))
