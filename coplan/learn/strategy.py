"""The learned strategies, registered with the others (``search.strategies``): ``learned`` and
``learned-greedy`` (``decode.py``), and ``learned-search``, the policy's plan improved by the
local search it guides (``distill.improve``, at most ``distill.SEARCH_S`` seconds). Importing this
module registers them; the CLI does."""

from __future__ import annotations

from coplan.learn.decode import LEARNED_K, default_policy, plan_with_policy
from coplan.passes.base import PassRecord
from coplan.plan.context import PlanContext
from coplan.plan.types import Plan
from coplan.search.strategies import Options, strategy


def _run(ctx: PlanContext, opts: Options, k: int) -> tuple[Plan, list[PassRecord], list[str]]:
    net = default_policy(opts.policy)
    plan, _, notes = plan_with_policy(ctx, net, k)
    return plan, [], notes


@strategy("learned")
def learned(ctx: PlanContext, opts: Options) -> tuple[Plan, list[PassRecord], list[str]]:
    return _run(ctx, opts, LEARNED_K)


@strategy("learned-greedy")
def learned_greedy(ctx: PlanContext, opts: Options) -> tuple[Plan, list[PassRecord], list[str]]:
    return _run(ctx, opts, 1)


@strategy("learned-search")
def learned_search(ctx: PlanContext, opts: Options) -> tuple[Plan, list[PassRecord], list[str]]:
    from coplan.learn.distill import SEARCH_S, improve

    got = improve(ctx, default_policy(opts.policy), LEARNED_K, SEARCH_S)
    note = (
        f"policy-guided search: {got.priced} plans priced, {got.steps} moves, "
        f"{got.gain:.3f}x the policy's own plan"
    )
    return got.plan, [], [note]
