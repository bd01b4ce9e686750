"""torch.compile as a plan decision of the stacks that have a compile flag (torchtitan's
``--training.compile``, fms-fsdp's ``use_torch_compile``, nanoGPT's ``compile``): the fusion option
``compiled`` of the ``torchtitan``, ``fsdp`` and ``eager`` presets, priced with the kernels of their
``-compile`` preset (``StackSpec.compile_preset``), the rest of the plan the stack's own."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace

import pytest

from coplan.cost import CostModel, load_stack
from coplan.cost.stacks import StackError, stack_from_dict
from coplan.hardware import load_cluster
from coplan.models.spec import PRESETS
from coplan.plan import PlanContext
from coplan.plan.emit import emit
from coplan.plan.types import FusionPlan, ParallelPlan
from coplan.search import run_strategy
from coplan.search.space import SearchSpace

Cli = Callable[..., tuple[int, str, str]]


def ctx_for(stack: str, gpus: int = 8) -> PlanContext:
    return PlanContext(
        CostModel(spec=PRESETS["llama2-7b"]),
        load_cluster("dgx-h100", gpus),
        global_batch=16,
        seq=4096,
        stack=load_stack(stack),
    )


def test_the_stacks_with_a_compile_flag_price_compiled_plans_with_their_compile_preset() -> None:
    for name in ("torchtitan", "fsdp", "eager"):
        stack = load_stack(name)
        assert stack.fusion == ("eager", "compiled")
        assert stack.kernels_for("compiled").name == f"{name}-compile"
        assert stack.kernels_for("compiled").kernels == "inductor"
        assert stack.kernels_for("eager") is stack
    for name in ("megatron", "deepspeed", "coplan", "torchtitan-compile"):
        assert load_stack(name).kernels_for("compiled") is load_stack(name)


def test_a_compiled_plan_is_priced_exactly_as_the_compile_preset_prices_it() -> None:
    eager_ctx, compiled_ctx = ctx_for("torchtitan"), ctx_for("torchtitan-compile")
    plan = run_strategy("sequential", eager_ctx).plan.with_(
        parallel=ParallelPlan(dp=8, zero=3, microbatch=1), fusion=FusionPlan(label="compiled")
    )
    # data parallel only: nothing of torchtitan-compile's float8 or async TP applies
    assert eager_ctx.config_of(plan) == compiled_ctx.config_of(plan)
    assert eager_ctx.config_of(plan).kernels == "inductor"
    eager = plan.with_(fusion=FusionPlan(label="eager"))
    assert eager_ctx.config_of(eager).kernels == "eager"
    # two decisions: two fingerprints, and the compiled step is the faster (fewer kernels)
    assert eager.fingerprint != plan.fingerprint
    assert eager_ctx.price(plan).step_time_s < eager_ctx.price(eager).step_time_s


def test_the_planner_decides_compile_jointly_and_keeps_the_stacks_precisions() -> None:
    ctx = ctx_for("torchtitan")
    # the search space itself holds both settings of the flag, not only a warm start's
    assert {f.label for f in SearchSpace().fusions(ctx)} == {"eager", "compiled"}
    best = run_strategy("joint", ctx)
    eager_only = replace(ctx.stack, fusion=("eager",), compile_preset="")
    pinned = run_strategy(
        "joint", PlanContext(ctx.model, ctx.cluster, global_batch=16, seq=4096, stack=eager_only)
    )
    assert best.plan.fusion.label in ("eager", "compiled")
    assert best.estimate.step_time_s <= pinned.estimate.step_time_s
    assert pinned.plan.fusion.label == "eager"
    # torchtitan runs float8 only compiled: the search pairs fp8 with the compiled option alone,
    # and the eager-only stack offers no fp8 at all
    assert pinned.plan.precision.compute != "fp8"
    assert best.plan.precision.compute != "fp8" or best.plan.fusion.label == "compiled"
    pairs = {(p.precision.compute, p.fusion.label) for p in SearchSpace().plans(ctx, ctx.default_plan())}
    assert ("fp8", "compiled") in pairs and ("fp8", "eager") not in pairs
    assert {("bf16", "eager"), ("bf16", "compiled")} <= pairs
    # on H100s at this size float8 is torchtitan's fastest setting (its own tables: 1.2-1.5x)
    assert best.plan.precision.compute == "fp8"


def test_the_checker_refuses_fp8_on_an_eager_torchtitan_plan_and_says_why() -> None:
    from coplan.plan.capabilities import problems

    ctx = ctx_for("torchtitan")
    best = run_strategy("joint", ctx).plan
    assert best.precision.compute == "fp8" and not list(problems(best, ctx))
    eager = best.with_(fusion=FusionPlan(label="eager"))
    found = list(problems(eager, ctx))
    assert any("runs fp8 GEMMs only with torch.compile on" in why for why in found), found
    # a stack without any fp8 says it cannot run it at all
    fsdp = ctx_for("fsdp")
    assert any(
        "cannot run fp8 GEMMs" in why
        for why in problems(best.with_(fusion=FusionPlan(label="compiled")), fsdp)
    )


def test_a_compiled_torchtitan_plan_turns_compile_on_and_async_tp_only_where_priced() -> None:
    ctx = ctx_for("torchtitan")
    plan = run_strategy("sequential", ctx).plan.with_(
        parallel=ParallelPlan(tp=2, dp=4, zero=3, sequence_parallel=True), fusion=FusionPlan(label="compiled")
    )
    spec = PRESETS["llama2-7b"]
    # torchtitan runs async TP compiled only: a compiled plan is priced with it, an eager one not
    assert ctx.config_of(plan).async_tp
    eager_plan = plan.with_(fusion=FusionPlan(label="eager"))
    assert not ctx.config_of(eager_plan).async_tp
    assert ctx.config_of(plan) == ctx_for("torchtitan-compile").config_of(plan)
    text = emit(plan, spec, "torchtitan", async_tp=ctx.kernels_stack(plan).async_tp).text
    assert "[compile]\nenable = true" in text and "enable_async_tensor_parallel = true" in text
    assert "enable_async_tensor_parallel" not in emit(plan, spec, "torchtitan", async_tp=False).text
    eager = emit(eager_plan, spec, "torchtitan", async_tp=ctx.kernels_stack(eager_plan).async_tp).text
    assert "[compile]\nenable = false" in eager and "enable_async_tensor_parallel" not in eager


@pytest.mark.parametrize(
    ("settings", "why"),
    [
        ({"extends": "torchtitan", "compile_preset": "nope"}, "must name a preset"),
        ({"extends": "torchtitan", "compile_preset": "megatron"}, "does not run torch.compile's kernels"),
        ({"extends": "torchtitan-compile", "compile_preset": "torchtitan-compile"}, "needs eager kernels"),
        ({"extends": "torchtitan", "fusion": ["eager"]}, "needs eager kernels and the 'compiled' fusion"),
        ({"extends": "torchtitan", "compile_preset": 3}, "must name a preset or be empty"),
    ],
)
def test_a_stack_file_names_a_compile_preset_that_compiles(settings: dict[str, object], why: str) -> None:
    with pytest.raises(StackError) as info:
        cited = {k: "my fork" for k in settings if k != "extends"}
        stack_from_dict({"name": "mine", **settings, "sources": cited}, "mine.json")
    assert info.value.field == "compile_preset" and why in str(info.value)


def test_plan_json_says_whether_the_step_runs_compiled(cli: Cli) -> None:
    args = ("plan", "--gpus", "8", "--cluster", "dgx-h100", "--json")
    code, out, err = cli(*args, "--stack", "torchtitan")
    assert code == 0, err
    body = json.loads(out)
    assert body["compile"] is (body["plan"]["fusion"]["label"] == "compiled")
    code, out, err = cli(*args)  # megatron: no torch.compile flag, no key
    assert code == 0, err
    assert "compile" not in json.loads(out)


def test_estimate_compile_prices_the_stacks_compiled_preset(cli: Cli) -> None:
    args = ("estimate", "--model", "llama3-8b", "--gpus", "8", "--zero", "3", "--seq", "8192", "-b", "8")
    runs = {}
    for extra in ((), ("--compile",), ("--no-compile",)):
        code, out, err = cli(*args, "--stack", "torchtitan", *extra, "--json")
        assert code == 0, err
        runs[extra] = json.loads(out)
    code, out, err = cli(*args, "--stack", "torchtitan-compile", "--json")
    assert code == 0, err
    preset = json.loads(out)
    assert runs[("--compile",)]["step_time_s"] == preset["step_time_s"]
    assert runs[("--compile",)]["stack"] == "torchtitan" and runs[("--compile",)]["compile"] is True
    assert runs[()]["compile"] is False and runs[()]["step_time_s"] == runs[("--no-compile",)]["step_time_s"]
    assert runs[()]["step_time_s"] > preset["step_time_s"]  # eager kernels: more launches, more bytes
    # float8 runs only compiled: priced either way, said where the stack cannot run it
    fp8 = ("--dtype", "fp8", "--json")
    code, out, _ = cli(*args, "--stack", "torchtitan", *fp8)
    assert code == 0 and any("only compiled (--compile)" in w for w in json.loads(out)["stack_problems"])
    code, out, _ = cli(*args, "--stack", "torchtitan", "--compile", *fp8)
    assert code == 0 and json.loads(out)["stack_problems"] == []


@pytest.mark.parametrize(
    ("args", "why"),
    [
        (("--compile",), "error: --compile: stack 'megatron' has no torch.compile flag"),
        (("--stack", "eager-compile", "--no-compile"), "always compiles; its eager form is --stack eager"),
    ],
)
def test_estimate_refuses_a_compile_flag_the_stack_lacks(cli: Cli, args: tuple[str, ...], why: str) -> None:
    code, out, err = cli("estimate", *args)
    assert code == 2 and out == "" and why in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
