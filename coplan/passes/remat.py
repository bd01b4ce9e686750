"""The rematerialization pass: which saved tensors to recompute, with the other decisions fixed.

Production-style, as compilers decide it today: nothing is recomputed while the plan fits the
memory budget; otherwise tensors are dropped greedily by recompute time per byte freed (the
ratio Inductor's min-cut partitioner and Checkmate's LP relaxation rank by), measured on the cost
model, until the plan fits. Megatron's full recomputation (every saved tensor of the block) is
always a candidate too, and the best fitting candidate wins.
"""

from __future__ import annotations

from coplan.errors import CoplanError
from coplan.ir.types import Graph
from coplan.passes.base import choose, register, score
from coplan.plan.context import PlanContext
from coplan.plan.types import Plan, RematPlan


def saved_names(ctx: PlanContext) -> tuple[str, ...]:
    out: list[str] = []
    for names in ctx.index.saved_names.values():
        out.extend(names)
    return tuple(dict.fromkeys(out))


def with_remat(plan: Plan, names: frozenset[str]) -> Plan:
    return plan.with_(remat=RematPlan(recompute=names))


def ranked(plan: Plan, ctx: PlanContext, base: frozenset[str] = frozenset()) -> list[tuple[float, str]]:
    """Saved tensors not in ``base`` by recompute seconds per byte freed (cheapest first)."""
    est0 = ctx.price(with_remat(plan, base))
    out = []
    for n in saved_names(ctx):
        if n in base:
            continue
        est = ctx.price(with_remat(plan, base | {n}))
        freed = est0.memory.peak_bytes - est.memory.peak_bytes
        cost = est.step_time_s - est0.step_time_s
        if freed <= 0:
            continue
        out.append((max(cost, 0.0) / freed, n))
    out.sort()
    return out


@register("remat")
def remat_pass(graph: Graph, plan: Plan, ctx: PlanContext) -> Plan:
    try:
        none = with_remat(plan, frozenset())
        if score(none, ctx)[0] == 0:
            return none
        chosen: frozenset[str] = frozenset()
        greedy = none
        for _, n in ranked(plan, ctx):
            chosen = chosen | {n}
            greedy = with_remat(plan, chosen)
            if score(greedy, ctx)[0] == 0:
                break
        full = with_remat(plan, frozenset(saved_names(ctx)))
        best = choose((none, greedy, full), ctx)
        return best if best is not None else plan
    except CoplanError:  # an unpriceable plan (the parallel defaults may not divide): leave it
        return plan
