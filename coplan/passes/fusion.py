"""The fusion pass: Inductor/XLA-style greedy fusion, with the other decisions fixed.

Greedy in execution order: each pointwise or reduction op joins the kernel of a producer when the
merged kernel is legal (``plan.checker.group_problem``: one phase and block, no cycle). As in
Inductor's default mode, GEMMs and attention stay vendor-library kernels (no epilogue fusion into
them); optimizer updates of a block become one multi-tensor (foreach) kernel. The pass decides
by legality alone, not by the cost model: that is what a production compiler does.
"""

from __future__ import annotations

from collections.abc import Iterable

from coplan.cost.fusion import default_groups, readers, source_op
from coplan.ir.types import Graph, Op, Phase
from coplan.passes.base import register
from coplan.plan.checker import (
    ANCHORS,
    POINTWISE,
    REDUCTIONS,
    _kernel_graph_ok,
    duplicable,
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


def xla_fusion(ctx: PlanContext, dropped: frozenset[str] = frozenset()) -> FusionPlan:
    """XLA-style fusion: the greedy kernels, then every cheap pointwise producer not kept for
    backward (kept tensors in ``dropped`` are recomputed, so not kept) whose readers sit in two or
    more kernels is duplicated into each of them where that moves fewer bytes (its inputs read once
    per reader instead of its output written once and read once per reader: the comparison XLA's
    GPU performance model makes for a producer fused into all its consumers,
    ``xla/service/gpu/model/gpu_performance_model.cc``) and every reader's kernel stays legal.
    The compiler fuses the graph it is given, recomputation included, so the kernels follow the
    recompute set (``passes.remat.with_remat``)."""
    key = ("xla", dropped & _kept_by_duplicable(ctx))
    got = ctx.memo.get(key)
    if got is None:
        got = ctx.memo[key] = _xla_fusion(ctx, key[1])
    return got  # type: ignore[return-value]


def _kept_by_duplicable(ctx: PlanContext) -> frozenset[str]:
    """Names of the saved tensors duplicable ops make: the only drops that change XLA's kernels."""
    got = ctx.memo.get("xla-kept")
    if got is None:
        g = ctx.index.graph
        got = ctx.memo["xla-kept"] = frozenset(
            g.tensors[t].name
            for op in scope_ops(ctx)
            if duplicable(g, op)
            for t in op.outputs
            if g.tensors[t].saved_for_backward
        )
    return got  # type: ignore[return-value]


def _xla_fusion(ctx: PlanContext, dropped: frozenset[str]) -> FusionPlan:
    graph = ctx.index.graph
    scope = scope_ops(ctx)
    groups = [list(g) for g in greedy_groups(graph, scope, inductor=ctx.inductor)]
    where = {i: n for n, g in enumerate(groups) for i in g}
    dup: set[int] = set()
    for op in scope:
        if not duplicable(graph, op) or op.id in dup:
            continue
        outs = [graph.tensors[t] for t in op.outputs]
        if any(t.saved_for_backward and t.name not in dropped for t in outs):
            continue  # kept for backward: written anyway
        # readers in backward take the recomputed value (the tensor is dropped, or it was kept)
        rs = sorted({r for t in op.outputs for r in readers(graph, t) if graph.ops[r].phase is op.phase})
        if len(rs) < 2 or any(graph.ops[r].block != op.block or r in dup for r in rs):
            continue
        kernels = {where.get(r, -1 - r) for r in rs}
        if len(kernels) < 2:
            continue
        ins = sum(graph.tensors[t].nbytes for t in set(op.inputs))
        out = sum(t.nbytes for t in outs)
        if ins * len(kernels) > out * (1 + len(kernels)):
            continue
        homes = [groups[k] if k >= 0 else [-1 - k] for k in kernels]
        trial = [(*(i for i in h if i != op.id), op.id) for h in homes]
        if any(graph.ops[r].kind in ANCHORS for r in rs) or any(
            group_problem(graph, t) is not None for t in trial
        ):
            continue
        dup.add(op.id)
        if op.id in where:  # it leaves the kernel it was greedily fused into
            groups[where.pop(op.id)].remove(op.id)
    named = tuple(tuple(graph.ops[i].name for i in g) for g in groups if len(g) > 1)
    return FusionPlan(groups=named, duplicated=frozenset(graph.ops[i].name for i in dup), label="duplicate")


@register("fusion")
def fusion_pass(graph: Graph, plan: Plan, ctx: PlanContext) -> Plan:
    allowed = ctx.stack.fusion
    if "duplicate" in allowed and "greedy" not in allowed:  # an XLA-style compiler
        return plan.with_(fusion=xla_fusion(ctx))
    if "greedy" not in allowed:  # the stack runs other kernels: its own fusion, nothing to decide
        if "megatron" in allowed:
            return plan.with_(fusion=megatron_fusion(ctx))
        return plan.with_(fusion=FusionPlan(label="compiled" if "compiled" in allowed else "eager"))
    groups = greedy_groups(graph, scope_ops(ctx), inductor=ctx.inductor)
    return plan.with_(fusion=_as_plan(graph, groups, "greedy", plan.fusion))
