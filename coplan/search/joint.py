"""The joint strategy: fusion, remat, parallelism and precision decided together.

Outer level: every (parallel layout, compute precision, fusion option) of the search space,
bounded below by its step time with nothing recomputed (recomputation only adds time), and
explored best-bound-first: once a fitting plan is found, every combination whose bound is not
better is pruned, so the outer search is exact.

Inner level, per combination that does not fit with nothing recomputed: which saved tensors to
recompute, as a 0/1 knapsack solved exactly by OR-Tools CP-SAT (minimise the recompute seconds
subject to freeing the missing bytes; each tensor's seconds and bytes measured on the cost model
for this combination, so the fusion, precision and layout it is priced under are the real ones).
The cost model's memory is not exactly additive (transients, liveness), so the solver's answer is
priced and, if it still does not fit, re-solved with the shortfall added; then improved by local
search (drop, add or swap one tensor) on the true cost model, and the winner's set by two-for-one
and one-for-two swaps too. Warm starts (the other strategies' plans) are priced too, so ``joint``
is never worse than a strategy it was given.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace

from coplan.cost import Estimate
from coplan.passes.base import PassRecord, score
from coplan.passes.precision import op_moves
from coplan.passes.remat import fewest_layers, remat_pass, saved_names, with_remat
from coplan.plan.context import PlanContext
from coplan.plan.types import Plan, RematPlan
from coplan.search.strategies import Options, bound_search, strategy

SCALE_S = 1e9  # CP-SAT works on integers: nanoseconds and bytes
MAX_RESOLVES = 6


def knapsack(items: list[tuple[str, float, float]], need: float) -> frozenset[str] | None:
    """Names minimising total seconds with total freed bytes >= ``need`` (None: impossible).
    ``items`` are (name, seconds, bytes freed)."""
    from ortools.sat.python import cp_model

    if need <= 0:
        return frozenset()
    if sum(b for _, _, b in items) < need:
        return None
    m = cp_model.CpModel()
    xs = [m.new_bool_var(n) for n, _, _ in items]
    m.add(sum(int(b) * x for (_, _, b), x in zip(items, xs, strict=True)) >= int(need) + 1)
    m.minimize(sum(round(s * SCALE_S) * x for (_, s, _), x in zip(items, xs, strict=True)))
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    # a deterministic budget, not wall-clock seconds: on a loaded machine a time limit could stop
    # at a different feasible answer, and the plan would depend on the machine's load
    solver.parameters.max_deterministic_time = 2.0
    st = solver.solve(m)
    if st not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    return frozenset(n for (n, _, _), x in zip(items, xs, strict=True) if solver.value(x))


def optimise_remat(plan: Plan, ctx: PlanContext) -> Plan:
    """The fastest fitting recompute set for ``plan``'s other decisions (see the module doc)."""
    none = with_remat(plan, frozenset(), ctx)
    e0 = ctx.price(none)
    if ctx.fits(e0):
        return none
    names = saved_names(ctx)
    items = []
    for n, e in _each_alone(plan, ctx, names).items():
        freed = e0.memory.peak_bytes - e.memory.peak_bytes
        if freed > 0:
            items.append((n, max(0.0, e.step_time_s - e0.step_time_s), freed))
    need = e0.memory.peak_bytes - ctx.budget
    candidates = [none, with_remat(plan, frozenset(names), ctx), remat_pass(ctx.index.graph, plan, ctx)]
    chosen = None
    for _ in range(MAX_RESOLVES):
        chosen = knapsack(items, need)
        if chosen is None:
            break
        p = with_remat(plan, chosen, ctx)
        candidates.append(p)
        e = ctx.price(p)
        if ctx.fits(e):
            break
        need += e.memory.peak_bytes - ctx.budget
    best = min(candidates, key=lambda p: score(p, ctx))
    # full recomputation of only as many blocks as the budget needs, where the stack can
    return fewest_layers(_local_search(best, ctx, names), ctx)


def refine_remat(plan: Plan, ctx: PlanContext) -> Plan:
    """The winning plan's recompute set, improved by local search with two-for-one moves too.

    Two small tensors that each free too little can be worth one larger one, and one tensor can
    be worth two that free memory only together (outputs of one op), changes no single drop, add
    or swap makes without breaking the budget or adding time on the way. There are (pairs in the
    set) x (names outside it) and (set) x (pairs outside it) of them, so they are tried on the
    winner only, not on every combination. A winner that does not fit, or that recomputes tensors
    outside the search's candidates (a warm start's), is returned as it is."""
    names = saved_names(ctx)
    if not plan.remat.recompute or plan.remat.per_stage is not None:
        return plan
    if not plan.remat.recompute <= set(names) or score(plan, ctx)[0] != 0:
        return plan
    t0 = ctx.price(with_remat(plan, frozenset(), ctx)).step_time_s
    solo = {n: max(0.0, e.step_time_s - t0) for n, e in _each_alone(plan, ctx, names).items()}
    return _local_search(plan, ctx, names, solo)


def _each_alone(plan: Plan, ctx: PlanContext, names: tuple[str, ...]) -> dict[str, Estimate]:
    """``plan`` priced with each of ``names`` the only tensor recomputed."""
    return {n: ctx.price(with_remat(plan, frozenset({n}), ctx)) for n in names}


def _local_search(
    plan: Plan, ctx: PlanContext, names: tuple[str, ...], solo: dict[str, float] | None = None
) -> Plan:
    """Drop-one, add-one and swap-one moves (and, with ``solo``, two-for-one and one-for-two) on
    the recompute set while they improve the true score.

    Ties in score go to the smaller recompute set, so a drop that costs nothing is taken: tensors
    one op produces together (a norm's mean and rstd) are only freed of their recompute when both
    are dropped, and the first drop alone leaves the time unchanged (a plateau a strict descent
    would stop on). Every accepted move lowers (score, set size), so the search terminates.

    With ``solo`` (each tensor's recompute seconds on its own) two-for-one moves are tried too,
    only those whose added tensor costs no more than the two it replaces (recompute time is close
    to additive, and a move that adds time cannot lower the score of a plan that already fits),
    and one-for-two moves.
    """

    def key_of(p: Plan) -> tuple[int, float, int]:
        return (*score(p, ctx), len(p.remat.recompute))

    def moves(cur: Plan) -> Iterator[Plan]:
        s = cur.remat.recompute
        # sorted: a frozenset of names iterates in hash order, which varies between processes,
        # and first-improvement descent would then reach different plans on different runs
        members = sorted(s)
        outside = [n for n in names if n not in s]
        sets = [s - {n} for n in members] + [s | {n} for n in outside]
        sets += [(s - {a}) | {b} for a in members for b in outside]
        # two for one: two small tensors that each free too little may be worth one larger one
        # (a 1-move cannot cross: dropping either alone breaks the budget, adding the larger one
        # first costs time)
        if solo is not None:
            sets += [
                (s - {a, b}) | {c}
                for a, b in itertools.combinations(members, 2)
                for c in outside
                if solo[c] <= (solo[a] + solo[b]) * (1 + 1e-9)
            ]
            # one for two: outputs of one op (attention's output and its logsumexp, a norm's
            # mean and rstd) free their memory only together, so one may pay for both only
            # when both are added at once; no time filter (each one's solo time holds the op)
            sets += [(s - {a}) | {b, c} for a in members for b, c in itertools.combinations(outside, 2)]
        return (with_remat(cur, frozenset(m), ctx) for m in sets)

    return _descend(plan, key_of, moves)


def _descend(
    plan: Plan,
    key_of: Callable[[Plan], tuple[int, float, int]],
    moves: Callable[[Plan], Iterable[Plan]],
    accept: Callable[[Plan], bool] = lambda p: True,
) -> Plan:
    """First-improvement descent: the first of ``moves(cur)`` (built lazily, in order) with a
    lower key that ``accept`` takes replaces ``cur``, until none does. Each step lowers the key,
    so it terminates."""
    cur, key = plan, key_of(plan)
    improved = True
    while improved:
        improved = False
        for p in moves(cur):
            k = key_of(p)
            if k < key and accept(p):
                cur, key, improved = p, k, True
                break
    return cur


def refine_precision(plan: Plan, ctx: PlanContext) -> Plan:
    """Per-op precision: one op's dtype changed at a time (``passes.precision.op_moves``: an op of
    autocast's fp32 list in fp32 or fused, the loss path in 16 bits where the tolerance allows),
    first improvement by the true score, while any move improves it. The variants the search
    started from set every such op alike; a cast a generated kernel absorbs, or an fp32 output a
    GEMM must re-read, makes the best choice differ from op to op."""
    from coplan.plan.checker import is_valid

    if ctx.inductor is None or plan.fusion.label == "megatron":
        # per-op dtypes are what coplan's runner applies (autocast-style overrides); a stack's
        # own kernels (Megatron's fused norms and cross-entropy) fix their dtypes themselves
        return plan

    def key_of(p: Plan) -> tuple[int, float, int]:
        return (*score(p, ctx), len(p.precision.ops))

    def moves(cur: Plan) -> Iterator[Plan]:
        return (cur.with_(precision=prec) for prec in op_moves(ctx, cur.precision))

    return _descend(plan, key_of, moves, lambda p: is_valid(p, ctx))


def rebalance_stages(plan: Plan, ctx: PlanContext) -> Plan:
    """Move layers between neighbouring pipeline stages while the true score improves.

    An even split is rarely balanced: the first stage also runs the embedding and holds the most
    microbatches in flight, the last runs the LM head and loss. Moves of one layer between
    neighbours (each stage keeps at least one) are tried until none improves (ties are refused,
    so the search terminates).
    """
    par = plan.parallel
    if par.pp == 1 or par.vpp > 1:
        return plan
    n = ctx.reference_profile.n_layers
    layers = list(par.stage_layers or [n // par.pp + (1 if i < n % par.pp else 0) for i in range(par.pp)])
    best, key = plan, score(plan, ctx)
    improved = True
    while improved:
        improved = False
        for i in range(par.pp):
            for j in (i - 1, i + 1):
                if not 0 <= j < par.pp or layers[i] <= 1:
                    continue
                trial = list(layers)
                trial[i] -= 1
                trial[j] += 1
                p = plan.with_(parallel=replace(par, stage_layers=tuple(trial)))
                k = score(p, ctx)
                if k < key:
                    best, key, layers, improved = p, k, trial, True
                    break
            if improved:
                break
    return best


def per_stage_remat(plan: Plan, ctx: PlanContext) -> Plan:
    """Let pipeline stages recompute less than the most loaded one.

    Stage ``i`` of a 1F1B pipeline holds ``pp - i`` microbatches in flight, so the set that makes
    the first stage fit over-recomputes on later ones; the last stage, which also runs the LM head
    and loss, often paces the pipeline. Starting from the shared set, tensors are dropped from one
    stage's set while the true score improves (ties to fewer recomputed tensors).
    """
    pp = plan.parallel.pp
    shared = plan.remat.recompute
    if pp == 1 or not shared or plan.remat.per_stage is not None or not ctx.stack.recompute_sets:
        return plan  # a stack running only its checkpointing policies applies one to every stage

    def build(sets: list[frozenset[str]]) -> Plan:
        if all(x == sets[0] for x in sets):
            return with_remat(plan, sets[0], ctx)
        p = with_remat(plan, frozenset().union(*sets), ctx)
        return p.with_(remat=RematPlan(per_stage=tuple(sets)))

    def key_of(p: Plan) -> tuple[int, float, int]:
        return (*score(p, ctx), sum(len(x) for x in (p.remat.per_stage or (p.remat.recompute,))))

    sets = [shared] * pp
    best, key = plan, key_of(plan)
    improved = True
    while improved:
        improved = False
        for s in range(pp - 1, -1, -1):
            for n in sorted(sets[s]):
                trial = list(sets)
                trial[s] = sets[s] - {n}
                p = build(trial)
                k = key_of(p)
                if k < key:
                    best, key, sets, improved = p, k, trial, True
                    break
    return best


@strategy("joint")
def joint(ctx: PlanContext, opts: Options) -> tuple[Plan, list[PassRecord], list[str]]:
    base = opts.base if opts.base is not None else ctx.default_plan()
    fixed = opts.space.fixed
    combos = opts.space.plans(ctx, base)
    # a fixed recompute set is already applied by the space: each combination is complete, and
    # its price is exact (so the bound search stays exact)
    solved: dict[tuple[object, ...], float] = {}

    def solve(p: Plan) -> Plan:
        q = p if "remat" in fixed else optimise_remat(p, ctx)
        solved[(p.parallel, p.precision, p.fusion.label)] = (
            score(q, ctx)[1] if ctx.fits(ctx.price(q)) else 0.0
        )
        return q

    best, explored = bound_search(ctx, combos, solve, "joint", opts.progress, opts.warm)
    exact = 0
    if best is not None:
        # per-op fusion and recomputation, solved exactly (``exact.py``) for every layout and
        # precision whose bound is within reach of the plan found so far
        best, exact = _op_level(ctx, opts, base, best, solved)
    if best is not None and "remat" not in fixed:
        best = refine_remat(best, ctx)
    if best is not None and "precision" not in fixed:
        best = refine_precision(best, ctx)
    if best is not None and opts.space.stages:
        if "parallel" not in fixed:  # the layer split is a parallel decision
            best = rebalance_stages(best, ctx)
        if "remat" not in fixed:
            best = per_stage_remat(best, ctx)
    if best is None:
        # no layout of the space is possible for this job (nor a warm start): report the default
        # plan, which run_strategy prices, so the job's error (ConfigError) is what the user sees,
        # as with every other strategy
        best = base
    notes = [
        f"{len(combos):,} layout x precision x fusion combinations, {explored} solved inside (bound-pruned)"
    ]
    if exact:
        notes.append(f"{exact} solved per op exactly (joint-exact's block model)")
    if opts.warm:
        notes.append(f"warm-started from {len(opts.warm)} plans")
    return best, [], notes


def _op_level(
    ctx: PlanContext, opts: Options, base: Plan, best: Plan, solved: dict[tuple[object, ...], float]
) -> tuple[Plan, int]:
    """``best`` or a better plan from the per-op space: the exact block model (``exact.py``) on
    the layouts and precisions of the space whose bound can still beat ``best``. A combination
    already solved with the widest fusion option (``solved``: its fitting step time) is bounded by
    that time less the margin the per-op space may gain, else by its price with nothing
    recomputed. Returns the plan and how many were solved (0 where the stack runs no plan-chosen
    kernels)."""
    from coplan.search.exact import exact_search, op_level

    op, anchors = op_level(ctx, opts)
    if not op or not opts.space.per_op:
        return best, 0
    # the precision variants only: joint's local search moves single ops' dtypes afterwards, and
    # every block assignment would double the block models solved for what measured no gain
    # (joint-exact enumerates them, ``passes.precision.block_assignments``)
    found, _, n = exact_search(ctx, opts, base, anchors, "joint", [best], solved, per_op_dtypes=False)
    return (found if found is not None else best), n
