"""The fusion pass: Inductor/XLA-style greedy fusion, with the other decisions fixed.

Greedy in execution order: each pointwise or reduction op joins the kernel of a producer when the
merged kernel is legal (``plan.checker.group_problem``: one phase and block, no cycle). As in
Inductor's default mode, GEMMs and attention stay vendor-library kernels (no epilogue fusion into
them); optimizer updates of a block become one multi-tensor (foreach) kernel. The pass decides
by legality alone, not by the cost model: that is what a production compiler does.
"""

from __future__ import annotations

from collections.abc import Iterable

from coplan.cost.fusion import default_groups, source_op
from coplan.ir.types import Graph, Op, Phase
from coplan.passes.base import register
from coplan.plan.checker import (
    ANCHORS,
    POINTWISE,
    REDUCTIONS,
    _kernel_graph_ok,
    group_problem,
    inductor_problem,
)
from coplan.plan.context import PlanContext
from coplan.plan.types import FusionPlan, Plan


def scope_ops(ctx: PlanContext) -> list[Op]:
    """The ops fusion decides over: every reference block and the ops outside blocks."""
    idx = ctx.index
    refs = sorted(set(idx.ref_of.values()))
    out = [op for r in refs for op in idx.block_ops[r]]
    out.extend(idx.outside)
    return sorted(out, key=lambda op: op.id)


def _as_plan(
    graph: Graph, groups: Iterable[Iterable[int]], label: str, keep: FusionPlan | None = None
) -> FusionPlan:
    named = tuple(tuple(graph.ops[i].name for i in g) for g in groups if len(tuple(g)) > 1)
    rib = keep.recompute_in_backward if keep is not None else frozenset()
    return FusionPlan(groups=named, recompute_in_backward=rib, label=label)


def greedy_groups(
    graph: Graph, ops: list[Op], *, into_anchors: bool = False, inductor: str | None = None
) -> list[list[int]]:
    """Inductor-style greedy fusion: producer into consumer wherever the merged kernel is legal
    (and, with ``inductor`` a target, emitted by Inductor there: ``checker.inductor_problem``)."""
    parent = {op.id: op.id for op in ops}
    members = {op.id: [op.id] for op in ops}

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    fusible = POINTWISE | REDUCTIONS | (ANCHORS if into_anchors else frozenset())
    opt_root: dict[int | None, int] = {}
    for op in ops:
        if op.phase is Phase.OPTIMIZER:
            root = opt_root.setdefault(op.block, op.id)
            a, b = find(op.id), find(root)
            if a != b:
                parent[a] = b
                members[b].extend(members.pop(a))
            continue
        if op.kind not in fusible:
            continue
        for t in op.inputs:
            src = source_op(graph, t)
            if src is None or src not in parent:
                continue
            if graph.ops[src].kind not in fusible:
                continue
            a, b = find(op.id), find(src)
            if a == b:
                continue
            merged = tuple(members[a] + members[b])
            if group_problem(graph, merged) is not None:
                continue
            if inductor is not None and inductor_problem(graph, merged, inductor) is not None:
                continue
            others = [tuple(m) for r, m in members.items() if r not in (a, b)]
            if _kernel_graph_ok(graph, [*others, merged]) is not None:
                continue
            parent[a] = b
            members[b].extend(members.pop(a))
    return [m for m in members.values() if len(m) > 1]


def megatron_fusion(ctx: PlanContext) -> FusionPlan:
    """The kernels Megatron-LM launches (``cost.fusion.default_groups``), as a plan. Under a stack
    that runs only that kernel set, the plan names the set instead of grouping ops itself, so it is
    priced as the published runs were (``fusion="megatron"``); where other groupings are searched
    too, its groups are a starting point the search can change."""
    if ctx.stack.megatron_kernels_only:
        return FusionPlan(label="megatron")
    graph = ctx.index.graph
    scope = {op.id for op in scope_ops(ctx)}
    groups = [g for g in default_groups(graph, "megatron") if len(g) > 1 and set(g) <= scope]
    return _as_plan(graph, groups, "megatron")


@register("fusion")
def fusion_pass(graph: Graph, plan: Plan, ctx: PlanContext) -> Plan:
    allowed = ctx.stack.fusion
    if "greedy" not in allowed:  # the stack runs other kernels: its own fusion, nothing to decide
        if "megatron" in allowed:
            return plan.with_(fusion=megatron_fusion(ctx))
        return plan.with_(fusion=FusionPlan(label="compiled" if "compiled" in allowed else "eager"))
    groups = greedy_groups(graph, scope_ops(ctx), inductor=ctx.inductor)
    return plan.with_(fusion=_as_plan(graph, groups, "greedy", plan.fusion))
