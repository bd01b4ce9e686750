"""Strategies: every result passes the checker; ``joint`` is never worse than the pass-based
strategies (with and without their plans as warm starts) and matches ``exhaustive`` on random
small problems; the pieces joint is built from (the CP-SAT knapsack, the local search) do what
they claim.

The oracle problems restrict the remat candidates to a drawn subset of the saved tensors (by
narrowing the context's saved-tensor index, which joint, the remat pass and exhaustive all read
through ``passes.remat.saved_names``): a GPT block saves 13 tensors, and exhaustive prices every
subset of them for every layout x precision x fusion, 8192 plans per combination (seconds per
problem). With 3-5 candidates a problem takes a fraction of a second; the full set runs in the
slow tier.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import coplan
from coplan.cost import ConfigError, CostModel, load_stack
from coplan.hardware import load_cluster
from coplan.models.spec import PRESETS, ModelSpec
from coplan.passes.remat import saved_names, with_remat
from coplan.plan import Numerics, Plan, PlanContext, PrecisionPlan, check, is_valid
from coplan.search import DEFAULT_STRATEGIES, STRATEGIES, Options, SearchSpace, StrategyResult, run_strategy
from coplan.search.joint import _local_search, knapsack, optimise_remat, refine_remat
from coplan.search.space import FUSION_OPTIONS, fusion_option

OPEN = load_stack("open")

#: the space the oracle tests search: small enough for exhaustive, rich enough that the four
#: decisions interact (bf16 halves activations and weights, ZeRO-1 shards optimizer state)
SMALL = SearchSpace(
    dtypes=("fp32", "bf16"), fusion=("eager", "greedy"), zero=(0, 1), stages=False, per_op=False
)
#: strategies joint is compared with (exhaustive is the oracle, tested separately)
BASELINES = tuple(s for s in DEFAULT_STRATEGIES if s != "joint")


def make_ctx(
    model: str | ModelSpec = "gpt-tiny",
    gpus: int = 2,
    *,
    global_batch: int = 8,
    seq: int = 64,
    cluster: str = "dgx-h100",
) -> PlanContext:
    spec = PRESETS[model] if isinstance(model, str) else model
    hw = load_cluster(cluster, gpus)
    # the search over every option it prices (``open``), not one executor's subset
    return PlanContext(CostModel(spec=spec), hw, global_batch=global_batch, seq=seq, stack=OPEN)


def combos(ctx: PlanContext, space: SearchSpace) -> list[Plan]:
    base = ctx.default_plan()
    return [
        base.with_(parallel=p, precision=c, fusion=f)
        for p in space.parallel(ctx)
        for c in space.precisions(ctx)
        for f in space.fusions(ctx)
    ]


def peak_range(ctx: PlanContext, space: SearchSpace) -> tuple[float, float]:
    """The least peak of the space's combinations with every candidate recomputed or nothing (a
    lower bound on what fits, up to the cost model's non-additive transients) and the largest
    peak with nothing recomputed (every plan fits above it)."""
    every = frozenset(saved_names(ctx))
    none = [ctx.price(p).memory.peak_bytes for p in combos(ctx, space)]
    full = [ctx.price(with_remat(p, every, ctx)).memory.peak_bytes for p in combos(ctx, space)]
    return min(none + full), max(none)


def set_budget(ctx: PlanContext, space: SearchSpace, where: float) -> None:
    lo, hi = peak_range(ctx, space)
    ctx.budget_bytes = lo + where * (hi - lo)


def restrict_remat(ctx: PlanContext, keep: tuple[str, ...]) -> None:
    """Only ``keep`` may be recomputed, for every strategy on ``ctx`` (see the module doc)."""
    idx = ctx.index
    idx.saved_names = {ref: tuple(n for n in names if n in keep) for ref, names in idx.saved_names.items()}
    assert set(saved_names(ctx)) == set(keep)


def assert_in_space(plan: Plan, ctx: PlanContext, space: SearchSpace) -> None:
    assert plan.parallel in set(space.parallel(ctx))
    assert plan.precision in space.precisions(ctx)
    assert dataclasses.replace(plan.fusion, recompute_in_backward=frozenset()) in space.fusions(ctx)
    assert plan.remat.recompute <= set(saved_names(ctx))
    # recomputation inside backward kernels: only what a compiled fusion plan allows, as with_remat
    assert plan == with_remat(plan, plan.remat.recompute, ctx)


# Every strategy -----------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=[None, 0.3], ids=["default-budget", "tight-budget"])
def tiny_job(request: pytest.FixtureRequest) -> PlanContext:
    ctx = make_ctx()
    if request.param is not None:
        set_budget(ctx, SearchSpace(), request.param)
    return ctx


@pytest.mark.parametrize("name", DEFAULT_STRATEGIES)
def test_every_strategy_passes_the_checker(tiny_job, name):
    r = run_strategy(name, tiny_job)
    assert r.strategy == name
    assert r.violations == ()
    assert check(r.plan, tiny_job) == []
    assert r.fits
    assert r.estimate == tiny_job.price(r.plan)
    assert r.considered
    # the result is what coplan plan --json writes: it must survive JSON
    back = json.loads(json.dumps(r.to_dict()))
    assert Plan.from_dict(back["plan"]) == r.plan
    assert back["fits"] is True


def test_exhaustive_passes_the_checker():
    ctx = make_ctx(gpus=1, global_batch=2)
    restrict_remat(ctx, ("h.0.mlp.gelu", "h.0.attn.out", "h.0.ln_2.out"))
    set_budget(ctx, SMALL, 0.5)
    r = run_strategy("exhaustive", ctx, Options(space=SMALL))
    assert r.violations == ()
    assert_in_space(r.plan, ctx, SMALL)
    # it priced every plan of the space: layouts x precisions x fusions x 2^3 remat subsets
    total = len(combos(ctx, SMALL)) * 8
    assert r.notes == (f"{total:,} plans priced",)
    assert ctx.evaluations == total  # set_budget priced some of them first


def test_exhaustive_refuses_a_space_too_large():
    ctx = make_ctx(gpus=1, global_batch=2)
    with pytest.raises(ValueError, match=r"would price [\d,]+ plans \(limit 10\)"):
        run_strategy("exhaustive", ctx, Options(space=SMALL, max_evaluations=10))


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_a_job_no_layout_can_run_is_a_config_error(name):
    # one attention head (no TP) and a global batch of one (no DP) on two GPUs; every strategy
    # reports the job's error, none crashes
    spec = ModelSpec(name="one-head", n_layers=1, d_model=32, n_heads=1, vocab_size=64, seq_len=32)
    ctx = make_ctx(spec, gpus=2, global_batch=1, seq=32)
    with pytest.raises(ConfigError, match="global_batch"):
        run_strategy(name, ctx, Options(space=SMALL))


# joint against the pass-based strategies ----------------------------------------------------------

CASES = [
    ("gpt-tiny", 2, 8, None),
    ("gpt-tiny", 2, 8, 0.3),
    ("llama-tiny", 1, 8, 0.3),
    ("moe-tiny", 1, 8, 0.7),
]
SLOW_CASES = [
    (m, g, gb, w)
    for m in ("gpt-tiny", "llama-tiny", "moe-tiny")
    for g in (1, 2, 4)
    for gb in (8, 16)
    for w in (None, 0.1, 0.3, 0.7)
    if (m, g, gb, w) not in CASES
]


def _joint_against_baselines(model: str, gpus: int, global_batch: int, where: float | None) -> None:
    ctx = make_ctx(model, gpus, global_batch=global_batch)
    if where is not None:
        set_budget(ctx, SearchSpace(), where)
    others: dict[str, StrategyResult] = {name: run_strategy(name, ctx) for name in BASELINES}
    cold = run_strategy("joint", ctx)
    warm = run_strategy("joint", ctx, Options(warm=[r.plan for r in others.values()]))
    assert cold.fits and warm.fits
    assert warm.step_time_s <= cold.step_time_s
    for name, r in others.items():
        assert r.violations == (), name
        assert warm.step_time_s <= r.step_time_s, name
        # without warm starts too: joint's space holds every plan the passes can reach here
        assert cold.step_time_s <= r.step_time_s * (1 + 1e-9), (
            f"joint without warm starts loses to {name}: {cold.step_time_s:.6g} s vs "
            f"{r.step_time_s:.6g} s ({model}, {gpus} GPUs, global batch {global_batch}, budget at {where})"
        )


@pytest.mark.parametrize(("model", "gpus", "global_batch", "where"), CASES)
def test_joint_is_never_worse_than_the_passes(model, gpus, global_batch, where):
    _joint_against_baselines(model, gpus, global_batch, where)


@pytest.mark.slow
@pytest.mark.parametrize(("model", "gpus", "global_batch", "where"), SLOW_CASES)
def test_joint_is_never_worse_than_the_passes_more_cases(model, gpus, global_batch, where):
    _joint_against_baselines(model, gpus, global_batch, where)


def test_joint_takes_a_better_warm_start():
    # a warm start outside joint's space (here: fp8, which SMALL leaves out) wins when faster; the
    # model is wide enough for fp8 GEMMs to repay their casts (on gpt-tiny they do not)
    spec = ModelSpec(name="gpt-2k", n_layers=2, d_model=2048, n_heads=16, vocab_size=8192, seq_len=1024)
    ctx = make_ctx(spec, global_batch=8, seq=1024)
    seq = run_strategy("sequential", ctx)
    fp8 = seq.plan.with_(precision=PrecisionPlan(compute="fp8"))
    assert ctx.fits(ctx.price(fp8))
    cold = run_strategy("joint", ctx, Options(space=SMALL))
    warm = run_strategy("joint", ctx, Options(space=SMALL, warm=[fp8]))
    assert ctx.price(fp8).step_time_s < cold.step_time_s
    assert warm.plan == fp8
    assert warm.violations == ()


def test_joint_plans_the_same_in_every_process():
    # a recompute set is a frozenset of names, which iterates in string-hash order; the local
    # search once followed it, and this job got one of several equally fast plans per process
    code = (
        "import json, sys\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from test_search import make_ctx, set_budget\n"
        "from coplan.search import SearchSpace, run_strategy\n"
        "ctx = make_ctx('gpt-tiny', 2)\n"
        "set_budget(ctx, SearchSpace(), 0.3)\n"
        "print(json.dumps(run_strategy('joint', ctx).plan.to_dict(), sort_keys=True))\n"
    )
    # the child imports the coplan this test imports, wherever pytest runs from
    root = str(Path(coplan.__file__).parents[1])
    plans = set()
    for seed in ("1", "2"):  # two hash seeds: one differing order is enough to show a dependence
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": root}
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
        )
        assert out.returncode == 0, out.stderr[-2000:]
        plans.add(out.stdout.strip().splitlines()[-1])
    assert len(plans) == 1


# joint against the exhaustive oracle --------------------------------------------------------------


@st.composite
def problems(
    draw: st.DrawFn, *, gpus: tuple[int, ...] = (1, 2), candidates: tuple[int, int] = (3, 5)
) -> tuple[PlanContext, float]:
    d_model = draw(st.sampled_from((32, 64, 128)))
    spec = ModelSpec(
        name="prop",
        n_layers=draw(st.integers(1, 2)),
        d_model=d_model,
        n_heads=draw(st.sampled_from([h for h in (1, 2, 4, 8) if d_model % h == 0])),
        vocab_size=draw(st.integers(64, 512)),
        seq_len=128,
    )
    ctx = make_ctx(
        spec,
        draw(st.sampled_from(gpus)),
        global_batch=draw(st.sampled_from((2, 4))),
        seq=draw(st.integers(32, 128)),
    )
    names = saved_names(ctx)
    lo, hi = candidates
    keep = draw(st.lists(st.sampled_from(names), min_size=min(lo, len(names)), max_size=hi, unique=True))
    restrict_remat(ctx, tuple(keep))
    # a little below the least peak: some problems have no fitting plan, and both must say so
    return ctx, draw(st.floats(-0.05, 1.0))


def _joint_matches_exhaustive(ctx: PlanContext, where: float) -> None:
    set_budget(ctx, SMALL, where)
    joint = run_strategy("joint", ctx, Options(space=SMALL))
    oracle = run_strategy("exhaustive", ctx, Options(space=SMALL))
    assert_in_space(joint.plan, ctx, SMALL)
    assert joint.fits == oracle.fits, (joint.violations, oracle.violations)
    if oracle.fits:
        assert joint.step_time_s <= oracle.step_time_s * 1.01
        # the same space: joint cannot beat the oracle (it would mean a plan exhaustive missed)
        assert joint.step_time_s >= oracle.step_time_s * (1 - 1e-12)
    else:
        assert joint.estimate.memory.peak_bytes >= oracle.estimate.memory.peak_bytes
    assert not any(v.level == "structure" for v in joint.violations)


# derandomized: joint's remat local search is not exact (about 1 in 10,000 small problems needs a
# two-for-two or two-for-three move it does not try; one such draw was 2.4%
# behind), so the default tier runs a fixed draw and the slow tier below keeps drawing new ones
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(problems())
def test_joint_matches_exhaustive(problem):
    _joint_matches_exhaustive(*problem)


@pytest.mark.slow
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(candidates=(4, 8)))
def test_joint_matches_exhaustive_more_examples(problem):
    _joint_matches_exhaustive(*problem)


@pytest.mark.slow
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(gpus=(1,), candidates=(13, 13)))
def test_joint_matches_exhaustive_every_saved_tensor(problem):
    # every saved tensor a candidate: 2^13 subsets per combination (seconds per example)
    ctx, where = problem
    assert len(saved_names(ctx)) == 13
    _joint_matches_exhaustive(ctx, where)


# joint's pieces -----------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 1000), st.integers(1, 10_000)), min_size=1, max_size=8),
    st.floats(0.0, 1.0),
)
def test_knapsack_is_exact(items, share):
    # seconds in whole microseconds so the solver's nanosecond integers are exact
    named = [(f"t{i}", us * 1e-6, float(b)) for i, (us, b) in enumerate(items)]
    need = share * sum(b for _, _, b in named)
    got = knapsack(named, need)
    feasible = [
        frozenset(n for (n, _, _), on in zip(named, bits, strict=True) if on)
        for bits in itertools.product((0, 1), repeat=len(named))
        if sum(int(b) for (_, _, b), on in zip(named, bits, strict=True) if on) >= int(need) + 1
    ]
    if need <= 0:
        assert got == frozenset()
        return
    if not feasible:
        assert got is None
        return
    assert got is not None
    seconds = {n: s for n, s, _ in named}
    best = min(sum(seconds[n] for n in s) for s in feasible)
    assert sum(seconds[n] for n in got) == pytest.approx(best, abs=1e-12)
    assert sum(b for n, _, b in named if n in got) > need


def test_refine_remat_trades_one_tensor_for_two():
    # found by a random search of small problems (0.17% of 148,860 combination x budget draws had
    # the per-combination search up to 2.5% behind the best recompute set; 0.01% after
    # refine_remat): here recomputing attention's output and its logsumexp instead of the MLP
    # residual is the best set, a move no single drop, add or swap makes
    spec = ModelSpec(name="prop", n_layers=2, d_model=128, n_heads=8, vocab_size=361, seq_len=128)
    ctx = make_ctx(spec, 2, global_batch=4, seq=47)
    keep = ("h.0.ln_2.rstd", "h.0.mlp_residual", "h.0.attn.out", "h.0.attn.lse", "h.0.ln_1.out")
    restrict_remat(ctx, keep)
    names = saved_names(ctx)
    plan = next(
        p
        for p in combos(ctx, SMALL)
        if p.parallel.describe() == "TP1 PP1 DP2 mb2"
        and p.precision.compute == "fp32"
        and p.fusion.label == "greedy"
    )
    none = ctx.price(with_remat(plan, frozenset(), ctx)).memory.peak_bytes
    every = ctx.price(with_remat(plan, frozenset(names), ctx)).memory.peak_bytes
    ctx.budget_bytes = every + 0.5 * (none - every)
    subsets = [frozenset(c) for r in range(len(names) + 1) for c in itertools.combinations(names, r)]
    fitting = [e.step_time_s for e in (ctx.price(with_remat(plan, x, ctx)) for x in subsets) if ctx.fits(e)]
    best = min(fitting)
    # one-tensor moves from the fastest fitting set that recomputes the MLP residual (where the
    # knapsack lands when it prices tensors one by one) stop short of the best set
    start = min(
        (x for x in subsets if "h.0.mlp_residual" in x and ctx.fits(ctx.price(with_remat(plan, x, ctx)))),
        key=lambda x: ctx.price(with_remat(plan, x, ctx)).step_time_s,
    )
    local = _local_search(with_remat(plan, start, ctx), ctx, names)
    assert ctx.price(local).step_time_s > best * 1.01, "one-tensor moves now find it"
    refined = refine_remat(local, ctx)
    assert ctx.fits(ctx.price(refined))
    assert ctx.price(refined).step_time_s == pytest.approx(best, rel=1e-12)
    assert refined.remat.recompute == {"h.0.attn.out", "h.0.attn.lse", "h.0.ln_1.out"}


def test_local_search_leaves_a_plateau():
    # recomputing a norm's mean or its rstd costs the same (the norm runs again either way):
    # dropping one of the two saves nothing, dropping both saves the norm; a strict descent stops
    # at the pair, the local search must not
    ctx = make_ctx(gpus=1)
    plan = ctx.default_plan()
    pair = frozenset({"h.0.ln_1.mean", "h.0.ln_1.rstd"})
    assert pair <= set(saved_names(ctx))
    one = ctx.price(with_remat(plan, frozenset({"h.0.ln_1.mean"}))).step_time_s
    assert ctx.price(with_remat(plan, pair)).step_time_s == pytest.approx(one)
    assert ctx.price(with_remat(plan, frozenset())).step_time_s < one
    out = _local_search(with_remat(plan, pair), ctx, saved_names(ctx))
    assert out.remat.recompute == frozenset()


# The search space ---------------------------------------------------------------------------------


def test_space_precisions_follow_the_devices():
    h100 = make_ctx()
    # 16-bit and fp8 compute come plain (sensitive ops fused, 16-bit storage) and as autocast
    # (their outputs in fp32); the 16-bit loss needs a tolerance this job does not state
    plain = SearchSpace(reduce16=False, fp8_params=False)
    got = [(p.compute, bool(p.ops)) for p in plain.precisions(h100)]
    assert got == [("fp32", False), ("bf16", False), ("bf16", True), ("fp8", False), ("fp8", True)]
    explicit = SearchSpace(dtypes=("fp16", "bf16"), precision=("fused",), reduce16=False).precisions(h100)
    assert [(p.compute, p.loss_scaling) for p in explicit] == [("fp16", True), ("bf16", False)]
    # beside each, what experts set too where the stack can: 16-bit gradient reduction (with more
    # than one GPU to reduce over) and, under fp8, fp8 weights
    full = SearchSpace(precision=("fused",)).precisions(h100)
    got2 = [(p.compute, p.grad_reduce, p.fp8_params) for p in full]
    assert got2 == [
        ("fp32", "fp32", False),
        ("bf16", "fp32", False),
        ("bf16", "bf16", False),
        ("fp8", "fp32", False),
        ("fp8", "bf16", False),
        ("fp8", "fp32", True),
        ("fp8", "bf16", True),
    ]
    for p in full:
        assert check(h100.default_plan().with_(precision=p), h100) == []
    one_gpu = make_ctx(gpus=1)
    assert all(p.grad_reduce == "fp32" for p in SearchSpace().precisions(one_gpu))
    loose = make_ctx()
    loose.numerics = Numerics(tolerance=0.01)
    variants = SearchSpace(dtypes=("bf16",), reduce16=False).precisions(loose)
    low = [p for p in variants if p.ops and "fp32" not in dict(p.ops).values()]
    assert len(low) == 1 and check(loose.default_plan().with_(precision=low[0]), loose) == []
    a100 = make_ctx(cluster="dgx-a100-40gb")
    assert [p.compute for p in SearchSpace(dtypes=("fp32", "fp8")).precisions(a100)] == ["fp32"]


@pytest.mark.parametrize("model", ["gpt-tiny", "llama-tiny", "moe-tiny"])
def test_every_fusion_option_passes_the_checker(model):
    ctx = make_ctx(model)
    for name in FUSION_OPTIONS:
        plan = ctx.default_plan().with_(fusion=fusion_option(ctx, name))
        assert check(plan, ctx) == [], name
        assert bool(plan.fusion.groups) == (name != "eager")
    with pytest.raises(ValueError, match="unknown fusion option 'nope'"):
        fusion_option(ctx, "nope")


def test_space_layouts_are_valid():
    ctx = make_ctx(gpus=4, global_batch=8)
    layouts = list(SMALL.parallel(ctx))
    assert layouts
    assert {p.zero for p in layouts} == {0, 1}
    assert all(is_valid(ctx.default_plan().with_(parallel=p), ctx) for p in layouts)


def test_later_pipeline_stages_recompute_less():
    from coplan.plan.types import ParallelPlan
    from coplan.search.joint import per_stage_remat

    ctx = make_ctx(gpus=2, global_batch=8)
    plan = ctx.default_plan().with_(parallel=ParallelPlan(pp=2, microbatch=1))
    every = with_remat(plan, frozenset(saved_names(ctx)), ctx)
    none, full = ctx.price(plan), ctx.price(every)
    # stage 0 holds two microbatches in flight, stage 1 one: a budget between stage 0's peak with
    # everything recomputed and with nothing, and above stage 1's peak with nothing recomputed
    lo = max(full.stages[0].memory.peak_bytes, none.stages[1].memory.peak_bytes)
    hi = none.stages[0].memory.peak_bytes
    assert lo < hi
    ctx.budget_bytes = (lo + hi) / 2
    shared = optimise_remat(plan, ctx)
    assert shared.remat.recompute and ctx.fits(ctx.price(shared))
    out = per_stage_remat(shared, ctx)
    assert check(out, ctx) == []
    assert out.remat.per_stage is not None
    assert len(out.remat.per_stage[1]) < len(out.remat.per_stage[0])
    est = ctx.price(out)
    assert est.stages[1].recompute_s < ctx.price(shared).stages[1].recompute_s
    assert est.step_time_s <= ctx.price(shared).step_time_s


def test_rebalancing_moves_layers_off_the_pacing_stage():
    from coplan.plan.types import ParallelPlan
    from coplan.search.joint import rebalance_stages

    spec = ModelSpec(name="gpt-deep", n_layers=8, d_model=256, n_heads=4, vocab_size=65536, seq_len=512)
    ctx = PlanContext(CostModel(spec=spec), load_cluster("dgx-h100", 2), global_batch=16, seq=512, stack=OPEN)
    plan = ctx.default_plan().with_(parallel=ParallelPlan(pp=2, microbatch=1))
    out = rebalance_stages(plan, ctx)
    assert check(out, ctx) == []
    # the last stage also runs a large-vocabulary LM head and loss: it gives layers away
    assert out.parallel.stage_layers is not None
    assert sum(out.parallel.stage_layers) == 8 and out.parallel.stage_layers[1] < 4
    assert ctx.price(out).step_time_s < ctx.price(plan).step_time_s


@pytest.mark.parametrize("name", ["sequential", "joint"])
def test_a_held_layout_stays_the_base_plans(name):
    """A decision ``SearchSpace.fixed`` holds is the base plan's under the passes too: one microbatch
    of the whole batch (``benchmarks/gpu_all.py``'s memory-tight runs) stays one microbatch, and a
    budget it cannot meet that way is met by what the other decisions free."""
    ctx = make_ctx(gpus=1, global_batch=8)
    base = ctx.default_plan().with_(parallel=dataclasses.replace(ctx.default_plan().parallel, microbatch=8))
    ctx.budget_bytes = 0.6 * ctx.price(base).memory.peak_bytes
    opts = Options(space=SearchSpace(fixed=frozenset({"parallel"})), base=base)
    got = run_strategy(name, ctx, opts)
    assert got.plan.parallel == base.parallel
    assert got.violations == ()
    assert ctx.fits(got.estimate)
    assert not ctx.fits(ctx.price(base))
    assert got.plan.remat.all_names or got.plan.precision != base.precision
