"""``plan --json``'s ``decisions``: a plan's per-op choices counted for one block, exactly."""

from __future__ import annotations

from plan_contexts import make_ctx

from coplan.ir.types import OpKind, Phase
from coplan.plan.decisions import block_decisions
from coplan.plan.types import FusionPlan, PrecisionPlan, RematPlan


def _block_ops(ctx, block: int):
    return [op for op in ctx.index.graph.ops if op.block == block]


def test_counts_of_a_hand_made_plan_on_block_one():
    ctx = make_ctx()
    graph = ctx.index.graph
    ops = _block_ops(ctx, 1)
    fwd = [op for op in ops if op.phase is Phase.FORWARD and op.kind is not OpKind.VIEW]
    # one chain of three consecutive forward ops that feed each other: two fused edges
    chain = None
    for a, b, c in zip(fwd, fwd[1:], fwd[2:], strict=False):
        feeds = lambda p, q: any(graph.tensors[t].producer == p.id for t in q.inputs)  # noqa: E731
        if feeds(a, b) and feeds(b, c):
            chain = (a, b, c)
            break
    assert chain is not None
    saved = next(
        graph.tensors[t].name for op in fwd for t in op.outputs if graph.tensors[t].saved_for_backward
    )
    plan = ctx.default_plan().with_(
        fusion=FusionPlan(groups=(tuple(op.name for op in chain),), label="joint"),
        remat=RematPlan(recompute=frozenset({saved})),
        precision=PrecisionPlan(compute="bf16", ops=((fwd[0].name, "fp32"),)),
    )
    got = block_decisions(plan, graph)
    launching = sum(1 for op in ops if op.kind is not OpKind.VIEW)
    assert got["block"] == 1
    assert got["kernels"] == launching - 2  # three ops in one kernel
    assert got["fused_edges"] == 2
    assert got["recomputed"] == 1
    assert got["dtype_overrides"] == 1
    assert got["outside"]["fused_edges"] == 0 and got["outside"]["recomputed"] == 0


def test_an_unfused_plan_runs_one_kernel_per_op():
    ctx = make_ctx()
    plan = ctx.default_plan().with_(fusion=FusionPlan())
    got = block_decisions(plan, ctx.index.graph)
    assert got["block"] == 0
    assert got["kernels"] == sum(1 for op in _block_ops(ctx, 0) if op.kind is not OpKind.VIEW)
    assert got["fused_edges"] == 0
