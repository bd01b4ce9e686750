"""One signature for every decision pass, and one runner that times, logs and fingerprints them.

A pass is ``(graph, plan, ctx) -> plan``: it changes only its own decision space and treats the
others as fixed. The runner records, per pass, the plan fingerprint and the priced step time and
peak memory before and after, and can disable passes by name.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from coplan.errors import CoplanError
from coplan.ir.types import Graph
from coplan.plan.context import PlanContext
from coplan.plan.types import Plan

log = logging.getLogger("coplan.passes")

Pass = Callable[[Graph, Plan, PlanContext], Plan]
PASSES: dict[str, Pass] = {}
#: the order the literature describes a compiler stack deciding in
DEFAULT_ORDER: tuple[str, ...] = ("fusion", "remat", "parallel", "precision")


def register(name: str) -> Callable[[Pass], Pass]:
    def deco(fn: Pass) -> Pass:
        if name in PASSES:
            raise ValueError(f"pass {name!r} registered twice")
        PASSES[name] = fn
        return fn

    return deco


@dataclass(frozen=True, slots=True)
class PassRecord:
    name: str
    seconds: float
    before: str  # plan fingerprints
    after: str
    step_before_s: float
    step_after_s: float
    peak_before_bytes: float
    peak_after_bytes: float

    @property
    def changed(self) -> bool:
        return self.before != self.after

    def to_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "seconds": self.seconds,
            "before": self.before,
            "after": self.after,
            "changed": self.changed,
            "step_before_s": self.step_before_s,
            "step_after_s": self.step_after_s,
            "peak_before_bytes": self.peak_before_bytes,
            "peak_after_bytes": self.peak_after_bytes,
        }


def _price(plan: Plan, ctx: PlanContext) -> tuple[float, float]:
    try:
        est = ctx.price(plan)
    except CoplanError:  # a default plan may not be priceable (divisibility); record as unknown
        return float("nan"), float("nan")
    return est.step_time_s, est.memory.peak_bytes


def run_passes(
    plan: Plan, ctx: PlanContext, order: Sequence[str] = DEFAULT_ORDER, disable: Iterable[str] = ()
) -> tuple[Plan, list[PassRecord]]:
    """Apply the named passes in ``order`` (skipping ``disable``); returns the plan and a record
    per pass that ran."""
    off = set(disable)
    unknown = [n for n in (*order, *off) if n not in PASSES]
    if unknown:
        raise ValueError(f"unknown pass {unknown[0]!r}; passes: {', '.join(PASSES)}")
    graph = ctx.index.graph
    records = []
    for name in order:
        if name in off:
            log.info("pass %s disabled", name)
            continue
        step0, peak0 = _price(plan, ctx)
        t0 = time.perf_counter()
        new = PASSES[name](graph, plan, ctx)
        dt = time.perf_counter() - t0
        step1, peak1 = _price(new, ctx)
        rec = PassRecord(name, dt, plan.fingerprint, new.fingerprint, step0, step1, peak0, peak1)
        log.info("pass %s: %.3fs %s -> %s step %.4g -> %.4g s", name, dt, rec.before, rec.after, step0, step1)
        records.append(rec)
        plan = new
    return plan, records


def score(plan: Plan, ctx: PlanContext) -> tuple[int, float]:
    """Order plans: every fitting plan before every non-fitting one; fitting plans by step time,
    the rest by peak memory (the closest to fitting first). Unpriceable plans sort last."""
    try:
        est = ctx.price(plan)
    except CoplanError:
        return (2, float("inf"))
    if ctx.fits(est):
        return (0, est.step_time_s)
    return (1, est.memory.peak_bytes)


def choose(plans: Iterable[Plan], ctx: PlanContext) -> Plan | None:
    """The best of ``plans`` by ``score`` (None for an empty iterable)."""
    best: Plan | None = None
    best_key = (3, 0.0)
    for p in plans:
        k = score(p, ctx)
        if k < best_key:
            best, best_key = p, k
    return best
