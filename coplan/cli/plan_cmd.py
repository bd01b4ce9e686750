"""``coplan plan`` and ``coplan compare``: plan a training job, or compare strategies on it.

Exit codes: 0 a fitting plan; 2 bad input (one line on stderr); 3 infeasible (nothing fits the
memory budget: the least-memory plan found is reported with the reason).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich import box
from rich.table import Table

from coplan.cli.common import human_bytes, positive, print_json, stdout
from coplan.cli.graph_cmd import JsonOpt, SeqOpt
from coplan.errors import CoplanError, SpecError

if TYPE_CHECKING:
    from coplan.plan.context import PlanContext
    from coplan.search.result import StrategyResult

DEFAULT_GLOBAL_BATCH = 32


class Infeasible(CoplanError):
    """Nothing fits the memory budget: an answer, not a crash."""

    exit_code = 3


ModelOpt = Annotated[str, typer.Option("--model", "-m", help="Model preset name or a spec JSON file.")]
ClusterOpt = Annotated[
    str, typer.Option("--cluster", "-c", help="Cluster or device preset, or a JSON file (e.g. calibrated).")
]
GpusOpt = Annotated[int, typer.Option("--gpus", "-g", help="Number of devices to plan for.")]
BatchOpt = Annotated[
    int | None,
    typer.Option("--global-batch", help=f"Sequences per optimizer step \\[default: {DEFAULT_GLOBAL_BATCH}]."),
]
BudgetOpt = Annotated[
    float | None,
    typer.Option(
        "--memory-budget-gb",
        help="Memory per GPU the plan may use, GiB \\[default: capacity x 0.95 - 1 GiB reserve].",
    ),
]
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


def make_context(
    model: str,
    cluster: str,
    gpus: int,
    global_batch: int | None,
    seq: int | None,
    budget_gb: float | None,
    tolerance: float,
) -> PlanContext:
    from coplan.cost import CostModel
    from coplan.hardware import load_cluster
    from coplan.models.spec import load_model_spec
    from coplan.plan import GiB, Numerics, PlanContext

    positive("--gpus", gpus)
    batch = positive("--global-batch", global_batch, optional=True) or DEFAULT_GLOBAL_BATCH
    if budget_gb is not None and not budget_gb > 0:
        raise SpecError("--memory-budget-gb", None, f"must be a positive number of GiB, got {budget_gb!r}")
    if not tolerance >= 0:
        raise SpecError("--tolerance", None, f"must be >= 0, got {tolerance!r}")
    spec = load_model_spec(model)
    hw = load_cluster(cluster, gpus)
    return PlanContext(
        CostModel(spec=spec),
        hw,
        global_batch=batch,
        seq=spec.resolve_seq(seq),
        budget_bytes=budget_gb * GiB if budget_gb is not None else None,
        numerics=Numerics(tolerance),
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
    ctx: PlanContext, names: list[str], order: list[str] | None, dtypes: tuple[str, ...] | None = None
) -> dict[str, StrategyResult]:
    from coplan.search import STRATEGIES, Options, run_strategy
    from coplan.search.space import SearchSpace

    unknown = [n for n in names if n not in STRATEGIES]
    if unknown:
        raise SpecError(
            "--strategy", None, f"unknown strategy {unknown[0]!r}; choose from {', '.join(STRATEGIES)}"
        )
    bar = _Bar()
    results: dict[str, StrategyResult] = {}
    try:
        # joint is warm-started from whatever else was asked for, so it runs last
        for name in sorted(names, key=lambda n: n == "joint"):
            opts = Options(progress=bar)
            if dtypes is not None:
                opts.space = SearchSpace(dtypes=dtypes)
            if order:
                opts.order = order
            if name == "joint":
                opts.warm = [r.plan for r in results.values()]
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
        f"x seq {ctx.seq}, budget {human_bytes(ctx.budget)}/GPU"
    )


def _entry(r: StrategyResult) -> dict[str, Any]:
    d = r.to_dict()
    return {
        k: d[k] for k in ("step_time_s", "tokens_per_s", "mfu", "peak_bytes", "fits", "plan_time_s", "plan")
    } | {k: d[k] for k in ("evaluations", "violations", "notes", "passes")}


def plan(
    model: ModelOpt = "gpt2-124m",
    cluster: ClusterOpt = "dgx-h100",
    gpus: GpusOpt = 1,
    global_batch: BatchOpt = None,
    seq: SeqOpt = None,
    memory_budget_gb: BudgetOpt = None,
    strategy: Annotated[
        str,
        typer.Option(
            "--strategy", help="sequential, sequential-best, iterated, hierarchical, joint, exhaustive."
        ),
    ] = "joint",
    order: OrderOpt = None,
    tolerance: ToleranceOpt = 0.0,
    dtypes: Annotated[
        str | None,
        typer.Option(
            "--dtypes",
            help="Compute dtypes the search may use, comma-separated (e.g. bf16,fp32) "
            "\\[default: every dtype the devices run natively].",
        ),
    ] = None,
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Write the plan as JSON here.")] = None,
    json: JsonOpt = False,
) -> None:
    """Plan fusion, recomputation, parallelism and precision of a training job."""
    from coplan.plan import plan_summary

    ctx = make_context(model, cluster, gpus, global_batch, seq, memory_budget_gb, tolerance)
    names = [strategy]
    if strategy == "joint":
        names = ["sequential", "hierarchical", "joint"]  # warm starts for joint
    results = run_all(ctx, names, _order(order), _dtypes(dtypes))
    r = results[strategy]
    if out is not None:
        out.write_text(r.plan.to_json() + "\n", encoding="utf-8")
    if json:
        body = {
            "model": ctx.model_name,
            "cluster": ctx.cluster.name,
            "gpus": ctx.gpus,
            "global_batch": ctx.global_batch,
            "seq": ctx.seq,
            "budget_bytes": ctx.budget,
            "strategy": strategy,
            **_entry(r),
        }
        if not r.fits:
            body["reason"] = _why_infeasible(ctx, r)
        print_json(body)
    else:
        console = stdout()
        console.print(
            _header(ctx),
            soft_wrap=True,
        )
        table = Table(
            box=box.SIMPLE,
            show_header=False,
            title=f"plan ({strategy}, {r.plan_time_s:.2f} s, {r.evaluations:,} plans priced)",
        )
        table.add_column("")
        table.add_column("")
        e = r.estimate
        table.add_row("step time", f"{e.step_time_s * 1e3:.2f} ms")
        table.add_row("tokens/s", f"{e.tokens_per_s:,.0f}")
        table.add_row("MFU", f"{e.mfu:.1%}")
        table.add_row("peak memory", f"{human_bytes(e.memory.peak_bytes)} (stage {e.memory.stage})")
        for k, v in plan_summary(r.plan, e, ctx.index).items():
            table.add_row(k, v)
        table.add_row("fingerprint", r.plan.fingerprint)
        console.print(table)
        seq_r = results.get("sequential")
        if seq_r is not None and strategy != "sequential" and seq_r.fits and r.fits:
            console.print(
                f"production passes in sequence (fusion -> remat -> parallel -> precision): "
                f"{seq_r.step_time_s * 1e3:.2f} ms; {strategy} is "
                f"{seq_r.step_time_s / r.step_time_s:.3f}x their throughput",
                soft_wrap=True,
            )
        for note in r.notes:
            console.print(f"[dim]{note}[/dim]", soft_wrap=True)
        if out is not None:
            console.print(f"plan written to {out}")
    if not r.fits:
        raise Infeasible(_why_infeasible(ctx, r))


def compare(
    model: ModelOpt = "gpt2-124m",
    cluster: ClusterOpt = "dgx-h100",
    gpus: GpusOpt = 1,
    global_batch: BatchOpt = None,
    seq: SeqOpt = None,
    memory_budget_gb: BudgetOpt = None,
    strategies: Annotated[
        str, typer.Option("--strategies", help="Comma-separated strategies to compare.")
    ] = "sequential,sequential-best,iterated,hierarchical,joint",
    order: OrderOpt = None,
    tolerance: ToleranceOpt = 0.0,
    json: JsonOpt = False,
    html: Annotated[
        Path | None, typer.Option("--html", help="Write an HTML report with a memory-vs-time plot.")
    ] = None,
) -> None:
    """Compare planning strategies on one job, all priced by the same cost model."""
    from coplan.plan import plan_summary

    names = [s.strip() for s in strategies.split(",") if s.strip()]
    if not names:
        raise SpecError("--strategies", None, "name at least one strategy")
    ctx = make_context(model, cluster, gpus, global_batch, seq, memory_budget_gb, tolerance)
    results = run_all(ctx, names, _order(order))
    if html is not None:
        from coplan.cli.report import write_html

        write_html(html, ctx, results)
    if json:
        print_json(
            {
                "model": ctx.model_name,
                "cluster": ctx.cluster.name,
                "gpus": ctx.gpus,
                "global_batch": ctx.global_batch,
                "seq": ctx.seq,
                "budget_bytes": ctx.budget,
                "strategies": {n: _entry(r) for n, r in results.items()},
            }
        )
    else:
        console = stdout()
        console.print(
            _header(ctx),
            soft_wrap=True,
        )
        base = results.get("sequential")
        table = Table(box=box.SIMPLE_HEAD, title="predicted by the coplan cost model")
        for col in ("strategy", "step ms", "tokens/s", "MFU", "peak", "fits", "vs sequential", "plan s"):
            table.add_column(col, justify="left" if col == "strategy" else "right", no_wrap=col == "strategy")
        decided = Table(box=box.SIMPLE_HEAD, title="what each strategy decided")
        for col in ("strategy", "parallel", "recompute", "kernels", "precision"):
            decided.add_column(col, overflow="fold")
        for n, r in results.items():
            e = r.estimate
            gain = (
                f"{base.step_time_s / e.step_time_s:.3f}x"
                if base is not None and r.fits and base.fits
                else "-"
            )
            table.add_row(
                n,
                f"{e.step_time_s * 1e3:.2f}",
                f"{e.tokens_per_s:,.0f}",
                f"{e.mfu:.1%}",
                human_bytes(e.memory.peak_bytes),
                "yes" if r.fits else "[red]no[/red]",
                gain,
                f"{r.plan_time_s:.2f}",
            )
            s = plan_summary(r.plan, e, ctx.index)
            decided.add_row(
                n, s["parallel"], s["remat"], f"{s.get('kernels', '')}; {s['fusion']}", s["precision"]
            )
        console.print(table)
        console.print(decided)
        if html is not None:
            console.print(f"report written to {html}")
    if not any(r.fits for r in results.values()):
        raise Infeasible(
            _why_infeasible(ctx, min(results.values(), key=lambda r: r.estimate.memory.peak_bytes))
        )
