"""``coplan coupling``: how strongly fusion, remat, parallelism and precision couple.

    coplan coupling [--grid small|full] [--measure] [--json] [--html report.html]

Without ``--measure``: the simulated study of ``coplan.experiments.coupling`` on a grid of
scenarios (every plan priced by the cost model and checked by the plan checker): the Rich tables,
or with ``--json`` one object ``{"pairs": {P: {"single_a", "single_b", "sequential", "joint",
"interaction", ...}}, "all4": {...}, "verdict": "validated" | "killed", "scenarios": [...], ...}``.

With ``--measure``: fusion x remat trained for real (``coplan.experiments.coupling_measure``) on
``--device`` (auto: a GPU when one is visible, else this CPU), measured next to predicted; the
options after ``--measure`` in ``--help`` apply to it only. ``--html`` writes a self-contained
report of whichever study ran. Bad input: one line on stderr, exit 2. Ctrl-C stops the grid's
workers; the scenarios that finished are reported (``"partial": true``), then one line, exit 130.
"""

from __future__ import annotations

import enum
import os
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from coplan.cli.common import interruptible, positive, print_json, stdout
from coplan.cli.options import Device, JsonOpt
from coplan.errors import Interrupted, SpecError
from coplan.fileio import check_output


class _Bar:
    """A Rich progress bar on stderr, for people watching a terminal (redirected stderr stays
    clean)."""

    def __init__(self, label: str) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.enabled = sys.stderr.isatty()
        self.progress = Progress(
            TextColumn(f"[bold]{label}[/bold]"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.description}"),
            console=Console(file=sys.stderr),
            transient=True,
        )
        self.task: Any = None

    def __call__(self, done: int, total: int, what: str) -> None:
        if not self.enabled:
            return
        if self.task is None:
            self.progress.start()
            self.task = self.progress.add_task(what, total=total)
        self.progress.update(self.task, completed=done, total=total, description=what)

    def close(self) -> None:
        if self.task is not None:
            self.progress.stop()


class Grid(enum.StrEnum):  # coplan.experiments.coupling.GRIDS
    small = "small"
    full = "full"


class Granularity(enum.StrEnum):  # coplan.experiments.coupling.GRANULARITIES
    op = "op"
    preset = "preset"


MEASURE_ONLY = (
    "--device",
    "--model",
    "--batch",
    "--seq",
    "--steps",
    "--profile",
    "--budget-fraction",
    "--repeats",
)


def coupling(
    grid: Annotated[
        Grid, typer.Option("--grid", help="Scenario grid: small (minutes) or full (hours on two cores).")
    ] = Grid.small,
    granularity: Annotated[
        Granularity | None,
        typer.Option(
            "--granularity",
            help="Grid: fusion decided per op (every legal partition into kernels, solved with the "
            "recompute set) or among the named options only \\[default: op].",
            show_default=False,
        ),
    ] = None,
    measure: Annotated[
        bool, typer.Option("--measure", help="Measure fusion x remat on real training instead.")
    ] = False,
    json: JsonOpt = False,
    html: Annotated[
        Path | None, typer.Option("--html", help="Write a self-contained HTML report here.")
    ] = None,
    jobs: Annotated[
        int | None,
        typer.Option("--jobs", "-j", help="Grid: worker processes planning scenarios (default: the CPUs)."),
    ] = None,
    device: Annotated[
        Device | None,
        typer.Option(
            "--device", "-d", help="--measure: where to train \\[default: auto].", show_default=False
        ),
    ] = None,
    model: Annotated[
        str | None,
        typer.Option(
            "--model",
            "-m",
            help="--measure: model preset or spec file (default: a 2-layer GPT on cpu, gpt2-124m on cuda).",
        ),
    ] = None,
    batch: Annotated[
        int | None,
        typer.Option(
            "--global-batch", "--batch", "-b", help="--measure: sequences per optimizer step \\[default: 8]."
        ),
    ] = None,
    seq: Annotated[
        int | None, typer.Option("--seq", "-s", help="--measure: sequence length [128 on cpu, 1024 on cuda].")
    ] = None,
    steps: Annotated[
        int | None, typer.Option("--steps", "-n", help="--measure: steps per run, the first two untimed [8].")
    ] = None,
    profile: Annotated[
        str | None,
        typer.Option(
            "--profile",
            help="--measure: cluster or calibrated profile that prices the runs "
            "(default: benchmarks/results/cpu_profile.json if present, else cpu; on a GPU its preset).",
        ),
    ] = None,
    budget_fraction: Annotated[
        float | None,
        typer.Option(
            "--budget-fraction",
            help="--measure: budget on saved activations, from the least recompute reaches (0) "
            "to nothing recomputed (1) [0.5].",
        ),
    ] = None,
    repeats: Annotated[
        int | None,
        typer.Option("--repeats", help="--measure: rounds over the corners, the fastest kept [3]."),
    ] = None,
) -> None:
    """Measure how strongly fusion, remat, parallelism and precision couple, and give the verdict."""
    check_output("--html", html)
    values = (device and device.value, model, batch, seq, steps, profile, budget_fraction, repeats)
    given = dict(zip(MEASURE_ONLY, values, strict=True))
    if not measure:
        extra = [k for k, v in given.items() if v is not None]
        if extra:
            raise SpecError(extra[0], None, "applies only with --measure")
        workers = positive("--jobs", jobs, optional=True) or os.cpu_count() or 1
        _simulated(grid.value, json, html, workers, granularity.value if granularity else "op")
    else:
        if jobs is not None:
            raise SpecError(
                "--jobs", None, "applies to the grid, not to --measure (runs are timed one at a time)"
            )
        if granularity is not None:
            raise SpecError("--granularity", None, "applies to the grid, not to --measure")
        _measured(given, json, html)


def _simulated(grid: str, json: bool, html: Path | None, jobs: int, granularity: str = "op") -> None:
    from coplan.experiments import coupling as study
    from coplan.experiments.coupling_report import print_study, write_html
    from coplan.experiments.coupling_summary import to_json

    bar = _Bar(f"coupling ({grid} grid)")
    try:
        result = study.run_study(grid, progress=bar, jobs=jobs, granularity=granularity)
    finally:
        bar.close()
    # interrupted: what finished is reported (marked partial), then one error line, exit 130
    stopped = f"coupling ({grid} grid) stopped with {len(result.scenarios)} of {result.total} scenarios done"
    if result.partial and not result.scenarios:
        raise Interrupted(stopped)
    data = to_json(result)
    if html is not None:
        write_html(html, data, None)
    if json:
        print_json(data)
    else:
        console = stdout()
        print_study(console, data)
        if data["invalid_plans"]:
            console.print(f"[red]{data['invalid_plans']} plans failed the plan checker (a planner bug)[/red]")
        if html is not None:
            console.print(f"report written to {html}")
    if result.partial:
        raise Interrupted(f"{stopped}; those are reported, marked partial")


def _measured(given: dict[str, Any], json: bool, html: Path | None) -> None:
    from coplan.experiments.coupling_measure import configure, run_measured
    from coplan.experiments.coupling_report import print_measured, write_html

    cfg = configure(
        device=given["--device"] or "auto",
        model=given["--model"],
        batch=given["--batch"],
        seq=given["--seq"],
        steps=given["--steps"] if given["--steps"] is not None else 8,
        profile=given["--profile"],
        budget_fraction=given["--budget-fraction"] if given["--budget-fraction"] is not None else 0.5,
        repeats=given["--repeats"] if given["--repeats"] is not None else 3,
    )
    bar = _Bar(f"coupling --measure ({cfg.device})")
    t0 = time.perf_counter()
    try:
        with interruptible("coupling --measure stopped; nothing written"):
            data = run_measured(cfg, progress=bar)
    finally:
        bar.close()
    data["seconds"] = time.perf_counter() - t0
    if html is not None:
        write_html(html, None, data)
    if json:
        print_json(data)
        return
    console = stdout()
    print_measured(console, data)
    if html is not None:
        console.print(f"report written to {html}")
