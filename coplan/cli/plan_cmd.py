"""``coplan plan`` and ``coplan compare``: plan a training job, or compare strategies on it.

Exit codes: 0 a fitting plan; 2 bad input (one line on stderr); 3 infeasible (nothing fits the
memory budget: the least-memory plan found is reported with the reason).
"""

from __future__ import annotations

import enum
import math
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich import box
from rich.markup import escape
from rich.table import Table

from coplan.cli.common import human_bytes, human_rate, mfu_words, positive, print_json, show_trust, stdout
from coplan.cli.options import (
    DEFAULT_CLUSTER,
    DEFAULT_GPUS,
    DEFAULT_MODEL,
    BudgetOpt,
    ClusterOpt,
    GlobalBatchOpt,
    GpusOpt,
    HtmlOpt,
    JsonOpt,
    ModelOpt,
    SeqOpt,
    StackFileOpt,
    StackOpt,
    Strategy,
    default_global_batch,
    resolve_stack,
)
from coplan.errors import CoplanError, SpecError
from coplan.fileio import check_output, write_text

if TYPE_CHECKING:
    from coplan.cost.envelope import Validated
    from coplan.cost.stacks import StackSpec
    from coplan.plan.context import PlanContext
    from coplan.plan.emit import Emitted
    from coplan.search.result import StrategyResult


class Infeasible(CoplanError):
    """Nothing fits the memory budget: an answer, not a crash."""

    exit_code = 3


OrderOpt = Annotated[
    str | None,
    typer.Option("--order", help="Pass order for 'sequential', e.g. remat,fusion,parallel,precision."),
]
ToleranceOpt = Annotated[
    float,
    typer.Option(
        "--tolerance",
        help="Relative error allowed per op when lowering numerically sensitive ops below fp32 [0: never].",
    ),
]
DtypesOpt = Annotated[
    str | None,
    typer.Option(
        "--dtypes",
        help="Compute dtypes the search may use, comma-separated (e.g. bf16,fp32) "
        "\\[default: every dtype the devices run natively].",
        show_default=False,
    ),
]
OutOpt = Annotated[
    Path | None,
    typer.Option("--out", "-o", help="Write the chosen plan as JSON here (coplan run --plan reads it)."),
]


def check_job(
    gpus: int,
    global_batch: int | None,
    seq: int | None,
    budget_gb: float | None,
    tolerance: float,
) -> None:
    """The job's numbers, checked before anything is loaded (a model can take seconds)."""
    positive("--gpus", gpus)
    positive("--global-batch", global_batch, optional=True)
    positive("--seq", seq, optional=True)
    if budget_gb is not None and not (budget_gb > 0 and math.isfinite(budget_gb)):
        raise SpecError(
            "--memory-budget-gb", None, f"must be a positive, finite number of GiB, got {budget_gb!r}"
        )
    if not (tolerance >= 0 and math.isfinite(tolerance)):
        raise SpecError("--tolerance", None, f"must be a finite number >= 0, got {tolerance!r}")


def make_context(
    model: str,
    cluster: str,
    gpus: int,
    global_batch: int | None,
    seq: int | None,
    budget_gb: float | None,
    tolerance: float,
    stack: StackSpec | None = None,
    dtypes: tuple[str, ...] | None = None,
) -> PlanContext:
    from coplan.cost import CostModel
    from coplan.cost.stacks import load_stack
    from coplan.hardware import load_cluster
    from coplan.models.spec import load_model_spec
    from coplan.plan import GiB, Numerics, PlanContext

    check_job(gpus, global_batch, seq, budget_gb, tolerance)
    spec = load_model_spec(model)
    hw = load_cluster(cluster, gpus)
    return PlanContext(
        CostModel(spec=spec),
        hw,
        global_batch=global_batch or default_global_batch(gpus),
        seq=spec.resolve_seq(seq),
        budget_bytes=budget_gb * GiB if budget_gb is not None else None,
        numerics=Numerics(tolerance),
        stack=stack if stack is not None else load_stack("megatron"),
        dtypes=dtypes,
    )


class _Bar:
    """A Rich progress bar on stderr that appears only once a search has run for a second."""

    def __init__(self) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.t0 = time.perf_counter()
        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=Console(file=sys.stderr),
            transient=True,
        )
        self.started = False
        # a bar is for people watching a terminal; redirected stderr keeps only the error line
        self.enabled = sys.stderr.isatty()
        self.tasks: dict[str, Any] = {}

    def __call__(self, name: str, done: int, total: int) -> None:
        if not self.enabled:
            return
        if not self.started:
            if time.perf_counter() - self.t0 < 1.0:
                return
            self.progress.start()
            self.started = True
        task = self.tasks.get(name)
        if task is None:
            task = self.tasks[name] = self.progress.add_task(name, total=total)
        self.progress.update(task, completed=done + 1, total=total)

    def close(self) -> None:
        if self.started:
            self.progress.stop()


def _runnable_dtypes(ctx: PlanContext, kinds: tuple[str, ...] | None) -> None:
    """Refuse ``--dtypes`` when the stack on these devices runs none of them natively (the search
    would otherwise fall back to the default plan without saying so)."""
    if kinds is None:
        return
    native = ctx.device_dtypes

    def why(d: str) -> str | None:
        if d not in native:  # tf32 too: the devices that have it list it (SearchSpace.precisions)
            return f"{ctx.cluster.name}'s devices have no {d} units"
        if d == "fp8" and not ctx.stack.runs_fp8:
            how = "emulates fp8" if ctx.stack.fp8 == "emulated" else "runs no fp8"
            return f"stack {ctx.stack.name!r} {how}"
        return None

    reasons = [(d, why(d)) for d in kinds]
    if all(r is not None for _, r in reasons):
        raise SpecError("--dtypes", None, "; ".join(f"{d}: {r}" for d, r in reasons) + " (nothing to search)")


def _dtypes(dtypes: str | None) -> tuple[str, ...] | None:
    if dtypes is None:
        return None
    from coplan.plan.types import COMPUTE_DTYPES

    got = tuple(d.strip() for d in dtypes.split(",") if d.strip())
    bad = [d for d in got if d not in COMPUTE_DTYPES]
    if bad or not got:
        raise SpecError(
            "--dtypes", None, f"must be a comma-separated list of {', '.join(COMPUTE_DTYPES)}, got {dtypes!r}"
        )
    return got


def run_all(
    ctx: PlanContext,
    names: list[str],
    order: list[str] | None,
    dtypes: tuple[str, ...] | None = None,
    policy: Path | None = None,
) -> dict[str, StrategyResult]:
    import coplan.learn.strategy  # noqa: F401  (registers the learned strategies)
    from coplan.search import STRATEGIES, Options, run_strategy
    from coplan.search.space import SearchSpace

    unknown = [n for n in names if n not in STRATEGIES]
    if unknown:
        raise SpecError(
            "--strategy", None, f"unknown strategy {unknown[0]!r}; choose from {', '.join(STRATEGIES)}"
        )
    if any(n.startswith("learned") for n in names):
        from coplan.learn.decode import default_policy

        default_policy(policy)  # loaded (PyTorch Geometric imported) before planning is timed
    bar = _Bar()
    results: dict[str, StrategyResult] = {}
    try:
        # joint is warm-started from whatever else was asked for, so it runs last
        for name in sorted(names, key=lambda n: n == "joint"):
            opts = Options(progress=bar, policy=policy)
            if dtypes is not None:
                opts.space = SearchSpace(dtypes=dtypes)
            if order:
                opts.order = order
            if name == "joint":
                # warm starts seed joint's incumbent: only plans inside the space it may return
                opts.warm = [
                    r.plan for r in results.values() if dtypes is None or r.plan.precision.compute in dtypes
                ]
            bar(name, -1, 1)
            results[name] = run_strategy(name, ctx, opts)
    finally:
        bar.close()
    return {n: results[n] for n in names}


def _order(order: str | None) -> list[str] | None:
    if order is None:
        return None
    from coplan.passes import PASSES

    steps = [s.strip() for s in order.replace("->", ",").split(",") if s.strip()]
    bad = [s for s in steps if s not in PASSES]
    if bad or sorted(steps) != sorted(PASSES):
        raise SpecError(
            "--order",
            None,
            f"must name each of {', '.join(PASSES)} once (e.g. remat,fusion,parallel,precision), "
            f"got {order!r}",
        )
    return steps


def _why_infeasible(ctx: PlanContext, r: StrategyResult) -> str:
    mem = r.estimate.memory
    return (
        f"nothing fits: the least-memory plan found ({r.plan.parallel.describe()}, "
        f"{len(r.plan.remat.all_names)} tensors recomputed, {r.plan.precision.compute}) needs "
        f"{human_bytes(mem.peak_bytes)} on its most loaded GPU (params {human_bytes(mem.params_bytes)}, "
        f"optimizer {human_bytes(mem.optimizer_bytes)}, activations {human_bytes(mem.activations_bytes)}) "
        f"against a budget of {human_bytes(ctx.budget)}"
    )


def _header(ctx: PlanContext) -> str:
    return (
        f"[bold]{ctx.model_name}[/bold] on {ctx.cluster.summary()}, global batch {ctx.global_batch} "
        f"x seq {ctx.seq}, budget {human_bytes(ctx.budget)}/GPU, planned for the {ctx.stack.name} stack"
    )


def _entry(ctx: PlanContext, r: StrategyResult) -> dict[str, Any]:
    d = r.to_dict()
    keys = (
        "step_time_s",
        "tokens_per_s",
        "mfu",
        "mfu_dtype_peak",
        "peak_bytes",
        "fits",
        "plan_time_s",
        "plan",
    )
    trust = _trust(ctx, r)
    out = (
        {k: d[k] for k in keys}
        | {k: d[k] for k in ("evaluations", "violations", "notes", "passes")}
        | {"validated": trust.to_dict(), "decisions": _op_decisions(ctx, r)}
    )
    if trust.cautions:
        # what qualifies the price, inside the envelope or not (``Validated.cautions``)
        out["cautions"] = list(trust.cautions)
    if ctx.stack.compile_preset or ctx.stack.kernels == "inductor":
        # a PyTorch stack with a compile flag (or one that always compiles): whether the plan's
        # step runs under torch.compile (``StackSpec.kernels_for``)
        out["compile"] = ctx.kernels_stack(r.plan).kernels == "inductor"
    return out


def _op_decisions(ctx: PlanContext, r: StrategyResult) -> dict[str, Any]:
    """The plan's per-op decisions counted for one block (``plan.decisions``)."""
    from coplan.plan.decisions import block_decisions

    return block_decisions(r.plan, ctx.index.graph)


def _trust(ctx: PlanContext, r: StrategyResult) -> Validated:
    """Whether the plan's configuration lies inside what the cost model was validated on."""
    from coplan.plan.capabilities import validated_plan

    return validated_plan(ctx, r.plan, r.estimate)


def _mfu(r: StrategyResult) -> str:
    return f"{r.estimate.mfu:.1%}"


def _figures(ctx: PlanContext, results: dict[str, StrategyResult], title: str) -> Table:
    """One row per strategy; short headers with their units so the table fits 80 columns."""
    base = results.get("sequential")
    # collapsed padding: eight columns with 15-character strategy names fit 80 characters
    table = Table(
        box=box.SIMPLE_HEAD, title=title, title_justify="left", pad_edge=False, collapse_padding=True
    )
    for col in ("strategy", "step ms", "tokens/s", "MFU", "peak", "fits", "gain", "plan s"):
        table.add_column(col, justify="left" if col == "strategy" else "right", no_wrap=True)
    for n, r in results.items():
        e = r.estimate
        gain = (
            f"{base.step_time_s / e.step_time_s:.3f}x" if base is not None and r.fits and base.fits else "-"
        )
        table.add_row(
            n if _trust(ctx, r).inside else f"{n} [yellow]*[/yellow]",
            f"{e.step_time_s * 1e3:.2f}",
            human_rate(e.tokens_per_s),
            _mfu(r),
            human_bytes(e.memory.peak_bytes),
            "yes" if r.fits else "[red]no[/red]",
            gain,
            f"{r.plan_time_s:.2f}",
        )
    return table


def _decisions(ctx: PlanContext, results: dict[str, StrategyResult]) -> Table:
    """What each strategy decided, one labelled line per decision (legible at any width);
    strategies that decided the same as an earlier one say so instead of repeating it."""
    from coplan.plan import plan_summary
    from coplan.plan.context import policy_sets

    grid = Table.grid(padding=(0, 2))
    grid.add_column(no_wrap=True, style="bold")
    grid.add_column(overflow="fold")
    seen: dict[str, str] = {}
    for n, r in results.items():
        if r.plan.fingerprint in seen:
            grid.add_row(n, f"the same plan as {seen[r.plan.fingerprint]}")
            continue
        seen[r.plan.fingerprint] = n
        s = plan_summary(r.plan, r.estimate, ctx.index, policy_sets(ctx))
        grid.add_row(n, s["parallel"])
        grid.add_row("", s["remat"])
        grid.add_row("", f"{s.get('kernels', '')}; {s['fusion']}".lstrip("; "))
        grid.add_row("", s["precision"])
    return grid


def _footer(console: Any) -> None:
    console.print(
        "[dim]step ms: one optimizer step; MFU: model FLOPs per second per GPU over the device's "
        "16-bit dense peak (causal attention counted at half); peak: memory of the most loaded GPU; "
        "gain: throughput over 'sequential'; *: extrapolated beyond the published runs the cost "
        "model was checked on (--json: validated)[/dim]",
        soft_wrap=False,
    )


#: Stacks whose plans coplan's runner executes as planned: its own, and ``open`` (every option the
#: cost model prices, whose fusion groups the runner compiles one by one).
RUNNER_STACKS = ("coplan", "open")


def _how_to_run(console: Any, ctx: PlanContext, out: Path | None, model: str) -> None:
    """``model`` as the user named it (a preset, or the spec file coplan run must read too)."""
    target = str(out) if out is not None else "plan.json"
    first = "" if out is not None else f"coplan plan ... --out {target} && "
    stack = ctx.stack.name
    recipe = "megatron" if stack == "megatron" else "torchtitan" if stack.startswith("torchtitan") else None
    if recipe is not None:
        # the plan was made for that stack: its own recipe runs it as planned
        console.print(
            f"to train under this plan: coplan plan ... --emit {recipe} prints the {stack} recipe that "
            "runs it; to train with coplan's own PyTorch runner, plan with --stack coplan and "
            "pass the plan to coplan run",
            soft_wrap=False,
        )
        return
    if stack not in RUNNER_STACKS:
        # made for a stack coplan writes no recipe for: its runner would run other kernels
        console.print(
            f"to train under this plan: coplan writes no {stack} recipe; to train with coplan's own "
            "PyTorch runner, plan with --stack coplan and pass the plan to coplan run",
            soft_wrap=False,
        )
        return
    console.print(
        f"to train under this plan: {first}coplan run --model {model} --plan {target} "
        f"--nproc {ctx.gpus} --steps 10; --emit megatron or --emit torchtitan prints those stacks' recipe",
        soft_wrap=False,
    )


def _write_outputs(
    ctx: PlanContext,
    results: dict[str, StrategyResult],
    chosen: StrategyResult,
    out: Path | None,
    html: Path | None,
) -> list[str]:
    """Write ``--out`` and ``--html`` (paths checked before the search); what was written, in words."""
    written = []
    if out is not None:
        write_text(out, chosen.plan.to_json() + "\n", "--out")
        written.append(f"plan written to {out}")
    if html is not None:
        from coplan.cli.report import write_html

        write_html(html, ctx, results)
        written.append(f"report written to {html}")
    return written


class Emit(enum.StrEnum):  # coplan.plan.emit.TARGETS
    megatron = "megatron"
    torchtitan = "torchtitan"
    coplan = "coplan"


def _emit(ctx: PlanContext, r: StrategyResult, target: Emit, out: Path | None, model: str) -> Emitted:
    from coplan.plan.context import policy_sets
    from coplan.plan.emit import emit

    spec = ctx.model.spec
    if spec is None:  # pragma: no cover - the CLI always plans a spec
        raise SpecError("--emit", None, "needs a model spec")
    # the checkpointing policy of the stack whose set the plan recomputes, which a recipe names
    rec = r.plan.remat.recompute
    policy = next((k for k, v in policy_sets(ctx).items() if rec and v == rec), None)
    return emit(
        r.plan,
        spec,
        target.value,
        plan_path=str(out) if out is not None else "plan.json",
        model=model,
        async_tp=ctx.kernels_stack(r.plan).async_tp,
        policy=policy,
    )


class WarmStart(enum.StrEnum):
    learned = "learned"


PolicyOpt = Annotated[
    Path | None,
    typer.Option(
        "--policy",
        help="The learned strategies' network (coplan learn train --out) \\[default: the one coplan ships].",
        show_default=False,
    ),
]


def _check_policy(policy: Path | None, names: list[str]) -> None:
    """Before any work: ``--policy`` only with a learned strategy, and a file that loads."""
    if policy is None:
        return
    if not any(n.startswith("learned") for n in names):
        raise SpecError(
            "--policy", None, "applies to the learned strategies (learned, learned-greedy, learned-search)"
        )
    from coplan.learn.decode import default_policy

    default_policy(policy)


def _strategy_names(strategies: str) -> list[str]:
    names = [s.strip() for s in strategies.split(",") if s.strip()]
    known = [s.value for s in Strategy]
    bad = [n for n in names if n not in known]
    if not names or bad:
        raise SpecError(
            "--strategies",
            None,
            f"unknown strategy {bad[0]!r}; choose from {', '.join(known)}"
            if bad
            else f"name at least one of {', '.join(known)}",
        )
    return names


def plan(
    model: ModelOpt = DEFAULT_MODEL,
    cluster: ClusterOpt = DEFAULT_CLUSTER,
    gpus: GpusOpt = DEFAULT_GPUS,
    global_batch: GlobalBatchOpt = None,
    seq: SeqOpt = None,
    memory_budget_gb: BudgetOpt = None,
    strategy: Annotated[Strategy, typer.Option("--strategy", help="The planning strategy.")] = Strategy.joint,
    order: OrderOpt = None,
    tolerance: ToleranceOpt = 0.0,
    dtypes: DtypesOpt = None,
    out: OutOpt = None,
    html: HtmlOpt = None,
    stack: StackOpt = None,
    stack_file: StackFileOpt = None,
    emit: Annotated[
        Emit | None,
        typer.Option(
            "--emit",
            help="Also print what runs the plan: Megatron-LM arguments, a torchtitan TOML, or the coplan run "
            "command and Python snippet.",
            show_default=False,
        ),
    ] = None,
    policy: PolicyOpt = None,
    warm_start: Annotated[
        WarmStart | None,
        typer.Option(
            "--warm-start",
            help="Joint: also seed the search with this strategy's plan (learned: the policy's).",
            show_default=False,
        ),
    ] = None,
    json: JsonOpt = False,
) -> None:
    """Plan fusion, recomputation, parallelism and precision of a training job."""
    from coplan.plan import plan_summary
    from coplan.plan.context import policy_sets

    name = strategy.value
    steps, kinds = _order(order), _dtypes(dtypes)
    check_output("--out", out)
    check_output("--html", html)
    _check_policy(policy, [name, *(["learned"] if warm_start is not None else [])])
    the_stack = resolve_stack(stack, stack_file)
    ctx = make_context(model, cluster, gpus, global_batch, seq, memory_budget_gb, tolerance, the_stack, kinds)
    _runnable_dtypes(ctx, kinds)
    names = [name]
    if name == "joint":
        names = ["sequential", "hierarchical", "joint"]  # warm starts for joint
        if warm_start is WarmStart.learned:
            names.insert(0, "learned")
    elif warm_start is not None:
        raise SpecError("--warm-start", None, "applies to --strategy joint")
    results = run_all(ctx, names, steps, kinds, policy)
    r = results[name]
    # an infeasible answer writes nothing: a plan that does not fit is not one to run
    written = _write_outputs(ctx, results, r, out, html) if r.fits else []
    if json:
        body = {
            "model": ctx.model_name,
            "cluster": ctx.cluster.name,
            "gpus": ctx.gpus,
            "global_batch": ctx.global_batch,
            "seq": ctx.seq,
            "budget_bytes": ctx.budget,
            "strategy": name,
            **_entry(ctx, r),
        }
        if not r.fits:
            body["reason"] = _why_infeasible(ctx, r)
        body["stack"] = ctx.stack.name
        if emit is not None and r.fits:
            recipe = _emit(ctx, r, emit, out, model)
            body["emit"] = {"target": recipe.target, "text": recipe.text, "notes": list(recipe.notes)}
        print_json(body)
    else:
        console = stdout()
        console.print(_header(ctx), soft_wrap=False)
        table = Table(
            box=box.SIMPLE,
            show_header=False,
            title=f"plan ({name}, {r.plan_time_s:.2f} s, {r.evaluations:,} plans priced)",
            title_justify="left",
            pad_edge=False,
        )
        table.add_column("", no_wrap=True)
        table.add_column("", overflow="fold")
        e = r.estimate
        table.add_row("step time", f"{e.step_time_s * 1e3:.2f} ms")
        table.add_row("tokens/s", f"{e.tokens_per_s:,.0f}")
        table.add_row("MFU", mfu_words(e))
        table.add_row("peak memory", f"{human_bytes(e.memory.peak_bytes)} (stage {e.memory.stage})")
        for k, v in plan_summary(r.plan, e, ctx.index, policy_sets(ctx)).items():
            table.add_row(k, v)
        table.add_row("fingerprint", r.plan.fingerprint)
        console.print(table)
        show_trust(console, _trust(ctx, r))
        seq_r = results.get("sequential")
        if seq_r is not None and name != "sequential" and seq_r.fits and r.fits:
            console.print(
                f"production passes in sequence (fusion -> remat -> parallel -> precision): "
                f"{seq_r.step_time_s * 1e3:.2f} ms; {name} is "
                f"{seq_r.step_time_s / r.step_time_s:.3f}x their throughput",
                soft_wrap=False,
            )
        for note in r.notes:
            console.print(f"[dim]{escape(note)}[/dim]", soft_wrap=False)
        for line in written:
            console.print(line, soft_wrap=False)
        if r.fits and emit is not None:
            recipe = _emit(ctx, r, emit, out, model)
            console.print(f"\n[bold]to run it with {recipe.target}[/bold]:")
            console.print(recipe.text, soft_wrap=True, markup=False, highlight=False)
            for note in recipe.notes:
                # a note may name a recipe's [section]: printed as written, not as Rich markup
                console.print(f"[dim]note: {escape(note)}[/dim]", soft_wrap=False)
        elif r.fits:
            _how_to_run(console, ctx, out, model)
    if not r.fits:
        raise Infeasible(_why_infeasible(ctx, r))


def compare(
    model: ModelOpt = DEFAULT_MODEL,
    cluster: ClusterOpt = DEFAULT_CLUSTER,
    gpus: GpusOpt = DEFAULT_GPUS,
    global_batch: GlobalBatchOpt = None,
    seq: SeqOpt = None,
    memory_budget_gb: BudgetOpt = None,
    strategies: Annotated[
        str,
        typer.Option(
            "--strategies",
            help=f"Comma-separated strategies to compare, of: {', '.join(s.value for s in Strategy)}.",
        ),
    ] = "sequential,sequential-best,iterated,hierarchical,joint",
    order: OrderOpt = None,
    tolerance: ToleranceOpt = 0.0,
    dtypes: DtypesOpt = None,
    out: Annotated[
        Path | None,
        typer.Option("--out", "-o", help="Write the fastest fitting strategy's plan as JSON here."),
    ] = None,
    html: HtmlOpt = None,
    stack: StackOpt = None,
    stack_file: StackFileOpt = None,
    policy: PolicyOpt = None,
    json: JsonOpt = False,
) -> None:
    """Compare planning strategies on one job, all priced by the same cost model."""
    names = _strategy_names(strategies)
    steps, kinds = _order(order), _dtypes(dtypes)
    check_output("--out", out)
    check_output("--html", html)
    _check_policy(policy, names)
    the_stack = resolve_stack(stack, stack_file)
    ctx = make_context(model, cluster, gpus, global_batch, seq, memory_budget_gb, tolerance, the_stack, kinds)
    _runnable_dtypes(ctx, kinds)
    results = run_all(ctx, names, steps, kinds, policy)
    fitting = [r for r in results.values() if r.fits]
    best = min(fitting, key=lambda r: r.step_time_s) if fitting else None
    written = _write_outputs(ctx, results, best, out, html) if best is not None else []
    if json:
        print_json(
            {
                "model": ctx.model_name,
                "cluster": ctx.cluster.name,
                "gpus": ctx.gpus,
                "global_batch": ctx.global_batch,
                "seq": ctx.seq,
                "budget_bytes": ctx.budget,
                "stack": ctx.stack.name,
                "strategies": {n: _entry(ctx, r) for n, r in results.items()},
            }
        )
    else:
        console = stdout()
        console.print(_header(ctx), soft_wrap=False)
        console.print(_figures(ctx, results, "predicted by the coplan cost model"))
        _footer(console)
        # what qualifies the prices, once for the strategies it applies to (``Validated.cautions``)
        for caution in dict.fromkeys(c for r in results.values() for c in _trust(ctx, r).cautions):
            console.print(f"[yellow]caution[/yellow]: {escape(caution)}", soft_wrap=False)
        console.print()
        console.print("[bold]what each strategy decided[/bold]")
        console.print(_decisions(ctx, results))
        for line in written:
            console.print(line, soft_wrap=False)
    if best is None:
        raise Infeasible(
            _why_infeasible(ctx, min(results.values(), key=lambda r: r.estimate.memory.peak_bytes))
        )
