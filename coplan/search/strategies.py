"""The planning strategies, registered by name, all returning ``StrategyResult``.

- ``sequential``: the production passes one after another (fusion -> remat -> parallel ->
  precision by default; any order), each with the later decisions at their defaults; from
  ``Options.base`` where given, the decisions ``space.fixed`` holds left as it has them;
- ``sequential-best``: all 24 orders, the best kept;
- ``iterated``: the passes repeated until a full round changes nothing (coordinate descent);
- ``hierarchical``: Alpa-style: parallel layouts outside, fusion, precision and remat decided per
  layout inside by the production passes;
- ``joint``: all four together (``joint.py``);
- ``exhaustive``: every combination of the search space, for small problems (the test oracle).
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from coplan.errors import CoplanError
from coplan.passes.base import DEFAULT_ORDER, PassRecord, choose, run_passes, score
from coplan.plan.checker import check
from coplan.plan.context import Decisions, PlanContext
from coplan.plan.types import Plan
from coplan.search.result import Point, StrategyResult
from coplan.search.space import Progress, SearchSpace

STRATEGIES: dict[str, Callable[..., tuple[Plan, list[PassRecord], list[str]]]] = {}
DEFAULT_STRATEGIES: tuple[str, ...] = ("sequential", "sequential-best", "iterated", "hierarchical", "joint")
MAX_ROUNDS = 10


def strategy(
    name: str,
) -> Callable[
    [Callable[..., tuple[Plan, list[PassRecord], list[str]]]],
    Callable[..., tuple[Plan, list[PassRecord], list[str]]],
]:
    def deco(
        fn: Callable[..., tuple[Plan, list[PassRecord], list[str]]],
    ) -> Callable[..., tuple[Plan, list[PassRecord], list[str]]]:
        STRATEGIES[name] = fn
        return fn

    return deco


@dataclass
class Options:
    """Inputs every strategy accepts (unused ones are ignored)."""

    order: Sequence[str] = DEFAULT_ORDER
    space: SearchSpace = field(default_factory=SearchSpace)
    progress: Progress | None = None
    warm: list[Plan] = field(default_factory=list)  # plans found by other strategies (joint)
    base: Plan | None = None  # decisions in ``space.fixed`` come from here (None: the default plan)
    max_evaluations: int = 400_000
    policy: Path | None = None  # the learned strategies' network (None: the one coplan ships)


def run_strategy(name: str, ctx: PlanContext, opts: Options | None = None) -> StrategyResult:
    if name not in STRATEGIES:
        raise KeyError(name)
    opts = opts or Options()
    before = set(ctx._priced)
    evals0 = ctx.evaluations
    t0 = time.perf_counter()
    plan, records, notes = STRATEGIES[name](ctx, opts)
    dt = time.perf_counter() - t0
    est = ctx.price(plan)
    violations = tuple(check(plan, ctx))
    new = [(k, e) for k, e in ctx._priced.items() if k not in before] or [(Decisions.of(plan), est)]
    points = tuple(Point(e.step_time_s, e.memory.peak_bytes, ctx.fits(e), k) for k, e in new)
    return StrategyResult(
        strategy=name,
        plan=plan,
        estimate=est,
        violations=violations,
        plan_time_s=dt,
        evaluations=ctx.evaluations - evals0,
        considered=points,
        passes=tuple(records),
        notes=tuple(notes),
    )


@strategy("sequential")
def sequential(ctx: PlanContext, opts: Options) -> tuple[Plan, list[PassRecord], list[str]]:
    # a decision the space holds is not a pass's to make: it stays the base plan's (the passes are
    # named after the decisions they make)
    held = [name for name in opts.order if name in opts.space.fixed]
    base = opts.base if opts.base is not None else ctx.default_plan()
    plan, records = run_passes(base, ctx, opts.order, disable=held)
    notes = [f"order: {' -> '.join(opts.order)}"]
    if held:
        notes.append(f"held as the base plan has them: {', '.join(held)}")
    return plan, records, notes


@strategy("sequential-best")
def sequential_best(ctx: PlanContext, opts: Options) -> tuple[Plan, list[PassRecord], list[str]]:
    orders = list(itertools.permutations(DEFAULT_ORDER))
    results = []
    for i, order in enumerate(orders):
        if opts.progress:
            opts.progress("sequential-best", i, len(orders))
        plan, records = run_passes(ctx.default_plan(), ctx, order)
        results.append((score(plan, ctx), i, plan, records, order))
    results.sort(key=lambda r: (r[0], r[1]))
    _, _, plan, records, order = results[0]
    return plan, records, [f"best order: {' -> '.join(order)} of {len(orders)}"]


@strategy("iterated")
def iterated(ctx: PlanContext, opts: Options) -> tuple[Plan, list[PassRecord], list[str]]:
    plan = ctx.default_plan()
    all_records: list[PassRecord] = []
    for rnd in range(1, MAX_ROUNDS + 1):
        new, records = run_passes(plan, ctx, opts.order)
        all_records.extend(records)
        if choose((plan, new), ctx) is plan and rnd > 1:
            return plan, all_records, [f"converged after {rnd} rounds"]
        if new.fingerprint == plan.fingerprint:
            return new, all_records, [f"converged after {rnd} rounds"]
        plan = new
    return plan, all_records, [f"stopped after {MAX_ROUNDS} rounds"]


@strategy("hierarchical")
def hierarchical(ctx: PlanContext, opts: Options) -> tuple[Plan, list[PassRecord], list[str]]:
    from coplan.passes.fusion import fusion_pass
    from coplan.passes.precision import precision_pass
    from coplan.passes.remat import remat_pass

    graph = ctx.index.graph
    base = ctx.default_plan()
    # the inner passes do not depend on the layout for fusion and precision: decide them once
    inner = precision_pass(graph, fusion_pass(graph, base, ctx), ctx)
    outer = [inner.with_(parallel=p) for p in opts.space.parallel(ctx)]
    best, explored = bound_search(
        ctx, outer, lambda p: remat_pass(graph, p, ctx), "hierarchical", opts.progress
    )
    assert best is not None or not outer
    return (best or inner), [], [f"{len(outer)} layouts, {explored} optimized inside (bound-pruned)"]


def bound_search(
    ctx: PlanContext,
    plans: Sequence[Plan],
    solve: Callable[[Plan], Plan],
    name: str,
    progress: Progress | None,
    warm: Sequence[Plan] = (),
    margin: float = 0.0,
    bound: Callable[[Plan], float] | None = None,
) -> tuple[Plan | None, int]:
    """Branch and bound over ``plans`` (nothing recomputed yet), each completed by ``solve``.

    Recomputation only adds time, so a plan priced with nothing recomputed bounds every completion
    of it from below: plans are explored best bound first, and once a fitting plan is found every
    plan whose bound is not better is pruned. ``warm`` plans seed the incumbent. ``margin``: the
    share by which a completion may price below its plan (``solve`` also changes decisions that
    can save time, as the exact strategy's fusion does); ``bound``: a tighter lower bound than the
    plan's own price, where one is known. Returns the best
    plan by ``score`` (None when ``plans`` and ``warm`` are empty) and how many were solved.
    """
    best = choose(warm, ctx)
    best_key = score(best, ctx) if best is not None else (3, 0.0)
    at = bound or (lambda p: ctx.price(p).step_time_s)
    priced = (((1 - margin) * at(p), i, p) for i, p in enumerate(plans))
    bounds = sorted(priced, key=lambda x: x[:2])
    explored = 0
    for n, (lb, _, p) in enumerate(bounds):
        if progress:
            progress(name, n, len(bounds))
        if best_key[0] == 0 and lb >= best_key[1]:
            break
        cand = solve(p)
        explored += 1
        k = score(cand, ctx)
        if k < best_key:
            best, best_key = cand, k
    return best, explored


class SearchTooLarge(CoplanError, ValueError):
    """A strategy asked to enumerate more plans than it may: a refusal (exit 2), not a crash."""


@strategy("exhaustive")
def exhaustive(ctx: PlanContext, opts: Options) -> tuple[Plan, list[PassRecord], list[str]]:
    from coplan.passes.remat import saved_names, with_remat

    names = saved_names(ctx)
    fixed_remat = "remat" in opts.space.fixed
    base = opts.base if opts.base is not None else ctx.default_plan()
    # per op: every per-op dtype assignment of the blocks too, as joint-exact searches them
    combos = opts.space.plans(ctx, base, per_op_dtypes=opts.space.per_op)
    subsets_n = 1 if fixed_remat else 2 ** len(names)
    if opts.space.per_op:
        combos = _per_op(ctx, opts, base, combos, max(1, opts.max_evaluations // subsets_n))
    # counted before anything is enumerated: 2^n recompute sets of a real model do not fit in memory
    total = len(combos) * subsets_n
    if total > opts.max_evaluations:
        raise SearchTooLarge(
            f"exhaustive search would price {total:,} plans "
            f"(limit {opts.max_evaluations:,}); use a smaller problem or another strategy"
        )
    subsets: list[frozenset[str] | None] = (
        [None]  # the base plan's recompute set, already applied by ``space.plans``
        if fixed_remat
        else [frozenset(c) for r in range(len(names) + 1) for c in itertools.combinations(names, r)]
    )
    best: Plan | None = None
    best_key = (3, 0.0)
    for i, p0 in enumerate(combos):
        if opts.progress:
            opts.progress("exhaustive", i, len(combos))
        for s in subsets:
            p = p0 if s is None else with_remat(p0, s, ctx)
            k = score(p, ctx)
            if k < best_key:
                best, best_key = p, k
    if best is None:  # no layout is possible: the default plan carries the job's error
        best = base
    return best, [], [f"{total:,} plans priced"]


def _per_op(ctx: PlanContext, opts: Options, base: Plan, combos: list[Plan], limit: int) -> list[Plan]:
    """``combos`` with their fusion replaced by every legal per-op partition (``opspace``), the
    space ``joint-exact`` searches; unchanged where fusion is not decided per op. More than
    ``limit`` plans (before recompute sets) is ``SearchTooLarge``, found before they are built."""
    from dataclasses import replace

    from coplan.passes.remat import with_remat
    from coplan.search.exact import op_level
    from coplan.search.opspace import as_fusion, partitions, regions

    op, anchors = op_level(ctx, opts)
    if not op:
        return combos
    graph = ctx.index.graph
    widest = "epilogue" if anchors else "greedy"
    outer = replace(opts.space, fusion=(widest,)).plans(ctx, base)
    cap = max(1, limit // max(1, len(outer)))
    too_large = SearchTooLarge(
        f"exhaustive search would price over {limit * max(1, len(outer)):,} partitions into kernels "
        f"x layouts before recompute sets (limit {opts.max_evaluations:,} plans); use a smaller "
        "problem or another strategy"
    )
    spaces = []
    try:
        for r in regions(ctx, anchors=anchors):
            spaces.append(list(partitions(r, graph, cap)))
    except OverflowError:
        raise too_large from None
    if math.prod(len(s) for s in spaces) > cap:
        raise too_large
    fusions = [as_fusion(ctx, [k for part in combo for k in part]) for combo in itertools.product(*spaces)]
    fixed = "remat" in opts.space.fixed
    return [
        with_remat(p.with_(fusion=f), base.remat.all_names, ctx) if fixed else p.with_(fusion=f)
        for p in outer
        for f in fusions
    ]
