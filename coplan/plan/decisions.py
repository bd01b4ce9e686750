"""A plan's per-op decisions counted for one transformer block: how many kernels the block's ops
run as, how many producer-consumer edges inside it are fused, how many of its saved tensors are
recomputed, how many of its ops run in a dtype of their own and how many are duplicated into
their readers' kernels.

A plan names the ops and tensors of its template's reference block (the block its fusion groups,
recompute sets and dtype overrides name; ``apply.fusion.expand_groups`` applies them to every
block of the template), so the counts are the reference block's, the same for every block of the
template; the ops outside the blocks (embedding, final norm, LM head, loss, the optimizer) are
counted apart.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

from coplan.cost.fusion import default_groups, source_op
from coplan.ir.types import Graph, Op, OpKind
from coplan.plan.types import Plan


def _groups(plan: Plan, graph: Graph) -> tuple[tuple[str, ...], ...]:
    """The plan's kernels: its groups, or those of the named kernel set it runs (``megatron``:
    Megatron-LM's fused kernels, as the cost model prices them)."""
    if plan.fusion.groups or plan.fusion.label != "megatron":
        return plan.fusion.groups
    return tuple(tuple(graph.ops[i].name for i in g) for g in default_groups(graph, "megatron") if len(g) > 1)


def _counts(plan: Plan, graph: Graph, ops: list[Op], groups: tuple[tuple[str, ...], ...]) -> dict[str, int]:
    names = {op.name for op in ops}
    dup = plan.fusion.duplicated & names
    group_of = {n: i for i, g in enumerate(groups) for n in g}
    here = {group_of[n] for n in names if n in group_of}
    # a duplicated op has no kernel of its own: its copies sit in its readers' kernels
    alone = sum(
        1 for op in ops if op.name not in group_of and op.name not in dup and op.kind is not OpKind.VIEW
    )
    fused = 0
    for op in ops:
        producers = {source_op(graph, t) for t in op.inputs}
        # an edge from a duplicated producer is fused in the reader's kernel, which holds a copy
        fused += sum(
            1
            for p in producers
            if p is not None and graph.ops[p].name in dup and graph.ops[p].phase is op.phase
        )
        g = group_of.get(op.name)
        if g is None:
            continue
        fused += sum(1 for p in producers if p is not None and group_of.get(graph.ops[p].name) == g)
    produced_here = {graph.tensors[t].name for op in ops for t in op.outputs}
    return {
        "kernels": len(here) + alone,
        "fused_edges": fused,
        "recomputed": len(plan.remat.all_names & produced_here),
        "dtype_overrides": sum(1 for n, _ in plan.precision.ops if n in names),
        "duplicated": len(dup),
    }


def _named(plan: Plan) -> set[str]:
    out = {n for g in plan.fusion.groups for n in g}
    out |= {n for n, _ in plan.precision.ops} | plan.fusion.duplicated
    return out


def block_decisions(plan: Plan, graph: Graph) -> dict[str, Any]:
    """``{"block", "kernels", "fused_edges", "recomputed", "dtype_overrides", "outside"}``: the
    counts for the reference block (the block holding most of the ops and tensors the plan names;
    the first block when it names none) and, under ``outside``, for the ops in no block."""
    blocks: dict[int, list[Op]] = {}
    outside: list[Op] = []
    for op in graph.ops:
        (blocks.setdefault(op.block, []) if op.block is not None else outside).append(op)
    named = _named(plan)
    tensors = plan.remat.all_names
    votes: Counter[int] = Counter()
    for b, ops in blocks.items():
        votes[b] = sum(1 for op in ops if op.name in named) + sum(
            1 for op in ops for t in op.outputs if graph.tensors[t].name in tensors
        )
    ref = _reference(votes, blocks)
    head: dict[str, Any] = {"block": ref}
    groups = _groups(plan, graph)
    head |= _counts(plan, graph, blocks[ref], groups) if ref is not None else dict.fromkeys(_KEYS, 0)
    head["outside"] = _counts(plan, graph, outside, groups)
    return head


_KEYS = ("kernels", "fused_edges", "recomputed", "dtype_overrides", "duplicated")


def _reference(votes: Counter[int], blocks: Iterable[int]) -> int | None:
    ordered = sorted(blocks)
    if not ordered:
        return None
    best = max(votes.values(), default=0)
    return next(b for b in ordered if votes[b] == best) if best > 0 else ordered[0]
