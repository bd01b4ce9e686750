"""Planning contexts and lookups shared by the plan and pass tests: tiny models on two H100s,
planned over every option the cost model prices (the ``open`` stack)."""

from __future__ import annotations

from coplan.cost import CostModel, load_stack
from coplan.hardware import load_cluster
from coplan.hardware.cluster import ClusterSpec
from coplan.ir.types import Phase
from coplan.models.spec import PRESETS, ModelSpec
from coplan.plan import (
    Numerics,
    Plan,
    PlanContext,
    check,
)

OPEN = load_stack("open")

TINY = ("gpt-tiny", "llama-tiny", "moe-tiny")


def make_ctx(
    model: str | ModelSpec = "gpt-tiny",
    cluster: str | ClusterSpec = "dgx-h100",
    gpus: int = 2,
    *,
    global_batch: int = 8,
    seq: int = 64,
    budget_bytes: float | None = None,
    numerics: Numerics | None = None,
) -> PlanContext:
    spec = PRESETS[model] if isinstance(model, str) else model
    hw = load_cluster(cluster, gpus) if isinstance(cluster, str) else cluster
    return PlanContext(
        CostModel(spec=spec),
        hw,
        global_batch=global_batch,
        seq=seq,
        budget_bytes=budget_bytes,
        numerics=numerics or Numerics(),
        stack=OPEN,  # the planner's machinery over every option it prices
    )


def producer(ctx: PlanContext, tensor: str, phase: Phase = Phase.FORWARD) -> str:
    """The name of the op of ``phase`` that writes ``tensor``."""
    graph = ctx.index.graph
    for op in ctx.index.op_by_name.values():
        if op.phase is phase and any(graph.tensors[t].name == tensor for t in op.outputs):
            return op.name
    raise AssertionError(f"no {phase.value} op writes {tensor!r}")


def messages(plan: Plan, ctx: PlanContext, rule: str) -> list[str]:
    return [v.message for v in check(plan, ctx, memory=False) if v.rule == rule]
