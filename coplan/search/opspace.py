"""The per-op fusion space: which ops of a block template (and of the ops outside blocks) may
share a kernel, as every legal kernel a partition may use.

A fusion plan is a partition of the ops into kernels. Its legal kernels are the connected groups
``plan.checker.group_problem`` accepts (one phase and block; at most one GEMM or attention, with
pointwise prologues and epilogues only where the stack's executor emits them; pointwise and
reductions chained or reading one input); a partition is legal when, in addition, no two kernels
need each other's outputs (the kernel graph is acyclic, ``plan.checker._kernel_graph_ok``). The
exact strategy (``exact.py``) chooses among these kernels with CP-SAT, the exhaustive oracle
enumerates every partition of them; both read the same ``Region``s, so they search one space.

Views launch nothing (the cost model prices them free wherever they sit) and are left out of the
decisions; optimizer updates keep one multi-tensor kernel per block, as every stack runs them.
Kernels are capped at ``MAX_KERNEL_OPS`` ops (the greedy pass's groups are always candidates,
whatever their size), and a region's candidates at ``MAX_CANDIDATES``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from coplan.cost.fusion import source_op
from coplan.ir.types import Graph, Op, OpKind, Phase
from coplan.passes.fusion import greedy_groups, scope_ops
from coplan.plan.checker import (
    ANCHORS,
    POINTWISE,
    REDUCTIONS,
    _kernel_graph_ok,
    group_problem,
    inductor_problem,
)
from coplan.plan.context import PlanContext
from coplan.plan.types import FusionPlan

MAX_KERNEL_OPS = 8
MAX_CANDIDATES = 20_000


@dataclass(frozen=True, slots=True)
class Region:
    """The ops one set of fusion decisions covers: a template's reference block (applied to each
    of its ``blocks``) or the ops outside blocks (``blocks`` 1)."""

    name: str
    blocks: int
    ops: tuple[int, ...]  # op ids decided over (no views, no optimizer updates), graph order
    candidates: tuple[tuple[int, ...], ...]  # legal kernels of two or more of ``ops``
    edges: tuple[tuple[int, int], ...]  # producer -> consumer among ``ops``, through views, one phase
    truncated: bool = False  # MAX_CANDIDATES was reached: the space searched is a subset

    def __post_init__(self) -> None:
        known = set(self.ops)
        bad = next((c for c in self.candidates if not set(c) <= known or len(c) < 2), None)
        if bad is not None:
            raise ValueError(f"candidate {bad} of {self.name} is not a group of its ops")


def fusible(op: Op, anchors: bool) -> bool:
    kinds = POINTWISE | REDUCTIONS | (ANCHORS if anchors else frozenset())
    return op.kind is not OpKind.VIEW and op.phase is not Phase.OPTIMIZER and op.kind in kinds


def _adjacency(graph: Graph, ops: list[Op]) -> dict[int, set[int]]:
    """Ops of one phase joined by data: producer-consumer (through views) or reading one input."""
    ids = {op.id for op in ops}
    adj: dict[int, set[int]] = {op.id: set() for op in ops}
    by_input: dict[int, list[int]] = {}
    for op in ops:
        for t in op.inputs:
            src = source_op(graph, t)
            if src in ids and src != op.id and graph.ops[src].phase is op.phase:
                adj[op.id].add(src)
                adj[src].add(op.id)
            base = graph.tensors[graph.tensors[t].storage_id].id
            by_input.setdefault(base, []).append(op.id)
    for users in by_input.values():
        for a in users:
            for b in users:
                if a != b and graph.ops[a].phase is graph.ops[b].phase:
                    adj[a].add(b)
    return adj


def _connected_sets(adj: dict[int, set[int]], limit: int, cap: int) -> tuple[list[tuple[int, ...]], bool]:
    """Every connected vertex set of two to ``limit`` vertices, each once (grown from its smallest
    vertex by neighbours larger than it), stopping at ``cap`` sets."""
    out: list[tuple[int, ...]] = []
    seen: set[frozenset[int]] = set()
    for root in sorted(adj):
        stack: list[frozenset[int]] = [frozenset({root})]
        while stack:
            cur = stack.pop()
            if len(cur) >= limit:
                continue
            frontier = {n for v in cur for n in adj[v] if n > root and n not in cur}
            for n in sorted(frontier):
                nxt = cur | {n}
                if nxt in seen:
                    continue
                seen.add(nxt)
                out.append(tuple(sorted(nxt)))
                if len(out) >= cap:
                    return out, True
                stack.append(nxt)
    return out, False


def regions(ctx: PlanContext, *, anchors: bool) -> tuple[Region, ...]:
    """The fusion regions of ``ctx``'s model: each block template's reference block, then the ops
    outside blocks. ``anchors``: GEMMs may take pointwise prologues and epilogues (the stack's
    executor emits them)."""
    key = ("regions", anchors)
    got = ctx.memo.get(key)
    if got is not None:
        return got  # type: ignore[return-value]
    idx = ctx.index
    graph = idx.graph
    counts: dict[int, int] = {}
    for r in idx.ref_of.values():
        counts[r] = counts.get(r, 0) + 1
    greedy = greedy_groups(graph, scope_ops(ctx), into_anchors=anchors, inductor=ctx.inductor)
    out = []
    for name, blocks, members in [
        *((f"block[{r}]", counts[r], idx.block_ops[r]) for r in sorted(counts)),
        ("outside", 1, list(idx.outside)),
    ]:
        ops = [op for op in members if op.kind is not OpKind.VIEW and op.phase is not Phase.OPTIMIZER]
        ids = {op.id for op in ops}
        fus = [op for op in ops if fusible(op, anchors)]
        sets, truncated = _connected_sets(_adjacency(graph, fus), MAX_KERNEL_OPS, MAX_CANDIDATES)
        for g in greedy:  # the greedy pass's kernels, whatever their size
            real = tuple(sorted(i for i in g if i in ids))
            if len(real) > 1 and real not in sets:
                sets.append(real)
        edges = sorted(
            {
                (src, op.id)
                for op in ops
                for t in op.inputs
                if (src := source_op(graph, t)) in ids and graph.ops[src].phase is op.phase and src != op.id
            }
        )
        convex = _convexity(ids, edges)
        target = ctx.inductor
        cands = tuple(
            c
            for c in sets
            if convex(c)
            and group_problem(graph, c) is None
            and (target is None or inductor_problem(graph, c, target) is None)
        )
        out.append(Region(name, blocks, tuple(op.id for op in ops), cands, tuple(edges), truncated))
    got = ctx.memo[key] = tuple(out)
    return got


def _convexity(ids: set[int], edges: list[tuple[int, int]]) -> Callable[[tuple[int, ...]], bool]:
    """Whether a group is convex in the region's data graph: no path leaves it and comes back.
    A group that is not can be in no legal partition (the op outside on the path sits in another
    kernel, which then both needs and feeds the group), so it is no candidate."""
    succ: dict[int, list[int]] = {i: [] for i in ids}
    for a, b in edges:
        succ[a].append(b)
    bit = {i: 1 << n for n, i in enumerate(sorted(ids))}
    below: dict[int, int] = {}  # op -> bitmask of its strict descendants
    # ops are numbered in execution order, so every edge runs to a larger id: one reverse sweep
    for i in sorted(ids, reverse=True):
        acc = 0
        for j in succ[i]:
            if j <= i:
                raise ValueError(f"op {i} feeds op {j} before it: the graph is not in execution order")
            acc |= bit[j] | below[j]
        below[i] = acc

    def down(i: int) -> int:
        return below[i]

    def convex(group: tuple[int, ...]) -> bool:
        mine = 0
        for i in group:
            mine |= bit[i]
        reach = 0
        for i in group:
            reach |= down(i)
        outside = reach & ~mine
        # an op reachable from the group that reaches back into it
        return not any(outside & bit[j] and down(j) & mine for j in ids if outside & bit[j])

    return convex


def optimizer_groups(ctx: PlanContext) -> list[tuple[int, ...]]:
    """One multi-tensor optimizer kernel per block (and one for the updates outside blocks)."""
    by_block: dict[int | None, list[int]] = {}
    idx = ctx.index
    scope = [op for r in sorted(set(idx.ref_of.values())) for op in idx.block_ops[r]] + list(idx.outside)
    for op in scope:
        if op.phase is Phase.OPTIMIZER:
            by_block.setdefault(op.block, []).append(op.id)
    return [tuple(g) for g in by_block.values() if len(g) > 1]


def as_fusion(ctx: PlanContext, kernels: list[tuple[int, ...]], label: str = "joint") -> FusionPlan:
    """A fusion plan of the chosen multi-op kernels (reference ids) and the optimizer kernels."""
    graph = ctx.index.graph
    groups = [*kernels, *optimizer_groups(ctx)]
    named = tuple(tuple(graph.ops[i].name for i in g) for g in sorted(groups) if len(g) > 1)
    return FusionPlan(groups=named, label=label)


def partitions(region: Region, graph: Graph, cap: int) -> Iterator[tuple[tuple[int, ...], ...]]:
    """Every legal partition of ``region``'s ops into its candidate kernels and singletons, as the
    multi-op kernels it uses (the exhaustive oracle's fusion space). Raises ``OverflowError`` past
    ``cap`` partitions."""
    by_first: dict[int, list[tuple[int, ...]]] = {}
    for c in region.candidates:
        by_first.setdefault(c[0], []).append(c)
    containing: dict[int, list[tuple[int, ...]]] = {}
    for c in region.candidates:
        for i in c:
            containing.setdefault(i, []).append(c)
    order = list(region.ops)
    count = 0
    # the region's other ops (views) as kernels of their own: a cycle can run through them
    ids = set(order)
    blocks = {graph.ops[i].block for i in order}
    others = [(op.id,) for op in graph.ops if op.block in blocks and op.id not in ids]

    def rec(
        k: int, covered: frozenset[int], chosen: list[tuple[int, ...]]
    ) -> Iterator[tuple[tuple[int, ...], ...]]:
        nonlocal count
        while k < len(order) and order[k] in covered:
            k += 1
        if k == len(order):
            singles = [(i,) for i in order if not any(i in c for c in chosen)]
            if _kernel_graph_ok(graph, [*chosen, *singles, *others]) is None:
                count += 1
                if count > cap:
                    raise OverflowError(cap)
                yield tuple(chosen)
            return
        op = order[k]
        yield from rec(k + 1, covered | {op}, chosen)
        for c in containing.get(op, ()):
            if c[0] == op and not covered.intersection(c):
                yield from rec(k + 1, covered | set(c), [*chosen, c])

    yield from rec(0, frozenset(), [])
