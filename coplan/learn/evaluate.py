"""The verdict on Claim 2 for one split of a dataset (``coplan learn eval``).

Every job of the split is planned by the policy (``learned``: its best-scored layouts decoded,
repaired, checked and priced) and compared, by the cost model's step time, with the labels the
dataset holds for it: the teacher (``joint-exact``, the op-level joint optimum) and the baseline
(``sequential``, the production passes in sequence), both planned when the dataset was written and
checked and priced again here, by today's checker and cost model (``_repriced``), so every ratio
compares prices of one cost model; a label plan the checker now refuses counts as not fitting.
Ratios are learned / other step time (0.95: the learned plan is 5% faster), over the jobs where
both plans fit. ``feasible_rate`` is the share of the jobs with a fitting teacher plan whose
learned plan is valid and fits. Planning times are medians (the labels' were measured when the
dataset was written, on the machine that wrote it).

``vs_random`` compares with random search plus local search given, job by job, the wall-clock
time the learned strategy took (``randsearch.random_local_search``); a job where only one of the
two fits counts as a win or a loss.

The verdict is ``validated`` when the learned plans beat the baseline at the median (ratio below
1) and win more jobs than they lose; otherwise ``killed`` (Claim 2 is killed if the policy cannot
beat sequential optimization even on its training data, so the train split is the kill test).

``fusion_remat`` is Claim 2 on its narrowest pair: fusion and recomputation alone, the parallel
layout and the precision fixed at the baseline's (what the production parallel and precision
passes chose) for both sides. The production side runs the fusion pass and then the remat pass
under that layout (``_fusion_remat``); the policy's side is its per-op heads decoded for that
layout, as ``learned`` decodes each of its layouts, repaired to fit. Ratios, wins and losses as
above, over the jobs where both fit.

``cost_model`` reports the learned cost model the policy file carries against the analytic one,
on the teacher's, the baseline's and ``COST_PLANS`` random plans of each job (Kendall tau, top-1
regret, mean absolute percentage error: ``costnet.rank_report``); nulls where it carries none.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from coplan.learn.dataset import Dataset
from coplan.learn.decode import LEARNED_K, plan_with_policy
from coplan.learn.jobs import Job
from coplan.learn.policy import PolicyNet
from coplan.learn.randsearch import random_local_search

__all__ = ["evaluate"]

#: ratios within this of 1 are ties (neither a win nor a loss)
TIE = 1e-3


def _quantile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


#: random plans per job, besides the teacher's and the baseline's, the learned cost model ranks
COST_PLANS = 6


def _cost_model(net: PolicyNet, records: list[dict[str, Any]], per_job: int) -> dict[str, float | None]:
    """The learned cost model against the analytic one on plans sampled around the split's jobs
    (``costnet.rank_report``); nulls where the policy file carries none."""
    from coplan.learn.costnet import CostNet, rank_report
    from coplan.learn.samples import cost_examples

    if not isinstance(net.cost, CostNet) or not records:
        return {"kendall_tau": None, "top1_regret": None, "mape": None}
    return rank_report(net.cost, cost_examples(records, per_job, seed=1))


def _repriced(label: dict[str, Any], ctx: Any) -> dict[str, Any]:
    """``label`` with its plan checked and priced by today's checker and cost model: ``fits`` and
    ``step_time_s`` as they are now (a plan refused counts as not fitting)."""
    from coplan.errors import CoplanError
    from coplan.plan.checker import check
    from coplan.plan.types import Plan

    try:
        plan = Plan.from_dict(label["plan"], "label")
        if check(plan, ctx):
            return {**label, "fits": False}
        est = ctx.price(plan)
    except CoplanError:
        return {**label, "fits": False}
    return {**label, "fits": ctx.fits(est), "step_time_s": est.step_time_s}


def _fusion_remat(ctx: Any, net: PolicyNet, fixed: Any, k: int) -> tuple[Any, Any] | None:
    """(the production passes' plan, the policy's plan) deciding fusion and recomputation alone,
    the layout and precision fixed at ``fixed``'s; None where ``fixed``'s layout cannot be priced."""
    import torch

    from coplan.errors import CoplanError
    from coplan.learn.decode import _anchors, layout_plan, repair
    from coplan.learn.features import job_graph, layout_matrix
    from coplan.passes.base import run_passes, score
    from coplan.plan.checker import is_valid

    start = ctx.default_plan().with_(parallel=fixed.parallel, precision=fixed.precision)
    if not is_valid(start, ctx):
        return None
    try:
        seq, _ = run_passes(start, ctx, ("fusion", "remat"))
    except CoplanError:
        return None
    jg = job_graph(ctx, anchors=_anchors(ctx))
    cand = (fixed.parallel, fixed.precision)
    with torch.no_grad():
        enc = net.encode(jg)
        plans, names = layout_plan(ctx, net, jg, enc, layout_matrix(ctx, [cand])[0], cand, k, spread=k > 1)
    ours = [repair(p.with_(precision=fixed.precision), ctx, names) for p in plans]
    ours = [p for p in ours if is_valid(p, ctx)]
    if not ours:
        return seq, None
    return seq, min(ours, key=lambda p: score(p, ctx))


def evaluate(
    ds: Dataset,
    net: PolicyNet,
    split: str,
    *,
    k: int = LEARNED_K,
    limit: int | None = None,
    cost_plans: int = COST_PLANS,
    random_baseline: bool = True,
    progress: Callable[[int, int, str], None] | None = None,
) -> dict[str, Any]:
    from coplan.passes.base import score
    from coplan.plan.checker import check
    from coplan.plan.types import Plan

    records = [r for r in ds.records(split) if "error" not in r]
    if limit is not None:
        records = records[:limit]
    vs_seq: list[float] = []
    vs_joint: list[float] = []
    t_learned: list[float] = []
    t_joint: list[float] = []
    t_seq: list[float] = []
    feasible = 0
    possible = 0
    vs_random: list[float] = []
    random_only: list[bool] = []  # jobs where one of the two fits: whether it is random search
    per_job = []
    pair: list[float] = []  # fusion x remat alone, learned / production passes
    for i, r in enumerate(records):
        job = Job.from_dict(r["job"])
        ctx = job.context()
        t0 = time.perf_counter()
        plan, _, _ = plan_with_policy(ctx, net, k)
        dt = time.perf_counter() - t0
        est = ctx.price(plan)
        ok = not check(plan, ctx)
        if random_baseline:
            rplan, _ = random_local_search(ctx, dt, seed=i)
            rok = not check(rplan, ctx)
            if ok and rok:
                vs_random.append(est.step_time_s / ctx.price(rplan).step_time_s)
            elif ok != rok:
                random_only.append(rok)
        teacher, base = (_repriced(r["labels"][x], ctx) for x in ("teacher", "baseline"))
        t_learned.append(dt)
        t_joint.append(teacher["plan_time_s"])
        t_seq.append(base["plan_time_s"])
        if teacher["fits"]:
            possible += 1
            feasible += ok
        if ok and base["fits"]:
            vs_seq.append(est.step_time_s / base["step_time_s"])
        if ok and teacher["fits"]:
            vs_joint.append(est.step_time_s / teacher["step_time_s"])
        pair_ratio = None
        if base["fits"]:
            got = _fusion_remat(ctx, net, Plan.from_dict(base["plan"], "label"), k)
            if got is not None and got[1] is not None:
                seq_est, own_est = ctx.price(got[0]), ctx.price(got[1])
                if ctx.fits(seq_est) and ctx.fits(own_est) and not check(got[1], ctx):
                    pair_ratio = own_est.step_time_s / seq_est.step_time_s
                    pair.append(pair_ratio)
        per_job.append(
            {
                "id": r["id"],
                "family": job.family,
                "stack": job.stack,
                "learned_step_s": est.step_time_s,
                "fits": ok,
                "teacher_step_s": teacher["step_time_s"],
                "baseline_step_s": base["step_time_s"],
                "score": list(score(plan, ctx)),
                "fusion_remat_ratio": pair_ratio,
            }
        )
        if progress:
            progress(i + 1, len(records), f"{job.spec.name} on {job.cluster.name}")
    wins = sum(1 for x in vs_seq if x < 1 - TIE)
    losses = sum(1 for x in vs_seq if x > 1 + TIE)
    med_seq = _quantile(vs_seq, 0.5)
    verdict = "validated" if med_seq is not None and med_seq < 1.0 and wins > losses else "killed"
    return {
        "split": split,
        "n": len(records),
        "vs_sequential": {
            "median_ratio": med_seq,
            "p10_ratio": _quantile(vs_seq, 0.1),
            "wins": wins,
            "losses": losses,
        },
        "vs_joint": {"median_ratio": _quantile(vs_joint, 0.5), "p90_ratio": _quantile(vs_joint, 0.9)},
        "fusion_remat": {
            "n": len(pair),
            "median_ratio": _quantile(pair, 0.5),
            "p10_ratio": _quantile(pair, 0.1),
            "wins": sum(1 for x in pair if x < 1 - TIE),
            "losses": sum(1 for x in pair if x > 1 + TIE),
        },
        "vs_random": {
            "median_ratio": _quantile(vs_random, 0.5),
            "wins": sum(1 for x in vs_random if x < 1 - TIE) + sum(1 for r in random_only if not r),
            "losses": sum(1 for x in vs_random if x > 1 + TIE) + sum(1 for r in random_only if r),
        }
        if random_baseline
        else None,
        "feasible_rate": feasible / possible if possible else None,
        "plan_time_s": {
            "learned": statistics.median(t_learned) if t_learned else None,
            "joint": statistics.median(t_joint) if t_joint else None,
            "sequential": statistics.median(t_seq) if t_seq else None,
        },
        "cost_model": _cost_model(net, records, cost_plans),
        "verdict": verdict,
        "jobs": per_job,
    }
