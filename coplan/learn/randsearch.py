"""Random search plus local search under a wall-clock budget: the cheap baseline a learned
planner must beat given the same time (Baechi's lesson: compare a learned planner with simple
algorithms at equal planning time, not only with the expensive search it imitates).

Until half the budget is spent, random valid plans (``costnet.sample_plans``: a random layout of
the space, random kernels, a random recompute set), each repaired to fit by recomputing more
(``decode.repair``); then, until the budget ends, first-improvement moves on the best plan's
recompute set (add or drop one saved tensor), accepted when the true score improves. Every plan
is checked and priced by coplan.
"""

from __future__ import annotations

import random
import time
from typing import Any

from coplan.plan.types import Plan

__all__ = ["random_local_search"]


def random_local_search(ctx: Any, seconds: float, seed: int = 0) -> tuple[Plan, int]:
    """The best plan found in ``seconds`` (at least one sample): (plan, plans priced)."""
    from coplan.learn.decode import repair
    from coplan.learn.samples import sample_plans
    from coplan.passes.base import score
    from coplan.passes.remat import saved_names, with_remat
    from coplan.plan.checker import is_valid

    rng = random.Random(seed)
    t0 = time.perf_counter()
    names = list(saved_names(ctx))
    best: Plan | None = None
    key: tuple[Any, ...] | None = None
    priced = 0
    while best is None or time.perf_counter() - t0 < seconds / 2:
        got = sample_plans(ctx, [], 1, rng)
        if not got:
            if best is None and time.perf_counter() - t0 > seconds:
                break
            continue
        order = list(names)
        rng.shuffle(order)
        p = repair(got[0], ctx, order)
        priced += 1
        k = score(p, ctx)
        if key is None or k < key:
            best, key = p, k
    if best is None:
        return ctx.default_plan(), priced
    improved = True
    while improved and time.perf_counter() - t0 < seconds:
        improved = False
        have = set(best.remat.all_names)
        moves = list(names)
        rng.shuffle(moves)
        for n in moves:
            if time.perf_counter() - t0 >= seconds:
                break
            trial = with_remat(best, frozenset(have ^ {n}), ctx)
            if not is_valid(trial, ctx):
                continue
            priced += 1
            k = score(trial, ctx)
            if key is not None and k < key:
                best, key, improved = trial, k, True
                break
    return best, priced
