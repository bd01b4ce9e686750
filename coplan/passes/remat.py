"""The rematerialization pass: which saved tensors to recompute, with the other decisions fixed.

Production-style, as compilers decide it today. Under a compiled fusion plan the pass starts
where Inductor's min-cut partitioner does, memory budget or not (``mincut_names``): every saved
tensor a pointwise forward op makes from kept values is recomputed inside the backward kernels
that read it, since its backward readers are all fusible with it. Then, while the plan does not
fit, tensors are dropped greedily by recompute time per byte freed (the ratio Inductor's
``activation_memory_budget`` knapsack and Checkmate's LP relaxation rank by), measured on the
cost model. Under eager or Megatron kernels nothing is recomputed while the plan fits. Megatron's
full recomputation (every saved tensor of the block but its output, which the checkpoint keeps)
is always a candidate too, and the best fitting candidate wins. Where the stack checkpoints only
some blocks fully (Megatron-LM's ``--recompute-method block``, torchtitan's every N-th block,
fms-fsdp's share), full recomputation recomputes the fewest blocks of each chunk that fit
(``fewest_layers``), as the recipes that set ``--recompute-num-layers`` do by hand.
"""

from __future__ import annotations

from dataclasses import replace

from coplan.cost.remat import inductor_recomputes
from coplan.errors import CoplanError
from coplan.ir.types import Graph
from coplan.passes.base import choose, register, score
from coplan.passes.fusion import xla_fusion
from coplan.plan.capabilities import chunk_sizes, executable_remat, policy_sets
from coplan.plan.checker import POINTWISE
from coplan.plan.context import PlanContext
from coplan.plan.types import Plan, RematPlan


def saved_names(ctx: PlanContext) -> tuple[str, ...]:
    out: list[str] = []
    for names in ctx.index.saved_names.values():
        out.extend(names)
    return tuple(dict.fromkeys(out))


#: Fusion plans made by a code generator (Inductor-style); eager ops and Megatron's hand-written
#: kernels cannot take recomputation into their backward kernels.
COMPILED = frozenset({"greedy", "epilogue", "joint", "duplicate"})


def with_remat(plan: Plan, names: frozenset[str], ctx: PlanContext | None = None) -> Plan:
    """``plan`` recomputing ``names``. Given ``ctx`` and a compiled fusion plan, pointwise producers
    of recomputed tensors re-run inside the backward kernels reading them, as Inductor's min-cut
    partitioner emits them (arithmetic only: no launch, no traffic, nothing stored). Given ``ctx``
    whose stack runs only its checkpointing policies, ``names`` becomes the smallest policy set
    recomputing at least them (``plan.capabilities.executable_remat``)."""
    if ctx is not None:
        names = executable_remat(ctx, names)
    plan = plan.with_(remat=RematPlan(recompute=names))
    if ctx is None:
        return plan
    if plan.fusion.label == "duplicate" and "duplicate" in ctx.stack.fusion:
        # an XLA-style compiler fuses the graph with its recomputation: what is no longer kept
        # may be duplicated into its readers (``passes.fusion.xla_fusion``)
        plan = plan.with_(fusion=replace(xla_fusion(ctx, names), recompute_in_backward=frozenset()))
    fused = in_backward(ctx, names) if plan.fusion.label in COMPILED else frozenset()
    if fused != plan.fusion.recompute_in_backward:
        plan = plan.with_(fusion=replace(plan.fusion, recompute_in_backward=fused))
    return plan


def in_backward(ctx: PlanContext, names: frozenset[str]) -> frozenset[str]:
    """Pointwise ops of the reference blocks producing the tensors ``names``."""
    producer = ctx.index.producer_of
    ops = [op for op in (producer.get(n) for n in names) if op is not None]
    return frozenset(op.name for op in ops if op.kind in POINTWISE and op.block is not None)


def ranked(plan: Plan, ctx: PlanContext, base: frozenset[str] = frozenset()) -> list[tuple[float, str]]:
    """Saved tensors not in ``base`` by recompute seconds per byte freed (cheapest first)."""
    est0 = ctx.price(with_remat(plan, base, ctx))
    out = []
    for n in saved_names(ctx):
        if n in base:
            continue
        est = ctx.price(with_remat(plan, base | {n}, ctx))
        freed = est0.memory.peak_bytes - est.memory.peak_bytes
        cost = est.step_time_s - est0.step_time_s
        if freed <= 0:
            continue
        out.append((max(cost, 0.0) / freed, n))
    out.sort()
    return out


def mincut_names(ctx: PlanContext) -> frozenset[str]:
    """The saved tensors Inductor's min-cut partitioner recomputes by default (no budget), in each
    reference block: ``coplan.cost.remat.inductor_recomputes``, the rule the estimate prices a
    compiled block that no set checkpoints with."""
    key = ("mincut", saved_names(ctx))
    got = ctx.memo.get(key)
    if got is None:
        prof = ctx.reference_profile
        got = ctx.memo[key] = frozenset(
            n for part in prof.templates for n in inductor_recomputes(prof.graph, part)[0]
        )
    return got  # type: ignore[return-value]


def with_mincut(plan: Plan, ctx: PlanContext) -> Plan:
    """``plan`` also recomputing what Inductor's min-cut partitioner recomputes by default
    (``mincut_names``), where the stack compiles the plan's kernels (a ``COMPILED`` fusion) and
    recomputes any set: the compiler's own completion of a compiled plan. ``plan`` itself where
    that adds nothing."""
    if not ctx.stack.recompute_sets or plan.fusion.label not in COMPILED:
        return plan
    have = plan.remat.all_names
    more = mincut_names(ctx) - have
    return with_remat(plan, frozenset(have | more), ctx) if more else plan


def full_names(ctx: PlanContext) -> frozenset[str]:
    """Full recomputation as Megatron-LM and ``torch.utils.checkpoint`` run it: every saved tensor
    of the block but its output, the next block's input, which the checkpoint keeps (dropping it
    would make every block re-run the ones before it)."""
    from coplan.cost.remat import drops_output

    graph = ctx.reference_profile.graph
    parts = [p for p in ctx.reference_profile.templates if p.blocks]
    out = set()
    for n in saved_names(ctx):
        owner = [p for p in parts if any(name == n for _, name, _ in p.saved_items)]
        if not any(drops_output(graph, p, frozenset({n})) for p in owner):
            out.add(n)
    return frozenset(out)


def fewest_layers(plan: Plan, ctx: PlanContext) -> Plan:
    """``plan``, where it recomputes every block fully and fits, with only the fewest blocks of
    each model chunk recomputed that still fit, among the counts its stack's per-layer
    checkpointing can give (``StackSpec.layer_counts``). Each block recomputed adds its forward
    and frees its saved activations less its input, so memory falls and time rises with the
    count: the fewest that fit is the fastest, found by bisection. Other plans are returned as
    they are."""
    r = plan.remat
    if ctx.stack.layer_checkpointing == "none" or r.layers is not None or r.per_stage is not None:
        return plan
    full = policy_sets(ctx).get("full")
    if not full or r.recompute != full or score(plan, ctx)[0] != 0:
        return plan
    counts = ctx.stack.layer_counts(min(chunk_sizes(plan, ctx)))
    lo, hi = 0, len(counts)  # the first count that fits; len(counts): none short of every block
    while lo < hi:
        mid = (lo + hi) // 2
        if score(plan.with_(remat=replace(r, layers=counts[mid])), ctx)[0] == 0:
            hi = mid
        else:
            lo = mid + 1
    if lo == len(counts):
        return plan
    fewer = plan.with_(remat=replace(r, layers=counts[lo]))
    return fewer if score(fewer, ctx) < score(plan, ctx) else plan


@register("remat")
def remat_pass(graph: Graph, plan: Plan, ctx: PlanContext) -> Plan:
    try:
        start = (
            mincut_names(ctx) if plan.fusion.label in COMPILED and ctx.stack.recompute_sets else frozenset()
        )
        none = with_remat(plan, start, ctx)
        if score(none, ctx)[0] == 0:
            return none
        chosen: frozenset[str] = start
        greedy = none
        for _, n in ranked(plan, ctx, start):
            chosen = chosen | {n}
            greedy = with_remat(plan, chosen, ctx)
            if score(greedy, ctx)[0] == 0:
                break
        full = with_remat(plan, full_names(ctx), ctx)
        best = choose((none, greedy, full), ctx)
        return fewest_layers(best, ctx) if best is not None else plan
    except CoplanError:  # an unpriceable plan (the parallel defaults may not divide): leave it
        return plan
