"""Plans: the four decisions (fusion, remat, parallelism, precision) as one checked value."""

from coplan.plan.checker import Violation, check, is_valid
from coplan.plan.context import GiB, Numerics, PlanContext, default_budget, plan_summary
from coplan.plan.types import FusionPlan, ParallelPlan, Plan, PlanError, PrecisionPlan, RematPlan

__all__ = [
    "FusionPlan",
    "GiB",
    "Numerics",
    "ParallelPlan",
    "Plan",
    "PlanContext",
    "PlanError",
    "PrecisionPlan",
    "RematPlan",
    "Violation",
    "check",
    "default_budget",
    "is_valid",
    "plan_summary",
]
