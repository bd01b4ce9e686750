"""The precision pass: AMP-style rules, with the other decisions fixed.

As ``torch.autocast`` does: matmul-class ops run in bf16 where the device has bf16 units, else in
fp16 with dynamic loss scaling, else fp32; numerically sensitive ops (softmax, norms, loss,
reductions, the optimizer update, gradient accumulation and all-reduce) stay fp32, which is the
plan's default for them, and master weights stay fp32. AMP never picks fp8 (that takes a
Transformer Engine recipe), so neither does this pass.
"""

from __future__ import annotations

from coplan.ir.types import Graph
from coplan.passes.base import register
from coplan.plan.context import PlanContext
from coplan.plan.types import Plan, PrecisionPlan


def amp_precision(ctx: PlanContext) -> PrecisionPlan:
    native = ctx.device_dtypes
    if "bf16" in native:
        return PrecisionPlan(compute="bf16")
    if "fp16" in native:
        return PrecisionPlan(compute="fp16", loss_scaling=True)
    return PrecisionPlan(compute="fp32")


@register("precision")
def precision_pass(graph: Graph, plan: Plan, ctx: PlanContext) -> Plan:
    return plan.with_(precision=amp_precision(ctx))
