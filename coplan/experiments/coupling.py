"""How strongly fusion, remat, parallelism and precision couple, from coplan's cost model.

The claim under test: optimising two decision spaces jointly yields more than
5% throughput over optimising them one after the other; it is killed if the coupling stays below
5% in every scenario. For every scenario of a grid (model x cluster x global batch x memory
budget) and every pair of spaces A, B this module plans, from the same default plan:

- ``single_a``: A optimised alone, the other three at their defaults;
- ``a_then_b`` / ``b_then_a``: A optimised, then B optimised with A's decision kept (and the
  other order); ``sequential`` is the better of the two;
- ``joint``: A and B optimised together;

and for all four spaces: each alone, every one of the 24 orders (``sequential`` is the best, the
literature's fusion -> remat -> parallel -> precision is also kept) and all four together.

**One optimiser for every space.** "Optimising A" is coplan's joint search
(``search.joint``: exact branch and bound over layouts x precisions x fusion options, the recompute
set by a CP-SAT knapsack with local search) restricted to A by ``SearchSpace.fixed``: the other
decisions are taken from the base plan as they are. Sequential and joint therefore search the
same options with the same machinery and the difference between them is the interaction of the
decisions, not a difference of search spaces (the production passes of ``coplan compare`` never
choose fp8 or GEMM epilogues, which docs/planner.md shows is most of joint's gain there). The joint
search of a pair is warm-started with both sequential plans, so ``joint >= sequential`` holds by
construction (its space contains them); ``joint_from_warm_start`` says when the joint plan is
one of the sequential plans (the search found nothing strictly better: ties keep the warm
start). Without warm starts joint >= sequential is exact for pairs without remat (finite
enumeration, exact pruning) but not guaranteed with remat (the recompute set is a heuristic
optimum on a cost model whose memory is not additive).

**Spaces.** fusion: eager, greedy (Inductor-style), epilogue (greedy plus GEMM epilogues and
prologues), Megatron's kernels; remat: any set of the block's saved tensors (per pipeline stage
when layers are pipelined); parallel: every TP x PP x DP x VPP x SP x ZeRO x microbatch layout the
parallel pass enumerates (plus uneven stage splits); precision: every compute dtype the devices
run natively (fp8 included) under the ``fused`` and ``autocast`` variants (16-bit loss path only
under a numerics tolerance, which this study does not grant).

**Defaults** (``Defaults``): what a practitioner runs out of the box: eager PyTorch kernels
(torch.compile is opt-in; greedy fusion is one of the options searched), nothing recomputed, plain
data parallelism over every GPU with ZeRO 0 at microbatch 1 (the smallest layout that is valid for
any global batch divisible by the GPUs; larger microbatches are a parallel decision), and AMP:
bf16 autocast where the devices have bf16 (else fp16 with loss scaling, else fp32), norms, softmax
and loss in fp32.

**Gains and infeasible plans.** A gain is a throughput ratio against the default plan: the default
plan's step time over the plan's (same job, so tokens/s ratio). The cost model prices the default
plan whether or not it fits; when it does not (``baseline_fits`` false) gains are against that
priced-but-unrunnable reference. A plan that does not fit its memory budget has no gain (null):
it cannot run, and a throughput of zero would turn every ratio into 0 or infinity.
``interaction = (joint - 1) - ((single_a - 1) + (single_b - 1))`` is defined where the three
fit (throughput ratios compose by multiplication, so independent gains already give a non-zero
additive interaction: ``interaction_ratio = joint / (single_a x single_b)`` is reported too, 1
meaning independent); ``joint_over_sequential`` (the coupling) where joint and sequential fit;
``feasibility_coupled`` marks scenarios where the joint plan fits and no sequential order does
(coupling without a finite ratio: reported, counted apart, not used by the verdict). A search
that finds nothing fitting returns the plan closest to fitting (least peak memory), and the next
space of a sequence starts from it, as the next pass of a pipeline would (e.g. remat alone on a
layout that cannot fit recomputes everything, and "remat, then parallel" keeps that set).

**Verdict.** ``validated`` when ``joint_over_sequential > 1.05`` for some pair in some scenario
(both plans fitting), else ``killed``. The summaries (top-level entries per pair, the verdict,
the trends with scale, the JSON object) are ``coupling_summary``'s.

Every plan reported is checked by ``plan.checker`` (a structural violation would be a planner bug
and is reported in ``invalid_plans``); every figure is the cost model's prediction.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from coplan import procs
from coplan.errors import SpecError

if TYPE_CHECKING:
    from coplan.plan.context import PlanContext
    from coplan.plan.types import Plan
    from coplan.search.result import StrategyResult

#: the four decision spaces, named as coplan's passes are (``search.space.DECISIONS``)
SPACES: tuple[str, ...] = ("fusion", "remat", "parallel", "precision")
#: the six pairs, named ``a+b`` in ``SPACES`` order
PAIRS: tuple[tuple[str, str], ...] = tuple(itertools.combinations(SPACES, 2))
PAIR_NAMES: tuple[str, ...] = tuple(f"{a}+{b}" for a, b in PAIRS)
#: the claim: joint over sequential above this in some scenario validates it
THRESHOLD = 1.05
#: memory budgets: ``loose`` is coplan's default (capacity x 0.95 - 1 GiB); the others are this
#: fraction of the device's memory (``tight`` as in the planner benchmark)
BUDGET_FRACTIONS: dict[str, float] = {"tight": 0.5, "very-tight": 0.25}
BUDGETS: tuple[str, ...] = ("loose", *BUDGET_FRACTIONS)
#: the stack the study plans for: ``open``, every option the cost model prices (``cost/stacks/open.json``)
STUDY_STACK = "open"
GRIDS: tuple[str, ...] = ("small", "full")
#: what "optimising fusion" searches: ``op``, every legal partition of each block's ops into
#: kernels with the recompute set solved with it (``search.exact``), where the stack compiles the
#: plan's own kernels, beside the named options; ``preset``, the named options alone
GRANULARITIES: tuple[str, ...] = ("op", "preset")

Progress = Callable[[int, int, str], None]


# --- the problem ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Defaults:
    """The default plan each space is optimised from (see the module doc for why these).

    ``fusion``: a fusion option (``search.space.FUSION_OPTIONS``); ``precision``: ``amp`` (autocast
    in the devices' 16-bit dtype) or ``fp32``. Remat (none) and parallel (DP over every GPU,
    ZeRO 0, microbatch 1) are ``PlanContext.default_plan``'s."""

    fusion: str = "eager"
    precision: str = "amp"

    def plan(self, ctx: PlanContext) -> Plan:
        from coplan.passes.precision import amp_precision
        from coplan.plan.types import PrecisionPlan
        from coplan.search.space import fusion_option

        if self.precision not in ("amp", "fp32"):
            raise ValueError(f"unknown default precision {self.precision!r}; amp or fp32")
        precision = amp_precision(ctx) if self.precision == "amp" else PrecisionPlan(compute="fp32")
        return ctx.default_plan().with_(fusion=fusion_option(ctx, self.fusion), precision=precision)

    def describe(self) -> dict[str, str]:
        return {
            "fusion": self.fusion,
            "remat": "none",
            "parallel": "data parallel over every GPU, ZeRO 0, microbatch 1",
            "precision": "bf16 autocast (fp16 with loss scaling, or fp32, where bf16 is missing)"
            if self.precision == "amp"
            else "fp32",
        }


@dataclass(frozen=True, slots=True)
class Scenario:
    """One training job: a model preset on ``gpus`` devices of a cluster preset, a global batch,
    the preset's sequence length (unless ``seq``), and a memory budget: ``loose`` is coplan's
    default (capacity x 0.95 - 1 GiB), ``tight`` and ``very-tight`` are half and a quarter of the
    capacity (``BUDGET_FRACTIONS``), and ``budget_gb`` (GiB per GPU), when given, overrides it."""

    model: str
    cluster: str
    gpus: int
    global_batch: int
    budget: str = "loose"
    seq: int | None = None
    budget_gb: float | None = None

    def __post_init__(self) -> None:
        if self.budget not in BUDGETS:
            raise ValueError(f"budget must be one of {', '.join(BUDGETS)}, got {self.budget!r}")

    @property
    def id(self) -> str:
        seq = f"/s{self.seq}" if self.seq else ""
        budget = f"{self.budget_gb:.4g}GiB" if self.budget_gb is not None else self.budget
        return f"{self.model}/{self.cluster}x{self.gpus}/gb{self.global_batch}{seq}/{budget}"

    def context(self) -> PlanContext:
        from coplan.cost import CostModel
        from coplan.cost.stacks import load_stack
        from coplan.hardware import load_cluster
        from coplan.models.spec import load_model_spec
        from coplan.plan import GiB, PlanContext

        spec = load_model_spec(self.model)
        hw = load_cluster(self.cluster, self.gpus)
        cap = min(d.memory_bytes for d in hw.devices)
        return PlanContext(
            CostModel(spec=spec),
            hw,
            global_batch=self.global_batch,
            seq=spec.resolve_seq(self.seq),
            budget_bytes=self.budget_gb * GiB
            if self.budget_gb is not None
            else cap * BUDGET_FRACTIONS[self.budget]
            if self.budget in BUDGET_FRACTIONS
            else None,
            # the study asks how the four decisions couple over every option the cost model
            # prices, not only what one executor runs
            stack=load_stack(STUDY_STACK),
        )


def _product(
    models: Sequence[str], machines: Sequence[tuple[str, int]], per_gpu: Sequence[int]
) -> tuple[Scenario, ...]:
    return tuple(
        Scenario(m, c, g, b * g, budget)
        for m in models
        for c, g in machines
        for b in per_gpu
        for budget in BUDGETS
    )


def grid(name: str) -> tuple[Scenario, ...]:
    """The scenarios of a named grid (``SpecError`` naming ``--grid`` for an unknown one).

    ``small`` (the default, minutes on two cores): GPT-2 124M, GPT-2 1.5B and LLaMA-2 7B on 1, 8
    and 32 H100s, 2 and 8 sequences per GPU, the three budgets (54 scenarios), and a mixture of
    experts (``moe-small``: 8 experts, top-2) on 1 and 8 H100s at the two tight budgets (8).
    ``full``: adds LLaMA-2 13B and 70B, A100-80GB, 64, 256 and 1,024 GPUs (hours on two cores).
    """
    if name == "small":
        dense = _product(
            ("gpt2-124m", "gpt2-1.5b", "llama2-7b"),
            (("dgx-h100", 1), ("dgx-h100", 8), ("dgx-h100", 32)),
            (2, 8),
        )
        moe = tuple(
            s
            for s in _product(("moe-small",), (("dgx-h100", 1), ("dgx-h100", 8)), (2, 8))
            if s.budget != "loose"
        )
        return dense + moe
    if name == "full":
        machines = tuple((c, g) for c in ("dgx-a100-80gb", "dgx-h100") for g in (1, 8, 64, 256, 1024))
        return _product(("gpt2-124m", "gpt2-1.5b", "llama2-7b", "llama2-13b", "llama2-70b"), machines, (2, 8))
    raise SpecError("--grid", None, f"must be one of {', '.join(GRIDS)}, got {name!r}")


# --- results -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Outcome:
    """One plan as the cost model prices it; ``gain`` = default step time / this step time, None
    when the plan does not fit its budget."""

    plan: Plan
    step_time_s: float
    tokens_per_s: float
    peak_bytes: float
    fits: bool
    gain: float | None

    def to_dict(self) -> dict[str, Any]:
        from coplan.plan import plan_summary

        return {
            "gain": self.gain,
            "fits": self.fits,
            "step_time_s": self.step_time_s,
            "tokens_per_s": self.tokens_per_s,
            "peak_bytes": self.peak_bytes,
            "plan": dict(plan_summary(self.plan)),
            "fingerprint": self.plan.fingerprint,
        }


def _better(x: Outcome, y: Outcome) -> Outcome:
    """The better plan: fitting before not fitting, then faster (ties: ``x``)."""
    kx = (not x.fits, x.step_time_s if x.fits else x.peak_bytes)
    ky = (not y.fits, y.step_time_s if y.fits else y.peak_bytes)
    return y if ky < kx else x


def interaction(joint: float | None, singles: Iterable[float | None]) -> float | None:
    """``(joint - 1) - sum(single - 1)``: how far the joint gain is from adding the single gains
    (None when any of them is undefined)."""
    s = list(singles)
    if joint is None or any(g is None for g in s):
        return None
    return (joint - 1) - sum(g - 1 for g in s if g is not None)


def interaction_ratio(joint: float | None, singles: Iterable[float | None]) -> float | None:
    """``joint / prod(single)``: the interaction of throughput ratios, which compose by
    multiplication (two independent 1.2x speedups give 1.44x, an additive interaction of +0.04
    with no coupling at all); 1 means the gains are independent (None when undefined)."""
    s = list(singles)
    if joint is None or any(g is None for g in s):
        return None
    return joint / math.prod(g for g in s if g is not None)


def ratio(seq: Outcome, joint: Outcome) -> float | None:
    """Joint's throughput over sequential's (None unless both fit)."""
    if not (seq.fits and joint.fits):
        return None
    return seq.step_time_s / joint.step_time_s


class _Compared:
    """What a pair's and all four spaces' results share: the interaction of the joint gain with
    the single-space gains, joint over the best sequential order, and whether only joint fits.
    Subclasses provide ``joint``, ``sequential`` and ``single_outcomes`` (one per space compared)."""

    __slots__ = ()
    joint: Outcome
    sequential: Outcome

    if TYPE_CHECKING:  # a declaration for the type checker; each subclass defines the property

        @property
        def single_outcomes(self) -> tuple[Outcome, ...]: ...

    def single_gains(self) -> tuple[float | None, ...]:
        return tuple(o.gain for o in self.single_outcomes)

    @property
    def interaction(self) -> float | None:
        return interaction(self.joint.gain, self.single_gains())

    @property
    def interaction_ratio(self) -> float | None:
        return interaction_ratio(self.joint.gain, self.single_gains())

    @property
    def coupling(self) -> float | None:
        return ratio(self.sequential, self.joint)

    @property
    def feasibility_coupled(self) -> bool:
        return self.joint.fits and not self.sequential.fits


@dataclass(frozen=True, slots=True)
class PairResult(_Compared):
    a: str
    b: str
    single_a: Outcome
    single_b: Outcome
    a_then_b: Outcome
    b_then_a: Outcome
    joint: Outcome
    joint_from_warm_start: bool

    @property
    def name(self) -> str:
        return f"{self.a}+{self.b}"

    @property
    def sequential(self) -> Outcome:  # type: ignore[override]
        return _better(self.a_then_b, self.b_then_a)

    @property
    def single_outcomes(self) -> tuple[Outcome, ...]:
        return (self.single_a, self.single_b)

    def to_dict(self) -> dict[str, Any]:
        return {
            "a": self.a,
            "b": self.b,
            "single_a": self.single_a.gain,
            "single_b": self.single_b.gain,
            "sequential": self.sequential.gain,
            "joint": self.joint.gain,
            "interaction": self.interaction,
            "interaction_ratio": self.interaction_ratio,
            "a_then_b": self.a_then_b.gain,
            "b_then_a": self.b_then_a.gain,
            "joint_over_sequential": self.coupling,
            "feasibility_coupled": self.feasibility_coupled,
            "joint_from_warm_start": self.joint_from_warm_start,
            "plans": {
                k: getattr(self, k).to_dict()
                for k in ("single_a", "single_b", "a_then_b", "b_then_a", "joint")
            },
        }


@dataclass(frozen=True, slots=True)
class All4Result(_Compared):
    singles: tuple[Outcome, ...]  # one per space, in SPACES order
    sequential: Outcome  # the best of the 24 orders
    best_order: tuple[str, ...]
    default_order: Outcome  # fusion -> remat -> parallel -> precision
    joint: Outcome
    joint_from_warm_start: bool

    @property
    def single_outcomes(self) -> tuple[Outcome, ...]:
        return self.singles

    def to_dict(self) -> dict[str, Any]:
        return {
            "singles": {s: o.gain for s, o in zip(SPACES, self.singles, strict=True)},
            "sequential": self.sequential.gain,
            "joint": self.joint.gain,
            "interaction": self.interaction,
            "interaction_ratio": self.interaction_ratio,
            "sequential_order": list(self.best_order),
            "sequential_default_order": self.default_order.gain,
            "joint_over_sequential": self.coupling,
            "feasibility_coupled": self.feasibility_coupled,
            "joint_from_warm_start": self.joint_from_warm_start,
            "plans": {
                "sequential": self.sequential.to_dict(),
                "sequential_default_order": self.default_order.to_dict(),
                "joint": self.joint.to_dict(),
            },
        }


@dataclass(frozen=True, slots=True)
class ScenarioResult:
    scenario: Scenario
    params: int
    seq: int
    budget_bytes: float
    default: Outcome
    pairs: tuple[PairResult, ...]  # in PAIRS order
    all4: All4Result
    invalid_plans: tuple[str, ...]  # structural checker violations (a planner bug if any)
    plans_checked: int
    searches: int
    seconds: float

    def pair(self, name: str) -> PairResult:
        return self.pairs[PAIR_NAMES.index(name)]

    def to_dict(self) -> dict[str, Any]:
        sc = self.scenario
        return {
            "id": sc.id,
            "model": sc.model,
            "params": self.params,
            "cluster": sc.cluster,
            "gpus": sc.gpus,
            "global_batch": sc.global_batch,
            "seq": self.seq,
            "budget": sc.budget,
            "budget_bytes": self.budget_bytes,
            "baseline_fits": self.default.fits,
            "default": self.default.to_dict(),
            "pairs": {p.name: p.to_dict() for p in self.pairs},
            "all4": self.all4.to_dict(),
            "plans_checked": self.plans_checked,
            "invalid_plans": list(self.invalid_plans),
            "searches": self.searches,
            "seconds": self.seconds,
        }


# --- planning one scenario -----------------------------------------------------------------------


class _Searcher:
    """Restricted searches on one scenario's context, memoised by (spaces searched, base plan,
    warm starts): orders sharing a prefix, and pairs sharing a single-space step, plan it once
    (and the context memoises every price)."""

    def __init__(self, ctx: PlanContext, reference_s: float, granularity: str = "op") -> None:
        self.ctx = ctx
        self.per_op = granularity == "op"
        self.reference_s = reference_s
        self.memo: dict[tuple[object, ...], StrategyResult] = {}
        self.invalid: list[str] = []
        self.checked: set[str] = set()

    def optimise(self, free: Iterable[str], base: Plan, warm: Sequence[Plan] = ()) -> StrategyResult:
        from coplan.search import Options, SearchSpace, run_strategy
        from coplan.search.space import FUSION_OPTIONS

        free_set = frozenset(free)
        key = (free_set, base.fingerprint, tuple(p.fingerprint for p in warm))
        got = self.memo.get(key)
        if got is None:
            space = SearchSpace(fusion=FUSION_OPTIONS, fixed=frozenset(SPACES) - free_set, per_op=self.per_op)
            got = run_strategy("joint", self.ctx, Options(space=space, base=base, warm=list(warm)))
            self.record(got.plan, [str(v) for v in got.violations if v.level == "structure"])
            self.memo[key] = got
        return got

    def sequence(self, base: Plan, order: Sequence[str]) -> StrategyResult:
        """Each space of ``order`` optimised in turn, keeping the earlier ones' decisions."""
        plan, res = base, None
        for space in order:
            res = self.optimise([space], plan)
            plan = res.plan
        assert res is not None
        return res

    def record(self, plan: Plan, problems: list[str]) -> None:
        self.checked.add(plan.fingerprint)
        self.invalid.extend(f"{plan.fingerprint}: {p}" for p in problems)

    def outcome(self, plan: Plan) -> Outcome:
        est = self.ctx.price(plan)
        fits = self.ctx.fits(est)
        gain = self.reference_s / est.step_time_s if fits else None
        return Outcome(plan, est.step_time_s, est.tokens_per_s, est.memory.peak_bytes, fits, gain)


def run_scenario(
    scenario: Scenario, defaults: Defaults = Defaults(), *, warm_start: bool = True, granularity: str = "op"
) -> ScenarioResult:
    """Plan ``scenario`` every way the study compares (see the module doc). ``warm_start`` False
    runs each joint search cold (tests: to check that the search alone is never worse than
    sequential where that is guaranteed); ``granularity``: ``GRANULARITIES``."""
    if granularity not in GRANULARITIES:
        raise SpecError(
            "--granularity", None, f"must be one of {', '.join(GRANULARITIES)}, got {granularity!r}"
        )
    from coplan.plan.checker import check

    t0 = time.perf_counter()
    ctx = scenario.context()
    base = defaults.plan(ctx)
    est0 = ctx.price(base)  # raises ConfigError when the job itself is impossible
    s = _Searcher(ctx, est0.step_time_s, granularity)
    s.record(base, [str(v) for v in check(base, ctx) if v.level == "structure"])
    default = s.outcome(base)

    singles = {a: s.optimise([a], base) for a in SPACES}
    pairs = []
    for a, b in PAIRS:
        ab, ba = s.sequence(base, (a, b)), s.sequence(base, (b, a))
        warm = (ab.plan, ba.plan) if warm_start else ()
        j = s.optimise([a, b], base, warm)
        pairs.append(
            PairResult(
                a,
                b,
                s.outcome(singles[a].plan),
                s.outcome(singles[b].plan),
                s.outcome(ab.plan),
                s.outcome(ba.plan),
                s.outcome(j.plan),
                j.plan.fingerprint in {ab.plan.fingerprint, ba.plan.fingerprint},
            )
        )

    orders = list(itertools.permutations(SPACES))
    ends = {o: s.outcome(s.sequence(base, o).plan) for o in orders}
    best_order = orders[0]
    for o in orders[1:]:
        if _better(ends[best_order], ends[o]) is not ends[best_order]:
            best_order = o
    seq4 = ends[best_order]
    warm4 = [seq4.plan, *(p.joint.plan for p in pairs)] if warm_start else []
    j4 = s.optimise(SPACES, base, warm4)
    all4 = All4Result(
        singles=tuple(s.outcome(singles[a].plan) for a in SPACES),
        sequential=seq4,
        best_order=best_order,
        default_order=ends[SPACES],
        joint=s.outcome(j4.plan),
        joint_from_warm_start=j4.plan.fingerprint in {p.fingerprint for p in warm4},
    )
    spec = ctx.model.spec
    return ScenarioResult(
        scenario=scenario,
        params=spec.param_count() if spec is not None else 0,
        seq=ctx.seq,
        budget_bytes=ctx.budget,
        default=default,
        pairs=tuple(pairs),
        all4=all4,
        invalid_plans=tuple(s.invalid),
        plans_checked=len(s.checked),
        searches=len(s.memo),
        seconds=time.perf_counter() - t0,
    )


# --- the study -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Study:
    grid: str
    defaults: Defaults
    scenarios: tuple[ScenarioResult, ...]
    seconds: float
    #: scenarios the grid has (None: as many as ``scenarios``); more when the study was interrupted
    total: int | None = None
    granularity: str = "op"

    def __post_init__(self) -> None:
        if self.total is not None and self.total < len(self.scenarios):
            raise ValueError(f"total {self.total} < the {len(self.scenarios)} scenarios given")

    @property
    def partial(self) -> bool:
        """Whether the study was stopped before every scenario of its grid was planned."""
        return self.total is not None and len(self.scenarios) < self.total


def _run_one(job: tuple[Scenario, Defaults, bool, str]) -> ScenarioResult:
    sc, defaults, warm_start, granularity = job
    return run_scenario(sc, defaults, warm_start=warm_start, granularity=granularity)


def run_study(
    scenarios: str | Sequence[Scenario],
    defaults: Defaults = Defaults(),
    progress: Progress | None = None,
    *,
    warm_start: bool = True,
    jobs: int = 1,
    granularity: str = "op",
) -> Study:
    """Every scenario of a grid (by name, or given); results in grid order. Scenarios are
    independent, so ``jobs`` > 1 plans them in that many worker processes (each with its own
    contexts and memo: nothing is shared but the inputs and the results).
    ``progress(done, total, label)`` is called as scenarios start (one process) or finish.
    Interrupted (Ctrl-C), it stops the workers and returns the scenarios that finished
    (``Study.partial``)."""
    name = scenarios if isinstance(scenarios, str) else "custom"
    todo = grid(scenarios) if isinstance(scenarios, str) else tuple(scenarios)
    t0 = time.perf_counter()
    if granularity not in GRANULARITIES:
        raise SpecError(
            "--granularity", None, f"must be one of {', '.join(GRANULARITIES)}, got {granularity!r}"
        )
    work = [(sc, defaults, warm_start, granularity) for sc in todo]
    jobs = max(1, min(jobs, len(todo)))
    out: list[ScenarioResult | None] = [None] * len(todo)
    try:
        if jobs == 1:
            for i, w in enumerate(work):
                if progress:
                    progress(i, len(todo), w[0].id)
                out[i] = _run_one(w)
        else:
            from concurrent.futures import as_completed

            # forked when the pool starts, before the caller's progress bar (a thread) is first drawn
            with procs.Pool(jobs) as pool:
                futures = {pool.submit(_run_one, w): i for i, w in enumerate(work)}
                for done, fut in enumerate(as_completed(futures)):
                    i = futures[fut]
                    out[i] = fut.result()
                    if progress:
                        progress(done + 1, len(todo), todo[i].id)
    except KeyboardInterrupt:
        pass  # the pool has ended its workers; what finished is kept
    else:
        if progress:
            progress(len(todo), len(todo), "done")
    results = tuple(r for r in out if r is not None)
    return Study(name, defaults, results, time.perf_counter() - t0, len(todo), granularity)
