"""``coplan calibrate``: measure this machine and write a calibrated cluster profile."""

from __future__ import annotations

import enum
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from coplan.cli.common import human_bytes, interruptible, positive, print_json, stdout
from coplan.errors import SpecError
from coplan.fileio import check_output

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID

    from coplan.hardware.calibrate import Calibration, Measurement


class CalibrateDevice(enum.StrEnum):  # coplan.hardware.calibrate.DEVICES
    cpu = "cpu"
    cuda = "cuda"


#: The progress bar appears only once a run has lasted this long (a fast run prints no flicker).
PROGRESS_AFTER_S = 1.0


def calibrate(
    device: Annotated[
        CalibrateDevice | None,
        typer.Option("--device", "-d", help="What to measure \\[default: cpu].", show_default=False),
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option(
            "--out",
            "-o",
            help="Profile to write \\[default: ./coplan-profile-<device>.json, with --runs "
            "./coplan-profile-<device>-runs.json].",
        ),
    ] = None,
    runs: Annotated[
        Path | None,
        typer.Option(
            "--runs",
            help="Fit the profile to training runs recorded by coplan run --record (JSONL) instead "
            "of running microbenchmarks.",
        ),
    ] = None,
    cluster: Annotated[
        str | None,
        typer.Option(
            "--cluster",
            "-c",
            help="With --runs: the profile to start from \\[default: the one the runs were priced with].",
        ),
    ] = None,
    procs: Annotated[
        int | None,
        typer.Option(
            "--procs",
            "--nproc",
            help="Processes for the collective benchmarks (1: none) "
            "\\[default: 2 on cpu, every GPU on cuda].",
        ),
    ] = None,
    quick: Annotated[
        bool, typer.Option("--quick", help="A reduced set of microbenchmarks (seconds).")
    ] = False,
    json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")] = False,
) -> None:
    """Time matmuls, attention, elementwise ops, reductions, kernel launches and collectives with real
    torch ops, fit the cost model's device rates to them, and write a cluster profile that --cluster
    (estimate, plan) accepts. A fit that leaves an rms residual above 50% on any kind of
    microbenchmark is refused (exit 1, nothing written): the machine was too busy to measure."""
    from coplan.hardware.calibrate import calibrate as run
    from coplan.hardware.calibrate import write_profile

    what = device.value if device is not None else None
    check_output("--out", out)
    if runs is not None:
        from_runs(runs, cluster, what, out, json)
        return
    if cluster is not None:
        raise SpecError("--cluster", None, "only applies with --runs (microbenchmarks measure this machine)")
    what = what or "cpu"
    positive("--procs", procs, optional=True)
    path = out if out is not None else Path(f"coplan-profile-{what}.json")
    check_output("--out", path)
    with interruptible("calibration stopped; no profile written"), _LazyProgress() as bar:
        cal = run(what, procs=procs, quick=quick, progress=bar.update)
    written = write_profile(cal, path)
    if json:
        print_json({**cal.to_dict(), "out": str(written)})
        return
    console = stdout()
    render(cal, console)
    console.print(f"\nwrote {written} (use it as --cluster {written})")


class _LazyProgress:
    """A Rich progress bar on stderr that starts only after ``PROGRESS_AFTER_S`` (so quick runs and
    ``--json`` stdout stay clean) and disappears when done; none where stderr is not a terminal
    (a stopped bar leaves a newline there)."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.bar: Progress | None = None
        self.task: TaskID | None = None

    def __enter__(self) -> _LazyProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()

    def update(self, label: str, done: int, total: int) -> None:
        if self.bar is None:
            if not sys.stderr.isatty() or time.perf_counter() - self.started < PROGRESS_AFTER_S:
                return
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(
                TextColumn("calibrating"),
                BarColumn(),
                TextColumn("{task.completed}/{task.total}"),
                TimeElapsedColumn(),
                TextColumn("{task.description}"),
                console=Console(file=sys.stderr),
                transient=True,
            )
            self.bar.start()
            self.task = self.bar.add_task(label, total=total)
        assert self.task is not None
        self.bar.update(self.task, completed=done, total=total, description=label)


def _seconds(s: float) -> str:
    return f"{s * 1e3:.2f}ms" if s >= 1e-3 else f"{s * 1e6:.1f}µs"


def _rate(m: Measurement) -> str:
    """What the measurement achieved, in the unit its kind is fitted on."""
    if m.kind in ("matmul", "attention"):
        return f"{m.flops / m.seconds / 1e9:.0f} GFLOP/s"
    if m.kind == "vector":
        return f"{m.bytes / m.seconds / 1e9:.1f} GB/s"
    if m.kind == "collective":
        return human_bytes(m.bytes)
    return ""


def render(cal: Calibration, console: Console) -> None:
    table = Table(
        title=f"microbenchmarks: measured vs {cal.device.name}",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
    )
    table.add_column("microbenchmark", style="cyan", no_wrap=True)
    table.add_column("dtype", no_wrap=True)
    table.add_column("measured", justify="right", no_wrap=True)
    table.add_column("fitted", justify="right", no_wrap=True)
    table.add_column("error", justify="right", no_wrap=True)
    table.add_column("achieved", justify="right", no_wrap=True)
    kind = ""
    for m in cal.measurements:
        if m.kind != kind and kind:
            table.add_section()
        kind = m.kind
        err = f"{m.error:+.0%}" if m.used else "-"
        table.add_row(m.name, m.dtype, _seconds(m.seconds), _seconds(m.fitted), err, _rate(m))
    console.print(table)
    d = cal.device
    eff = d.efficiency
    mm = ", ".join(f"{k.split('.', 1)[1]} {v:.3f}" for k, v in eff.items() if k.startswith("matmul."))
    console.print(f"\n[bold]{d.name}[/bold]: {cal.cluster.summary()}")
    console.print(f"  matmul efficiency: {mm}; half-dim {d.matmul_half_dim:g}")
    console.print(f"  attention efficiency: {eff.get('attention', 0.0):.3f}")
    bw = d.memory_bandwidth * d.efficiency_of("memory")
    vec = d.vector_flops * d.efficiency_of("vector")
    console.print(f"  memory {bw / 1e9:.1f} GB/s achievable; vector {vec / 1e9:.1f} GFLOP/s achievable")
    console.print(f"  kernel launch {d.kernel_launch_s * 1e6:.2f} µs")
    if d.host_op_s:
        console.print(f"  host op (view, eager) {d.host_op_s * 1e6:.2f} µs")
    link = cal.cluster.groups[0].intra_node
    if cal.cluster.num_devices > 1:
        console.print(
            f"  link {link.name}: {link.bandwidth / 1e9:.2f} GB/s, latency {link.latency_s * 1e6:.1f} µs"
        )
    console.print("  fit residuals (rms): " + ", ".join(f"{k} {v:.0%}" for k, v in cal.residuals.items()))
    for note in cal.notes:
        console.print(f"  note: {note}")


# --- from recorded runs -----------------------------------------------------------------------------


def from_runs(path: Path, cluster: str | None, device: str | None, out: Path | None, json: bool) -> None:
    """``coplan calibrate --runs``: fit the device's GEMM and vector rates and its per-kernel cost
    to recorded step times, report the error before and after (in-sample and held out), write."""
    from coplan.hardware import load_cluster
    from coplan.hardware.calibrate.runs import (
        RunsError,
        base_cluster,
        fit_runs,
        fitted_profile,
        read_runs,
        write_cluster,
    )

    records, notes = read_runs(path)
    recorded = {r.device for r in records}
    if device is not None and recorded != {device}:
        raise RunsError(f"--device {device}: the runs in {path} were on {', '.join(sorted(recorded))}")
    base = base_cluster(records, load_cluster(cluster) if cluster is not None else None, path)
    fit = fit_runs(records, base)
    s = fit.scales
    source = (
        f"fitted by `coplan calibrate --runs {path}` to {len(records)} run(s) on "
        f"{records[0].device_name}: gemm rate x{s.gemm:.3g}, vector rate x{s.vector:.3g}, "
        f"kernel launch x{s.launch:.3g}, link time x{s.link:.3g}; "
        f"step-time rms error {fit.rms_before:.1%} -> {fit.rms_after:.1%}"
        + (
            f" (leave-one-out {fit.loo_before:.1%} -> {fit.loo_after:.1%})"
            if fit.loo_after == fit.loo_after
            else ""
        )
    )
    profile = fitted_profile(base, fit, source)
    target = out if out is not None else Path(f"coplan-profile-{records[0].device}-runs.json")
    written = write_cluster(profile, target)
    dev = profile.groups[0].device
    rows: list[dict[str, Any]] = [
        {
            "run": r.label,
            "measured_s": m,
            "before_s": b,
            "after_s": a,
            **({"held_out_s": fit.loo_after_s[i]} if fit.loo_after_s else {}),
        }
        for i, (r, m, b, a) in enumerate(zip(records, fit.measured_s, fit.before_s, fit.after_s, strict=True))
    ]
    summary = {
        "runs": len(records),
        "device": records[0].device_name,
        "start": base.name,
        "scales": s.to_dict(),
        "kernel_launch_s": dev.kernel_launch_s,
        "error": {
            "in_sample": {"before": fit.rms_before, "after": fit.rms_after},
            "held_out": {"before": _num(fit.loo_before), "after": _num(fit.loo_after)},
        },
        "notes": notes,
        "out": str(written),
    }
    if json:
        print_json({**summary, "per_run": rows})
        return
    console = stdout()
    table = Table(
        title=f"{len(records)} recorded runs on {records[0].device_name}: measured vs {base.name}",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
    )
    for col in ("run", "measured", "before", "after", "held out"):
        table.add_column(col, justify="left" if col == "run" else "right", no_wrap=col != "run")
    for row in rows:
        m = row["measured_s"]
        cells = [f"{_seconds(row[k])} ({row[k] / m - 1:+.0%})" for k in ("before_s", "after_s")]
        held = row.get("held_out_s")
        cells.append(f"{_seconds(held)} ({held / m - 1:+.0%})" if held is not None else "-")
        table.add_row(row["run"], _seconds(m), *cells)
    console.print(table)
    console.print(
        f"\nfitted: gemm rate x{s.gemm:.3g}, vector rate x{s.vector:.3g}, kernel launch x{s.launch:.3g} "
        f"({dev.kernel_launch_s * 1e6:.2f} µs), link time x{s.link:.3g}"
    )
    console.print(f"step-time rms error: {fit.rms_before:.1%} -> {fit.rms_after:.1%} on the runs fitted")
    if fit.loo_after == fit.loo_after:
        console.print(f"held out (leave-one-out): {fit.loo_before:.1%} -> {fit.loo_after:.1%}")
    for note in notes:
        console.print(f"[dim]{escape(note)}[/dim]", soft_wrap=True)
    console.print(f"\nwrote {written} (use it as --cluster {written})")


def _num(x: float) -> float | None:
    return x if x == x else None
