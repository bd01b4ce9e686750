"""From the policy's outputs to a legal plan, and the strategies that use it.

``decode`` turns one layout's per-op outputs into a plan:

- **fusion**: a candidate kernel of the job's fusion regions (``search.opspace``: every group the
  checker and the target compiler accept) is taken when the policy fuses every data edge inside
  it; the largest such candidates are taken first, disjoint, each kept only if the kernels stay
  acyclic (``plan.checker._kernel_graph_ok``). Legal by construction;
- **recomputation**: the saved tensors of the ops the policy recomputes (``with_remat`` places
  pointwise recomputation inside the backward kernels, as for every compiled plan);
- **precision**: the dtype overrides the policy gives (dropped if the checker refuses them).

``repair`` then makes it fit: while the plan exceeds the budget, it recomputes more saved tensors,
the policy's likeliest first (a bisection over that order); a plan that fits with nothing else
recomputes everything it can. Every plan is checked by ``plan.checker`` and priced by the cost
model before it is returned (``run_strategy`` does both again).

Strategies (registered in ``search.strategies``):
- ``learned-greedy``: the policy's best-scored layout, decoded and repaired: one answer;
- ``learned``: the ``LEARNED_K`` best-scored layouts decoded and repaired, each also with the
  plain greedy fusion in place of the policy's, the best one's fusion also decoded at less and
  more confident odds (``FUSE_SPREAD``), the policy's compiled plans also with what Inductor's
  partitioner recomputes by default (``_partitioned``), all priced by the cost model; the best
  kept.
Either goes on down the policy's ranking of layouts, one at a time, while no plan fits: a layout
the policy ranks low may be the only one that fits the budget.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from coplan.learn.features import DTYPE_CLASSES, job_graph, layout_matrix
from coplan.learn.policy import Outputs, PolicyNet
from coplan.plan.checker import _kernel_graph_ok, check, is_valid
from coplan.plan.types import ParallelPlan, Plan, PrecisionPlan

__all__ = ["LEARNED_K", "decode", "default_policy", "layout_plan", "plan_with_policy", "repair"]

#: plans the ``learned`` strategy prices with the analytic model (layouts, without a cost model)
LEARNED_K = 8
#: layouts decoded per plan priced when a learned cost model ranks them first
COST_POOL = 4
#: logit thresholds at which ``learned`` also decodes its best layout's fusion, beside 0 (even
#: odds): edges the policy fuses with a probability above 0.05, 0.27, 0.73 and 0.95. On a family
#: it never saw (MoE's router and experts) its odds are least sure, and the best plan sits away
#: from even odds.
FUSE_SPREAD = (-3.0, -1.0, 1.0, 3.0)
#: the policy that ships with coplan (``benchmarks/train_policy.py`` makes it)
DEFAULT_POLICY = Path(__file__).with_name("policy.pt")

_loaded: dict[Path, PolicyNet] = {}


def default_policy(path: Path | None = None) -> PolicyNet:
    """The network in ``path`` (default: the shipped one), loaded once per process."""
    from coplan.learn.train import PolicyError, load_policy

    p = (path or DEFAULT_POLICY).resolve()
    got = _loaded.get(p)
    if got is None:
        if path is None and not p.is_file():
            raise PolicyError(p, "no trained policy ships with this install; give --policy model.pt")
        got, _ = load_policy(p)
        _loaded[p] = got
    return got


def _anchors(ctx: Any) -> bool:
    return "epilogue" in ctx.stack.fusion


def _candidate_edges(ctx: Any) -> list[tuple[Any, list[tuple[tuple[int, ...], list[tuple[int, int]]]]]]:
    """Each fusion region with its candidate kernels and the data edges inside each (candidates
    holding none left out), memoised on ``ctx``: the same for every layout decoded."""
    from coplan.search.opspace import regions

    key = ("learn.candidate_edges", _anchors(ctx))
    got = ctx.memo.get(key)
    if got is None:
        got = []
        for reg in regions(ctx, anchors=_anchors(ctx)):
            per = []
            for c in reg.candidates:
                members = set(c)
                edges = [(a, b) for a, b in reg.edges if a in members and b in members]
                if edges:
                    per.append((c, edges))
            got.append((reg, per))
        ctx.memo[key] = got
    return got


def decode(ctx: Any, out: Outputs, par: ParallelPlan, prec: PrecisionPlan, fuse_at: float = 0.0) -> Plan:
    """The plan of ``out`` (outputs under layout ``par`` x ``prec``) for ``ctx``'s job; an edge is
    fused where its logit exceeds ``fuse_at`` (0: the policy's even odds)."""
    from coplan.passes.remat import with_remat
    from coplan.search.opspace import as_fusion

    jg = job_graph(ctx, anchors=_anchors(ctx))
    graph = ctx.index.graph
    src, dst = jg.edge_index[:, : jg.n_data].tolist()
    fuse = (out.fuse > fuse_at).tolist()
    wanted = {(jg.ops[a], jg.ops[b]) for a, b, f in zip(src, dst, fuse, strict=True) if f}
    kernels: list[tuple[int, ...]] = []
    for reg, cand_edges in _candidate_edges(ctx):
        inner = {c: len(edges) for c, edges in cand_edges if all(e in wanted for e in edges)}
        taken: set[int] = set()
        chosen: list[tuple[int, ...]] = []
        for c in sorted(inner, key=lambda c: (-len(c), -inner[c], c)):
            if taken & set(c):
                continue
            trial = [*chosen, c]
            singles: list[tuple[int, ...]] = [(i,) for i in reg.ops if i not in taken and i not in c]
            if _kernel_graph_ok(graph, trial + singles) is None:
                chosen.append(c)
                taken |= set(c)
        kernels.extend(chosen)
    rec = (out.recompute > 0).tolist()
    names = frozenset(
        n
        for keep, ns, s in zip(rec, jg.saved_names, jg.saved.tolist(), strict=True)
        if keep and s
        for n in ns
    )
    classes = out.dtype.argmax(-1).tolist()
    overrides = tuple(sorted((jg.names[i], DTYPE_CLASSES[c]) for i, c in enumerate(classes) if c))
    plan = ctx.default_plan().with_(
        parallel=par, precision=replace(prec, ops=overrides), fusion=as_fusion(ctx, kernels)
    )
    if overrides and not is_valid(plan, ctx):
        plan = plan.with_(precision=replace(prec, ops=()))
    return with_remat(plan, names, ctx)


def repair(plan: Plan, ctx: Any, order: list[str]) -> Plan:
    """``plan`` made to fit by recomputing more of ``order`` (saved tensor names, likeliest
    first), as little as fits, and where that is full recomputation, of as few blocks as fit
    (``passes.remat.fewest_layers``); unchanged if it fits or nothing helps."""
    from coplan.passes.remat import fewest_layers, saved_names, with_remat

    if not is_valid(plan, ctx):
        return plan
    if ctx.fits(ctx.price(plan)):
        return plan
    have = set(plan.remat.all_names)
    extra = [n for n in order if n not in have] + [
        n for n in saved_names(ctx) if n not in have and n not in order
    ]
    lo, hi = 0, len(extra)

    def at(k: int) -> Plan:
        return with_remat(plan, frozenset(have | set(extra[:k])), ctx)

    if not ctx.fits(ctx.price(at(hi))):
        return at(hi)  # the least memory this layout reaches
    while lo < hi:  # memory falls as more is recomputed: the shortest prefix that fits
        mid = (lo + hi) // 2
        if ctx.fits(ctx.price(at(mid))):
            hi = mid
        else:
            lo = mid + 1
    return fewest_layers(at(lo), ctx)


def _variants(ctx: Any, plan: Plan, per_op: bool, k: int) -> list[Plan]:
    """``plan`` as the stack runs it: under each kernel set of a stack with its own kernels;
    with the policy's kernels and (``k`` > 1) with the plain greedy fusion where it compiles the
    plan's own."""
    from coplan.passes.remat import with_remat
    from coplan.search.space import SearchSpace, fusion_option

    names = plan.remat.all_names
    if not per_op:
        options = SearchSpace().fusions(ctx, plan.precision)  # those that run its precision
        return [with_remat(plan.with_(fusion=f), names, ctx) for f in options]
    out = [plan]
    if k > 1:
        out.append(with_remat(plan.with_(fusion=fusion_option(ctx, "greedy")), names, ctx))
    return out


def _reductions(ctx: Any, plan: Plan) -> list[Plan]:
    """``plan``, and where its stack reduces gradients in 16 bits, ``plan`` doing so too. The
    policy scores layouts by compute dtype and fp8 weights only and has no head for the
    gradient-reduction dtype, which the search space offers beside them
    (``search.space.SearchSpace._storage``): the decoder completes that decision by the cost
    model, as it completes recomputation (``repair``)."""
    c = plan.precision
    if not ctx.stack.reduce_16bit or ctx.gpus == 1 or c.grad_reduce != "fp32":
        return [plan]
    if c.compute not in ("bf16", "fp16", "fp8"):
        return [plan]
    half = "fp16" if c.compute == "fp16" else "bf16"
    return [plan, plan.with_(precision=replace(c, grad_reduce=half))]


def layout_plan(
    ctx: Any,
    net: PolicyNet,
    jg: Any,
    enc: tuple[torch.Tensor, torch.Tensor],
    layout: torch.Tensor,
    cand: tuple[ParallelPlan, PrecisionPlan],
    k: int,
    spread: bool = False,
) -> tuple[list[Plan], list[str]]:
    """The layout and precision ``cand`` (features ``layout``) decoded from the policy's
    per-op heads (``enc``: ``net.encode(jg)``): its plans as the stack runs them (``_variants``)
    and the saved tensors, likeliest recomputed first (``repair``'s order). With ``spread``, where
    the stack compiles the plan's own kernels, the fusion is also decoded at the thresholds of
    ``FUSE_SPREAD``: the kernels the policy is unsure of, fused and left apart."""
    x, g = enc
    out = Outputs(torch.zeros(0), *net.decisions(jg, x, g, layout))
    probs = torch.sigmoid(out.recompute).tolist()
    order = sorted(((p, n) for p, ns in zip(probs, jg.saved_names, strict=True) for n in ns), reverse=True)
    par, prec = cand
    plan = decode(ctx, out, par, prec)
    per_op = "greedy" in ctx.stack.fusion  # the stack compiles the plan's own kernels
    plans = _variants(ctx, plan, per_op, k)
    own = [plan]
    if spread and per_op:
        seen = {p.fusion for p in plans}
        for at in FUSE_SPREAD:
            other = decode(ctx, out, par, prec, fuse_at=at)
            if other.fusion not in seen:
                seen.add(other.fusion)
                plans.append(other)
                own.append(other)
    if per_op and k > 1:
        plans.extend(p for p in (_partitioned(ctx, q) for q in own) if p is not None and p not in plans)
    return plans, [n for _, n in order]


def _partitioned(ctx: Any, plan: Plan) -> Plan | None:
    """``plan`` with what Inductor's min-cut partitioner recomputes by default added to its
    recomputation (``passes.remat.with_mincut``), as the production remat pass starts from it.
    None where it adds nothing."""
    from coplan.passes.remat import with_mincut

    got = with_mincut(plan, ctx)
    return None if got is plan else got


def plan_with_policy(ctx: Any, net: PolicyNet, k: int) -> tuple[Plan, int, list[str]]:
    """The policy's plan for ``ctx``'s job: (plan, plans priced by the cost model, notes).

    The ``k`` best-scored layouts decoded, repaired and priced. With a learned cost model
    (``net.cost``) and ``k`` > 1, as an autotuner besides: the layouts ranked ``k`` to
    ``COST_POOL * k`` decoded, ranked by the learned cost model (predicted to fit first, then by
    predicted step time), and the ``k // 2`` it ranks first repaired and priced too. While no plan
    fits, the rest are priced in that order, then on down the policy's ranking one layout at a
    time. The best priced plan is kept."""
    from coplan.learn.features import layout_candidates, plan_node_features
    from coplan.passes.base import score

    jg = job_graph(ctx, anchors=_anchors(ctx))
    cands = layout_candidates(ctx)
    feats = layout_matrix(ctx, cands)
    k = max(1, k)
    priced: list[Plan] = []
    with torch.no_grad():
        x, g = net.encode(jg)  # once: the layouts differ only in what the heads read
        ranked = torch.argsort(net.scores(x, g, feats), descending=True).tolist()

        def decoded(i: int) -> tuple[list[Plan], list[str]]:
            # the best-scored layout's fusion also decoded at ``FUSE_SPREAD``'s thresholds
            return layout_plan(ctx, net, jg, (x, g), feats[i], cands[i], k, spread=k > 1 and i == ranked[0])

        fitting = False  # whether a priced plan is valid and fits

        def price(plans: list[Plan], names: list[str]) -> None:
            nonlocal fitting
            for p in (q for plan in plans for q in _reductions(ctx, plan)):
                p = repair(p, ctx, names)
                priced.append(p)
                fitting = fitting or (ctx.fits(ctx.price(p)) and is_valid(p, ctx))

        for i in ranked[:k]:
            price(*decoded(i))
        rest: list[tuple[Plan, list[str]]] = []  # decoded, not priced, best first
        start = k
        if net.cost is not None and k > 1:
            # the autotuner: the next layouts decoded and ranked by the learned cost model (predicted
            # to fit first, then by predicted step time); the best few priced besides
            pool: list[tuple[bool, float, int, Plan, list[str]]] = []
            log_budget = math.log(ctx.budget)
            for i in ranked[k : COST_POOL * k]:
                plans, names = decoded(i)
                for p in plans:
                    log_step, log_peak = net.cost(jg, plan_node_features(jg, p), feats[i]).tolist()
                    pool.append((log_peak > log_budget, log_step, len(pool), p, names))
            pool.sort(key=lambda t: t[:3])
            extra = max(1, k // 2)
            for *_, p, names in pool[:extra]:
                price([p], names)
            rest = [(p, names) for *_, p, names in pool[extra:]]
            start = COST_POOL * k

        for p, names in rest:  # nothing fits yet: what was decoded first, in the cost model's order
            if fitting:
                break
            price([p], names)
        for i in ranked[start:]:
            if fitting:
                break
            price(*decoded(i))
    valid = [p for p in priced if not check(p, ctx, memory=False)]
    best = min(valid or priced, key=lambda p: score(p, ctx))
    how = "and the learned cost model's picks" if net.cost is not None and k > 1 else "decoded"
    notes = [
        f"policy: {len(priced)} plans priced of its best-scored layouts ({how}), {len(cands)} layouts in all"
    ]
    return best, len(priced), notes
