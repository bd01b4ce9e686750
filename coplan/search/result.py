"""One result type for every strategy, so baselines and optimizers compare on equal terms."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from coplan.cost import Estimate
from coplan.passes.base import PassRecord
from coplan.plan.checker import Violation
from coplan.plan.context import Decisions
from coplan.plan.types import Plan


@dataclass(frozen=True, slots=True)
class Point:
    """One plan a strategy priced: for the memory-vs-time plot, whose hover text says from
    ``decisions`` which plan a point is (None where a caller did not keep them)."""

    step_time_s: float
    peak_bytes: float
    fits: bool
    decisions: Decisions | None = None


@dataclass(frozen=True, slots=True)
class StrategyResult:
    """What a strategy decided, as priced and checked by coplan itself.

    ``plan`` is the best plan found (fitting if any fitting plan was found, else the one closest
    to fitting); ``violations`` are the checker's findings on it (empty for a valid fitting plan).
    """

    strategy: str
    plan: Plan
    estimate: Estimate
    violations: tuple[Violation, ...]
    plan_time_s: float
    evaluations: int
    considered: tuple[Point, ...] = ()
    passes: tuple[PassRecord, ...] = ()
    notes: tuple[str, ...] = field(default=())

    @property
    def fits(self) -> bool:
        return not self.violations

    @property
    def step_time_s(self) -> float:
        return self.estimate.step_time_s

    def to_dict(self) -> dict[str, Any]:
        e = self.estimate
        return {
            "step_time_s": e.step_time_s,
            "tokens_per_s": e.tokens_per_s,
            "mfu": e.mfu,
            "mfu_dtype_peak": e.mfu_dtype_peak,
            "peak_bytes": e.memory.peak_bytes,
            "fits": self.fits,
            "plan_time_s": self.plan_time_s,
            "evaluations": self.evaluations,
            "violations": [str(v) for v in self.violations],
            "passes": [r.to_dict() for r in self.passes],
            "notes": list(self.notes),
            "plan": self.plan.to_dict(),
        }
