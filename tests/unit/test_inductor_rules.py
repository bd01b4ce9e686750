"""What Inductor emits, as the planner must know it: groups it refuses to fuse (``checker.
inductor_problem``), the CPU runner without GEMM epilogues (``StackSpec.runner_for``), and every
strategy's CPU plan free of both. The refusals were read off ``coplan run`` on this CPU; the
compile test that shows a refused group really splits is in the capture tier of the apply tests."""

from __future__ import annotations

from dataclasses import replace

import pytest

from coplan.cost import CostModel, load_stack
from coplan.errors import SpecError
from coplan.hardware import load_cluster
from coplan.hardware.device import DeviceSpec
from coplan.ir.types import Graph, GraphMeta, Op, OpKind, Phase, Tensor, TensorRole, relink
from coplan.models.spec import PRESETS
from coplan.plan import PlanContext, check
from coplan.plan.checker import INDUCTOR_MAX_FUSION, _written, inductor_problem
from coplan.search import Options, run_strategy


def ctx_on(cluster: str, stack: str = "coplan") -> PlanContext:
    return PlanContext(
        CostModel(spec=PRESETS["gpt-tiny"]), load_cluster(cluster, 1), 8, 64, stack=load_stack(stack)
    )


def ids(ctx: PlanContext, *names: str) -> tuple[int, ...]:
    return tuple(ctx.index.op_by_name[n].id for n in names)


def first(ctx: PlanContext, target: str) -> str:
    return next(op.name for op in ctx.index.graph.ops if op.target.removeprefix("aten.") == target)


def test_a_written_pointwise_producer_does_not_fuse_into_a_norm_on_a_cpu_only():
    ctx = ctx_on("cpu")
    g = ctx.index.graph
    # the residual add feeding the second norm: saved for backward and read by the next add
    norm = [op for op in g.ops if op.kind is OpKind.NORM and op.block == 0][1]
    add = g.ops[next(g.tensors[t].producer for t in norm.inputs if g.tensors[t].producer is not None)]
    assert add.target.endswith("add")
    pair = (add.id, norm.id)
    assert _written(g, add.outputs[0], set(pair))
    why = inductor_problem(g, pair, "cpu")
    assert why is not None and "C++ backend" in why and add.name in why
    assert inductor_problem(g, pair, "gpu") is None


def _chain(saved: bool) -> Graph:
    """x -> add -> layer_norm -> y, the add's output read by the norm alone (and, with ``saved``,
    kept for backward)."""
    ts = [
        Tensor(id=i, name=f"t{i}", shape=(16, 32), dtype="float32", role=TensorRole.ACTIVATION)
        for i in range(3)
    ]
    ts[1] = Tensor(
        id=1, name="t1", shape=(16, 32), dtype="float32", role=TensorRole.ACTIVATION, saved_for_backward=saved
    )
    ops = [
        Op(
            id=0,
            name="add",
            target="add",
            kind=OpKind.ELEMENTWISE,
            inputs=(0, 0),
            outputs=(1,),
            phase=Phase.FORWARD,
        ),
        Op(
            id=1,
            name="norm",
            target="layer_norm",
            kind=OpKind.NORM,
            inputs=(1,),
            outputs=(2,),
            phase=Phase.FORWARD,
        ),
    ]
    return relink(ops, ts, GraphMeta(), outputs=(2,))


def test_an_unwritten_pointwise_producer_fuses_into_a_reduction_on_a_cpu():
    assert inductor_problem(_chain(saved=False), (0, 1), "cpu") is None
    assert "C++ backend" in (inductor_problem(_chain(saved=True), (0, 1), "cpu") or "")
    assert inductor_problem(_chain(saved=True), (0, 1), "gpu") is None


def test_gathers_and_scatters_share_no_data_on_any_target():
    ctx = ctx_on("cpu")
    g = ctx.index.graph
    loss = next(op for op in g.ops if op.kind is OpKind.LOSS and op.phase.value == "forward")
    src = g.tensors[loss.inputs[0]].producer
    for target in ("cpu", "gpu"):
        assert "gathers" in (inductor_problem(g, (src, loss.id), target) or "")
    emb = ctx.index.op_by_name[first(ctx, "embedding_bwd")]
    reader = g.tensors[emb.outputs[0]].consumers[0]
    assert "scatter-add" in (inductor_problem(g, (emb.id, reader), "gpu") or "")


def test_the_runner_on_a_cpu_runs_no_gemm_epilogues():
    assert "epilogue" in load_stack("coplan").fusion
    cpu = ctx_on("cpu")
    assert cpu.inductor == "cpu" and "epilogue" not in cpu.stack.fusion and not cpu.stack.overlap
    gpu = ctx_on("dgx-h100")
    assert gpu.inductor == "gpu" and "epilogue" in gpu.stack.fusion
    assert ctx_on("dgx-h100", "megatron").inductor is None


@pytest.mark.parametrize("strategy", ["joint", "sequential"])
def test_cpu_plans_hold_only_groups_inductor_emits(strategy):
    ctx = ctx_on("cpu")
    res = run_strategy(strategy, ctx, Options())
    g = ctx.index.graph
    assert res.plan is not None and check(res.plan, ctx) == []
    for grp in res.plan.fusion.groups:
        members = tuple(ctx.index.op_by_name[n].id for n in grp)
        assert inductor_problem(g, members, "cpu") is None, grp
        assert not any(g.ops[i].kind in (OpKind.MATMUL, OpKind.ATTENTION) for i in members), grp


def test_the_checker_refuses_a_group_inductor_splits():
    ctx = ctx_on("cpu")
    g = ctx.index.graph
    loss = next(op for op in g.ops if op.kind is OpKind.LOSS)
    src = g.ops[g.tensors[loss.inputs[0]].producer]
    plan = ctx.default_plan()
    plan = plan.with_(fusion=plan.fusion.__class__(groups=((src.name, loss.name),), label="custom"))
    msgs = [v.message for v in check(plan, ctx)]
    assert any("gathers its input by index" in m for m in msgs), msgs


def test_device_kind_round_trips_and_is_checked():
    cpu = load_cluster("cpu").devices[0]
    assert cpu.kind == "cpu" and DeviceSpec.from_dict(cpu.to_dict()).kind == "cpu"
    h100 = load_cluster("dgx-h100", 1).devices[0]
    assert h100.kind == "gpu" and "kind" not in h100.to_dict()
    bad = {**cpu.to_dict(), "kind": "fpga"}
    with pytest.raises(SpecError, match="kind"):
        DeviceSpec.from_dict(bad, "dev.json")


def test_a_kernel_of_more_buffers_than_max_fusion_size_is_refused():

    ctx = PlanContext(
        CostModel(spec=replace(PRESETS["gpt-tiny"], n_layers=12)), load_cluster("dgx-h100", 1), 8, 64
    )
    g = ctx.index.graph
    # forward norms each write their output and statistics: more than 64 written buffers together
    norms = tuple(op.id for op in g.ops if op.kind.value == "norm" and op.phase.value == "forward")
    assert len(norms) * 3 > INDUCTOR_MAX_FUSION
    why = inductor_problem(g, norms, "gpu")
    assert why is not None and "max_fusion_size" in why
    assert inductor_problem(g, norms[:10], "gpu") is None
