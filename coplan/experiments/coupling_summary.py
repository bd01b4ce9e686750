"""The study's summaries: each pair's top-level entry, the verdict on the claim's kill
criterion, the trends with model size and GPU count, and the JSON object ``coplan coupling
--json`` prints (``to_json``).

A pair's top-level entry holds its figures (``single_a``, ``single_b``, ``sequential``, ``joint``,
``interaction``, and ``a_then_b``, ``b_then_a``, ``interaction_ratio``) at the scenario where its
coupling (joint over sequential) is largest (``scenario``; among ties, the first scenario where
all five contract figures are defined, so a pair that never couples shows a complete row); a
figure whose plan does not fit there is null. It adds the mean and the largest coupling over every
scenario where coupling is defined, how many scenarios exceed the threshold, and how many are
feasibility-coupled.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

from coplan.experiments.coupling import (
    PAIR_NAMES,
    SPACES,
    THRESHOLD,
    All4Result,
    PairResult,
    ScenarioResult,
    Study,
)

#: a change of the mean coupling (joint / sequential) smaller than this is no change (0.1%)
TREND_EPS = 1e-3


def _mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _summary(
    results: Sequence[ScenarioResult],
    get: Callable[[ScenarioResult], PairResult | All4Result],
    figures: Callable[[PairResult | All4Result], dict[str, Any]],
    extras: Callable[[PairResult | All4Result], dict[str, Any]],
) -> dict[str, Any]:
    """A pair's (or all four's) top-level entry: ``figures`` (and ``extras``) at the scenario with
    the largest coupling (``scenario``; a figure whose plan does not fit there is None), plus the
    mean and max coupling over every scenario where it is defined, and counts."""
    rows = [(r, x) for r in results for x in (get(r),)]
    coupled = [(r, x, x.coupling) for r, x in rows if x.coupling is not None]

    def complete(x: PairResult | All4Result) -> bool:
        return all(v is not None for v in _flat(figures(x)))

    if coupled:
        # the largest coupling; among ties (most pairs are 1.0 in many scenarios) the first
        # scenario where every figure is defined
        r, x, c = max(coupled, key=lambda t: (t[2], complete(t[1])))
        body = figures(x) | extras(x) | {"scenario": r.scenario.id, "joint_over_sequential": c}
    else:
        body = {k: None for k in figures(rows[0][1]) | extras(rows[0][1])} if rows else {}
        body |= {"scenario": None, "joint_over_sequential": None}
    cs = [c for _, _, c in coupled]
    body |= {
        "mean_joint_over_sequential": _mean(cs),
        "max_joint_over_sequential": max(cs) if cs else None,
        "mean_interaction": _mean([i for _, x in rows if (i := x.interaction) is not None]),
        "scenarios_compared": len(cs),
        "scenarios_above_threshold": sum(c > THRESHOLD for c in cs),
        "feasibility_coupled": sum(x.feasibility_coupled for _, x in rows),
        "scenarios": len(rows),
    }
    return body


def _flat(d: dict[str, Any]) -> list[Any]:
    out: list[Any] = []
    for v in d.values():
        out.extend(_flat(v) if isinstance(v, dict) else [v])
    return out


def _pair_figures(x: PairResult | All4Result) -> dict[str, Any]:
    assert isinstance(x, PairResult)
    return {
        "single_a": x.single_a.gain,
        "single_b": x.single_b.gain,
        "sequential": x.sequential.gain,
        "joint": x.joint.gain,
        "interaction": x.interaction,
    }


def _pair_extras(x: PairResult | All4Result) -> dict[str, Any]:
    assert isinstance(x, PairResult)
    return {
        "a_then_b": x.a_then_b.gain,
        "b_then_a": x.b_then_a.gain,
        "interaction_ratio": x.interaction_ratio,
    }


def _all4_figures(x: PairResult | All4Result) -> dict[str, Any]:
    assert isinstance(x, All4Result)
    return {
        "singles": {s: o.gain for s, o in zip(SPACES, x.singles, strict=True)},
        "sequential": x.sequential.gain,
        "joint": x.joint.gain,
        "interaction": x.interaction,
    }


def _all4_extras(x: PairResult | All4Result) -> dict[str, Any]:
    assert isinstance(x, All4Result)
    return {
        "sequential_order": list(x.best_order),
        "sequential_default_order": x.default_order.gain,
        "interaction_ratio": x.interaction_ratio,
    }


def pair_summary(results: Sequence[ScenarioResult], name: str) -> dict[str, Any]:
    a, b = name.split("+")
    return {"a": a, "b": b} | _summary(results, lambda r: r.pair(name), _pair_figures, _pair_extras)


def all4_summary(results: Sequence[ScenarioResult]) -> dict[str, Any]:
    return _summary(results, lambda r: r.all4, _all4_figures, _all4_extras)


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Spearman's rank correlation (``apply.measure.spearman``), None where it is undefined: fewer
    than three points, or a constant side."""
    if len(xs) < 3 or len(set(xs)) < 2 or len(set(ys)) < 2:
        return None
    from coplan.apply.measure import spearman as rank_correlation  # imports torch: only when asked

    return rank_correlation(xs, ys)


def _direction(means: Sequence[float]) -> str:
    """The trend of the mean coupling over increasing values of an axis: ``grows`` or ``shrinks``
    when every step moves one way (steps within ``TREND_EPS`` count as level), ``flat`` when none
    moves, ``mixed`` otherwise."""
    if len(means) < 2:
        return "undefined (fewer than two values)"
    steps = [b - a for a, b in itertools.pairwise(means)]
    if all(abs(d) <= TREND_EPS for d in steps):
        return "flat"
    if all(d >= -TREND_EPS for d in steps):
        return "grows"
    if all(d <= TREND_EPS for d in steps):
        return "shrinks"
    return "mixed"


def trends(results: Sequence[ScenarioResult]) -> dict[str, Any]:
    """How the coupling (joint over sequential, every pair and scenario where it is defined)
    moves with model size (parameters) and GPU count: the mean and max coupling at each value of
    the axis, the trend of the means (``_direction``), per pair too, and Spearman's rho over all
    points (most points tie at 1.0, so rho is weak evidence; the means say more)."""
    out: dict[str, Any] = {}
    axes = (("model_size", lambda r: float(r.params)), ("gpus", lambda r: float(r.scenario.gpus)))
    for axis, key in axes:
        pts = [(key(r), p.name, c) for r in results for p in r.pairs if (c := p.coupling) is not None]

        def means(sub: Sequence[tuple[float, float]]) -> dict[float, list[float]]:
            by: dict[float, list[float]] = {}
            for x, c in sorted(sub):
                by.setdefault(x, []).append(c)
            return by

        per_pair = {}
        for name in PAIR_NAMES:
            by = means([(x, c) for x, n, c in pts if n == name])
            per_pair[name] = {
                "trend": _direction([sum(v) / len(v) for v in by.values()]),
                "max_by_value": {f"{x:.4g}": max(v) for x, v in by.items()},
            }
        by = means([(x, c) for x, _, c in pts])
        out[axis] = {
            "trend": _direction([sum(v) / len(v) for v in by.values()]),
            "rho": spearman([x for x, _, _ in pts], [c for _, _, c in pts]),
            "by_value": {
                f"{x:.4g}": {"mean": sum(v) / len(v), "max": max(v), "points": len(v)} for x, v in by.items()
            },
            "pairs": per_pair,
        }
    return out


def verdict(results: Sequence[ScenarioResult]) -> dict[str, Any]:
    """The kill criterion on pairs (see the module doc), and the pairs ranked by their largest
    coupling (mean coupling, then mean interaction, break ties)."""
    best = None
    for r in results:
        for p in r.pairs:
            c = p.coupling
            if c is not None and (best is None or c > best[0]):
                best = (c, p.name, r.scenario.id)
    feas = [(p.name, r.scenario.id) for r in results for p in r.pairs if p.feasibility_coupled]
    ranking = []
    for name in PAIR_NAMES:
        s = pair_summary(results, name)
        ranking.append(
            {
                "pair": name,
                "max_joint_over_sequential": s["max_joint_over_sequential"],
                "mean_joint_over_sequential": s["mean_joint_over_sequential"],
                "mean_interaction": s["mean_interaction"],
                "scenarios_above_threshold": s["scenarios_above_threshold"],
                "feasibility_coupled": s["feasibility_coupled"],
            }
        )
    ranking.sort(
        key=lambda d: (
            -(d["max_joint_over_sequential"] or 0.0),
            -(d["mean_joint_over_sequential"] or 0.0),
            -abs(d["mean_interaction"] or 0.0),
        )
    )
    validated = best is not None and best[0] > THRESHOLD
    return {
        "verdict": "validated" if validated else "killed",
        "criterion": f"validated when joint / sequential > {THRESHOLD} for some pair in some scenario "
        "(both plans fitting); killed otherwise",
        "threshold": THRESHOLD,
        "max_joint_over_sequential": best[0] if best else None,
        "max_pair": best[1] if best else None,
        "max_scenario": best[2] if best else None,
        "feasibility_coupled": [{"pair": n, "scenario": s} for n, s in feas],
        "ranking": ranking,
    }


def to_json(study: Study) -> dict[str, Any]:
    """The object ``coplan coupling --json`` prints (the CLI contract's keys first). A study
    stopped early (``partial``) is summarised over the scenarios that finished; its verdict is
    ``conclusive`` only when it is ``validated`` (a pair found above the threshold stays there;
    the unplanned scenarios could still validate a ``killed`` one)."""
    res = study.scenarios
    v = verdict(res)
    v["conclusive"] = not study.partial or v["verdict"] == "validated"
    return {
        "pairs": {name: pair_summary(res, name) for name in PAIR_NAMES},
        "all4": all4_summary(res),
        "verdict": v["verdict"],
        "scenarios": [r.to_dict() for r in res],
        "verdict_detail": v,
        "trends": trends(res),
        "grid": study.grid,
        "granularity": study.granularity,
        "defaults": study.defaults.describe(),
        "threshold": THRESHOLD,
        "plans_checked": sum(r.plans_checked for r in res),
        "invalid_plans": sum(len(r.invalid_plans) for r in res),
        "seconds": study.seconds,
        "source": "coplan cost model (simulated); every plan checked by coplan.plan.checker",
        "partial": study.partial,
        "scenarios_total": len(res) if study.total is None else study.total,
    }
