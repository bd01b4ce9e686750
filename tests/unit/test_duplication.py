"""Producer duplication (``FusionPlan.duplicated``, XLA-style): the plan format (version 2, version
1 still read), the exact cost of a copy (its arithmetic again in every reader's kernel, its inputs
read there, its output written only by its home kernel and only where kept), the checker's rules
and the XLA-style fusion pass."""

from __future__ import annotations

import json

import pytest

from coplan.cost import CostModel, load_stack
from coplan.cost.fusion import readers
from coplan.cost.profile import _Ctx, profile_graph
from coplan.hardware import load_cluster
from coplan.models.spec import PRESETS
from coplan.plan import PlanContext, check
from coplan.plan.types import PLAN_VERSION, FusionPlan, Plan, PlanError
from coplan.search import Options, run_strategy
from coplan.search.space import fusion_option


def ctx_for(stack: str = "xla") -> PlanContext:
    return PlanContext(
        CostModel(spec=PRESETS["gpt-tiny"]), load_cluster("dgx-h100", 1), 8, 64, stack=load_stack(stack)
    )


def ids(ctx: PlanContext, *names: str) -> tuple[int, ...]:
    return tuple(ctx.index.op_by_name[n].id for n in names)


def residual(ctx: PlanContext) -> tuple[str, str, str]:
    """The first block's attention residual add and its two forward readers (norm, next add)."""
    g = ctx.index.graph
    add = next(op for op in ctx.index.block_ops[0] if op.target.endswith("add"))
    rs = sorted(r for r in readers(g, add.outputs[0]) if g.ops[r].phase is add.phase)
    assert len(rs) == 2
    return add.name, g.ops[rs[0]].name, g.ops[rs[1]].name


def kernel_with(prof, *op_ids: int):
    part = prof.templates[0]
    return next(k for k in part.forward if set(op_ids) <= set(k.ops))


def test_a_copy_pays_its_arithmetic_and_inputs_and_writes_only_what_is_kept():
    ctx = ctx_for()
    g = ctx.index.graph
    add, norm, nxt = residual(ctx)
    a, n, x = ids(ctx, add, norm, nxt)
    fused = profile_graph(g, ((a, n),))
    copied = profile_graph(g, ((n, a), (x, a)))
    h = g.tensors[g.ops[a].outputs[0]]
    assert h.saved_for_backward  # kept for the norm's backward: the home kernel still writes it
    home_f, home_c = kernel_with(fused, a, n), kernel_with(copied, a, n)
    assert home_c.bytes == home_f.bytes and home_c.vec_flops == home_f.vec_flops
    alone, copy = kernel_with(fused, x), kernel_with(copied, x, a)
    vec = _Ctx(g).vec
    expect = list(alone.bytes)
    for tid in g.ops[a].inputs:
        for i, v in enumerate(vec(g.tensors[tid])):
            expect[i] += v
    for i, v in enumerate(vec(h)):
        expect[i] -= v  # read from the copy, not from memory
    assert copy.bytes == pytest.approx(tuple(expect), rel=1e-12)
    assert copy.vec_flops == pytest.approx(alone.vec_flops + g.ops[a].vector_flops)
    # the step's model FLOPs count the add once however many kernels compute it
    assert copied.model_flops == fused.model_flops


def test_plan_format_round_trips_duplication_and_reads_version_1():
    ctx = ctx_for()
    add, _, _ = residual(ctx)
    plan = ctx.default_plan().with_(fusion=FusionPlan(duplicated=frozenset({add}), label="duplicate"))
    back = Plan.from_dict(json.loads(plan.to_json()))
    assert back == plan and back.fusion.duplicated == {add} and plan.version == PLAN_VERSION == 2
    plain = ctx.default_plan()
    d = json.loads(plain.to_json())
    assert "duplicated" not in d["fusion"]  # fingerprints of plans without it are unchanged
    d["version"] = 1
    assert Plan.from_dict(d) == plain
    d["version"] = 3
    with pytest.raises(PlanError, match="versions 1 and 2"):
        Plan.from_dict(d)
    with pytest.raises(PlanError, match="duplicated and in a group"):
        FusionPlan(groups=((add, "x"),), duplicated=frozenset({add}))


def test_the_checker_takes_legal_copies_and_refuses_the_rest():
    ctx = ctx_for()
    add, norm, _ = residual(ctx)
    base = ctx.default_plan()
    ok = base.with_(fusion=FusionPlan(duplicated=frozenset({add}), label="duplicate"))
    assert check(ok, ctx) == []
    bad = base.with_(fusion=FusionPlan(duplicated=frozenset({norm}), label="duplicate"))
    assert any("not a pointwise op" in v.message for v in check(bad, ctx))
    # the GELU gradient feeds both gradient GEMMs of the MLP's first linear
    feeds = next(op for op in ctx.index.block_ops[0] if op.target.endswith("gelu_bwd"))
    into_gemm = base.with_(fusion=FusionPlan(duplicated=frozenset({feeds.name}), label="duplicate"))
    assert any("prologue of library kernel" in v.message for v in check(into_gemm, ctx))
    # a stack whose compiler does not duplicate refuses any copy
    open_ctx = ctx_for("open")
    msgs = [v.message for v in check(ok, open_ctx)]
    assert any("does not duplicate" in m for m in msgs), msgs


def test_the_xla_style_pass_is_what_sequential_runs_under_the_xla_stack_and_is_checked():
    ctx = ctx_for()
    plan = ctx.default_plan().with_(fusion=fusion_option(ctx, "duplicate"))
    assert check(plan, ctx) == []
    res = run_strategy("sequential", ctx, Options())
    assert res.plan is not None and res.plan.fusion.label == "duplicate" and check(res.plan, ctx) == []


def test_decisions_count_copies_per_block():
    from coplan.plan.decisions import block_decisions

    ctx = ctx_for()
    add, _, _ = residual(ctx)
    g = ctx.index.graph
    plain = block_decisions(ctx.default_plan(), g)
    dup = ctx.default_plan().with_(fusion=FusionPlan(duplicated=frozenset({add}), label="duplicate"))
    got = block_decisions(dup, g)
    assert got["block"] == plain["block"] == 0 and plain["duplicated"] == 0
    assert got["duplicated"] == 1
    assert got["kernels"] == plain["kernels"] - 1  # the add has no kernel of its own
    assert got["fused_edges"] == plain["fused_edges"] + 2  # a copy in each of its two readers
