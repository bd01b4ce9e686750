"""Planning for a stack: the search uses only what the stack executes, the checker refuses (and
names) what it cannot run, and a plan is priced as ``coplan estimate --stack`` prices it."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from coplan.cli import app
from coplan.cost import CostModel
from coplan.cost.stacks import StackError, load_stack, stack_names
from coplan.hardware import load_cluster
from coplan.models.spec import PRESETS
from coplan.plan import FusionPlan, Plan, PlanContext, PrecisionPlan, RematPlan, check
from coplan.plan.capabilities import plan_stack, policy_sets
from coplan.plan.checker import ANCHORS
from coplan.search import DEFAULT_STRATEGIES, Options, SearchSpace, run_strategy
from coplan.search.space import fusion_option

GPUS = 4
GLOBAL_BATCH = 16
SEQ = 64


def make_ctx(stack: str, model: str = "gpt-tiny", **kw: float) -> PlanContext:
    hw = load_cluster("dgx-h100", GPUS)
    return PlanContext(
        CostModel(spec=PRESETS[model]),
        hw,
        global_batch=GLOBAL_BATCH,
        seq=SEQ,
        stack=load_stack(stack),
        **kw,  # type: ignore[arg-type]
    )


def allowed(plan: Plan, ctx: PlanContext) -> list[str]:
    """What in ``plan`` the stack's settings rule out, checked field by field (not through the
    checker's own rule)."""
    s, p = ctx.stack, plan.parallel
    bad = []
    if p.tp > 1 and not s.tensor_parallel:
        bad.append("tp")
    if p.pp > 1 and not s.pipeline_parallel:
        bad.append("pp")
    if p.vpp > 1 and not s.interleaved_pipeline:
        bad.append("vpp")
    if p.sequence_parallel and not s.sequence_parallel:
        bad.append("sp")
    if not s.combined_layouts and ((p.pp > 1 and p.tp * p.dp > 1) or (p.tp > 1 and p.dp > 1 and p.zero)):
        bad.append("combined")
    if p.dp > 1 and p.zero not in s.zero_stages:
        bad.append("zero")
    if p.pp > 1 and p.dp > 1 and p.zero not in s.pipeline_zero_stages:
        bad.append("pipeline zero")
    if s.ddp_alone and p.zero == 0 and p.dp > 1 and p.tp * p.pp * p.cp > 1:
        bad.append("ddp")
    fused = {frozenset(g) for g in plan.fusion.groups}
    if "greedy" in s.fusion:
        # the stack compiles the plan's own groups: any legal grouping, GEMMs and attention inside
        # a group only where it emits epilogues
        kinds = [[ctx.index.op_by_name[n].kind for n in g] for g in plan.fusion.groups]
        if "epilogue" not in s.fusion and any(len(k) > 1 and set(k) & ANCHORS for k in kinds):
            bad.append("fusion")
    elif not any(fused == {frozenset(g) for g in fusion_option(ctx, f).groups} for f in s.fusion):
        bad.append("fusion")
    c = plan.precision
    # fp8 as the plan's fusion option runs the stack: torchtitan's float8 only compiled
    runs = s.kernels_for(plan.fusion.label)
    if runs.fp8 != "native" and (c.compute == "fp8" or any(d == "fp8" for _, d in c.ops)):
        bad.append("fp8")
    if c.fp8_params and not runs.fp8_params:
        bad.append("fp8 weights")
    if not s.recompute_sets and plan.remat.recompute not in policy_sets(ctx).values():
        bad.append("remat")
    return bad


@pytest.mark.parametrize("stack", stack_names())
@pytest.mark.parametrize("strategy", DEFAULT_STRATEGIES)
def test_plans_use_only_what_the_stack_executes(stack: str, strategy: str) -> None:
    ctx = make_ctx(stack)
    plan = run_strategy(strategy, ctx).plan
    assert allowed(plan, ctx) == []
    assert [v for v in check(plan, ctx, memory=False) if v.rule == "stack"] == []


@pytest.mark.parametrize("stack", stack_names())
def test_the_search_space_holds_only_executable_combinations(stack: str) -> None:
    ctx = make_ctx(stack)
    combos = SearchSpace(dtypes=("bf16", "fp8")).plans(ctx, ctx.default_plan())
    assert combos
    for p in combos:
        assert allowed(p, ctx) == [], p.parallel.describe()
    assert allowed(ctx.default_plan(), ctx) == []


@pytest.mark.parametrize("stack", [s for s in stack_names() if not load_stack(s).recompute_sets])
def test_a_tight_budget_recomputes_a_policy_of_the_stack(stack: str) -> None:
    loose = make_ctx(stack)
    peak = loose.price(run_strategy("joint", loose).plan).memory.peak_bytes
    ctx = make_ctx(stack, budget_bytes=peak * 0.7)
    plan = run_strategy("joint", ctx).plan
    sets = policy_sets(ctx)
    assert plan.remat.per_stage is None
    assert plan.remat.recompute in sets.values()
    assert [v for v in check(plan, ctx, memory=False) if v.rule == "stack"] == []


def forbidden(ctx: PlanContext) -> dict[str, Plan]:
    base = ctx.default_plan().with_(precision=PrecisionPlan(compute="bf16"))
    par = base.parallel
    one = next(n for v in ctx.index.saved_names.values() for n in v)
    return {
        "tensor parallelism": base.with_(parallel=replace(par, tp=2, dp=GPUS // 2)),
        "pipeline parallelism": base.with_(parallel=replace(par, pp=2, dp=GPUS // 2)),
        "ZeRO stage 1": base.with_(parallel=replace(par, zero=1)),
        "ZeRO stage 3 with pipeline parallelism": base.with_(
            parallel=replace(par, pp=2, dp=GPUS // 2, zero=3)
        ),
        "plain data parallelism (ZeRO 0) beside": base.with_(
            parallel=replace(par, tp=2, dp=GPUS // 2, zero=0)
        ),
        "fusion": base.with_(fusion=fusion_option(ctx, "epilogue")),
        "fp8": base.with_(precision=PrecisionPlan(compute="fp8")),
        "recompute": base.with_(remat=RematPlan(recompute=frozenset({one}))),
        "reduce gradients in bf16": base.with_(precision=PrecisionPlan(compute="bf16", grad_reduce="bf16")),
        "fp8 weights": base.with_(precision=PrecisionPlan(compute="fp8", fp8_params=True)),
    }


@pytest.mark.parametrize(
    ("stack", "what"),
    [
        ("fsdp", "tensor parallelism"),
        ("eager", "pipeline parallelism"),
        ("torchtitan", "ZeRO stage 1"),
        ("deepspeed", "ZeRO stage 3 with pipeline parallelism"),
        ("torchtitan", "plain data parallelism (ZeRO 0) beside"),
        ("torchtitan-compile", "fusion"),
        ("eager", "fusion"),
        ("torchtitan", "fp8"),
        ("eager-compile", "fp8"),
        ("coplan", "pipeline parallelism"),
        ("fsdp-compile", "recompute"),
        ("coplan", "reduce gradients in bf16"),
        ("torchtitan", "reduce gradients in bf16"),
        ("coplan", "fp8 weights"),
    ],
)
def test_the_checker_names_what_the_stack_cannot_run(stack: str, what: str) -> None:
    ctx = make_ctx(stack)
    plan = forbidden(ctx)[what]
    msgs = [v.message for v in check(plan, ctx, memory=False) if v.rule == "stack"]
    assert len(msgs) == 1 and stack in msgs[0] and what in msgs[0], msgs
    # the same plan is fine in the space of every option: it is the stack that refuses it
    mctx = make_ctx("open")
    assert [v for v in check(forbidden(mctx)[what], mctx, memory=False) if v.rule == "stack"] == []


def estimate_cli(ctx: PlanContext, plan: Plan, fusion: str) -> float:
    """``coplan estimate --stack`` on ``plan``'s decisions (recompute none, no per-op dtypes), with
    the stack's overlap and gradient buckets given as flags."""
    p, s = plan.parallel, ctx.stack
    args = [
        "estimate",
        "--model", ctx.model_name,
        "--cluster", "dgx-h100",
        "--gpus", str(GPUS),
        "--tp", str(p.tp), "--pp", str(p.pp), "--vpp", str(p.vpp),
        "--microbatch", str(p.microbatch),
        "--global-batch", str(GLOBAL_BATCH),
        "--seq", str(SEQ),
        "--zero", str(p.zero),
        "--dtype", plan.precision.compute,
        "--fusion", fusion,
        "--recompute", "none",
        "--dp-bucket-scope", s.dp_bucket_scope,
        "--stack", s.name,
        "--json",
    ]  # fmt: skip
    if p.sequence_parallel:
        args.append("--sequence-parallel")
    if plan.precision.grad_reduce != "fp32":
        args.append("--grad-reduce-16bit")
    if plan.precision.fp8_params:
        args.append("--fp8-params")
    # the stack's overlap and buckets: estimate takes them as flags (a run states its own)
    if not s.overlap:
        args += ["--no-overlap-grad-reduce", "--no-overlap-param-gather"]
    elif p.zero >= 1:
        args.append("--overlap-param-gather")
    if s.dp_bucket_params is not None:
        args += ["--dp-bucket-params", str(s.dp_bucket_params)]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    return float(json.loads(res.output)["step_time_s"])


@pytest.mark.parametrize("stack", stack_names())
def test_a_plan_for_a_stack_is_priced_as_estimate_prices_it(stack: str) -> None:
    ctx = make_ctx(stack)
    plan = run_strategy("joint", ctx, Options(space=SearchSpace(precision=("fused",)))).plan
    assert not plan.remat.recompute and not plan.precision.ops
    if not set(ctx.stack.fusion) & {"greedy", "epilogue", "megatron", "duplicate"}:
        assert not plan.fusion.groups  # the plan itself: eager kernels or the stack's compiler's
    # ``estimate --fusion none``: no groups of a plan's; under Inductor's kernels the compiler's own
    # fusion, as the planner prices a plan without groups
    priced = plan.with_(fusion=FusionPlan())
    assert ctx.price(priced).step_time_s == pytest.approx(estimate_cli(ctx, priced, "none"), rel=1e-9)


def test_the_compiled_loss_of_a_stack_is_priced() -> None:
    # fsdp-compile runs its loss eager, torchtitan-compile compiles it: the same plan differs
    ctx = make_ctx("fsdp-compile")
    plan = ctx.default_plan()
    assert ctx.config_of(plan).fusion == "megatron"  # Inductor's groups, as estimate prices them
    assert ctx.config_of(plan).eager_loss and ctx.config_of(plan).kernels == "inductor"
    other = make_ctx("torchtitan-compile")
    assert not other.config_of(plan).eager_loss
    assert other.config_of(plan).loss_fusion == "inductor"


def test_plan_stack(tmp_path: Path) -> None:
    assert plan_stack(None, None).name == "megatron"
    assert plan_stack("fsdp", None) == load_stack("fsdp")
    f = tmp_path / "mine.json"
    f.write_text(json.dumps({"name": "mine", "zero_stages": [3], "sources": {"zero_stages": "ours"}}))
    assert plan_stack(None, f).zero_stages == (3,)
    with pytest.raises(StackError, match="not both"):
        plan_stack("fsdp", f)
    f.write_text(json.dumps({"name": "mine", "fusion": ["inductor"], "sources": {"fusion": "ours"}}))
    with pytest.raises(StackError, match="fusion"):
        plan_stack(None, f)


def test_megatron_plans_are_priced_as_the_published_runs() -> None:
    # the default stack runs Megatron-LM's kernel set and its checkpointing policies: a plan names
    # them, and is priced by name (``fusion="megatron"``, ``recompute="selective"``/``"full"``), the
    # path the published runs were checked on, not as groups and sets of its own
    hw = load_cluster("dgx-h100", GPUS)
    plain = PlanContext(CostModel(spec=PRESETS["gpt-tiny"]), hw, global_batch=GLOBAL_BATCH, seq=SEQ)
    assert plain.stack == load_stack("megatron") == plan_stack(None, None)
    base = plain.default_plan()
    assert base.fusion == FusionPlan(label="megatron") == fusion_option(plain, "megatron")
    config = plain.config_of(base)
    assert config.fusion == "megatron" and config.recompute == "none"
    assert plain.stack.with_kernels(config) is config
    for name, names in policy_sets(plain).items():
        got = plain.config_of(base.with_(remat=RematPlan(recompute=names))).recompute
        assert got == (name if names else "none")
    # the open stack, every option the cost model prices, adds nothing to a plan's configuration
    open_ = PlanContext(
        CostModel(spec=PRESETS["gpt-tiny"]), hw, global_batch=GLOBAL_BATCH, seq=SEQ, stack=load_stack("open")
    )
    plan = open_.default_plan().with_(fusion=fusion_option(open_, "epilogue"))
    config = open_.config_of(plan)
    assert open_.stack.with_kernels(config) is config
    assert config.kernels == "megatron" and not isinstance(config.fusion, str)
    assert open_.default_plan().fusion == FusionPlan() and open_.default_plan().parallel.zero == 0


def test_a_stack_file_restricts_the_search(tmp_path: Path) -> None:
    f = tmp_path / "ddp.json"
    f.write_text(json.dumps({"name": "ddp-only", "tensor_parallel": False, "pipeline_parallel": False,
                             "zero_stages": [0], "sources": {"tensor_parallel": "ours",
                             "pipeline_parallel": "ours", "zero_stages": "ours"}}))  # fmt: skip
    hw = load_cluster("dgx-h100", GPUS)
    ctx = PlanContext(
        CostModel(spec=PRESETS["gpt-tiny"]), hw, global_batch=GLOBAL_BATCH, seq=SEQ, stack=plan_stack(None, f)
    )
    p = run_strategy("joint", ctx).plan.parallel
    assert (p.tp, p.pp, p.dp, p.zero) == (1, 1, GPUS, 0)


def test_estimate_says_what_the_stack_cannot_run(cli) -> None:  # type: ignore[no-untyped-def]
    """``coplan estimate --stack`` prices what is asked, and names what of it the stack cannot run
    (as the planner's checker would), one note each."""
    args = ("estimate", "--model", "gpt-tiny", "--gpus", "4", "--global-batch", "8", "--seq", "64")
    code, out, err = cli(*args, "--pp", "2", "--zero", "3", "--stack", "deepspeed", "--json")
    assert code == 0, err
    got = json.loads(out)["stack_problems"]
    assert got == [
        "stack 'deepspeed' cannot run ZeRO stage 3 with pipeline parallelism (it offers 0, 1 there)"
    ]
    code, out, err = cli(*args, "--stack", "torchtitan", "--recompute", "selective")
    assert code == 0, err
    assert "note: stack 'torchtitan' cannot recompute 'selective'" in " ".join(out.split())
    code, out, _ = cli(*args, "--pp", "2", "--zero", "1", "--stack", "deepspeed", "--json")
    assert code == 0 and json.loads(out)["stack_problems"] == []


def test_a_plan_names_the_checkpointing_policy_its_recompute_set_is() -> None:
    from coplan.plan import plan_summary

    ctx = make_ctx("torchtitan", model="llama-tiny")
    sets = policy_sets(ctx)
    base = ctx.default_plan()
    words = {
        name: plan_summary(base.with_(remat=RematPlan(recompute=names)), None, ctx.index, sets)["remat"]
        for name, names in sets.items()
    }
    assert words["none"] == "nothing recomputed"
    assert words["selective-op"].startswith("per-op checkpointing (torchtitan's policy): recompute ")
    assert words["full"].startswith("full checkpointing: recompute ")
    # a set no policy makes, or no policies given: the tensors alone
    one = frozenset(list(sets["full"])[:1])
    assert plan_summary(base.with_(remat=RematPlan(recompute=one)), None, ctx.index, sets)[
        "remat"
    ].startswith("recompute 1: ")
    assert plan_summary(base.with_(remat=RematPlan(recompute=sets["full"])), None, ctx.index)[
        "remat"
    ].startswith("recompute ")
