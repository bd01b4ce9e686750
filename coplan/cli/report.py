"""The HTML report of ``coplan compare``: every plan the strategies priced, peak memory against
step time, each strategy's chosen plan marked, and a table of what each decided.

One self-contained page: plotly.js is embedded (no CDN), so the file opens offline. The axes are
set around what a reader compares -- the memory budget and the chosen plans -- not around every
plan priced: a search prices layouts far over budget (hundreds of GiB with nothing recomputed),
and a memory axis stretched to them squeezes the chosen plans into a corner. Over-budget plans are
drawn pale, and a note counts those above the memory axis; double-clicking the plot shows every
plan. Hovering a point says which plan it is.
"""

from __future__ import annotations

import html as _html
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from coplan.cli.common import human_bytes
from coplan.fileio import write_text
from coplan.plan.capabilities import validated_plan
from coplan.plan.context import Decisions, GiB

if TYPE_CHECKING:
    from coplan.plan.context import PlanContext
    from coplan.plan.labels import Labels
    from coplan.search.result import Point, StrategyResult

#: id of the plot's element, so a reader (or a test) finds the figure in the page
PLOT_ID = "memory-vs-time"
#: the memory axis ends this far above the budget (or the highest chosen plan)
HEADROOM = 1.15
#: the time axis reaches at least this factor either side of the chosen plans (log scale)
TIME_MARGIN = 1.4
#: above this many points the cloud is drawn with WebGL (SVG slows down past a few thousand)
WEBGL_POINTS = 5000
_SYMBOLS = ("circle", "diamond", "square", "triangle-up", "star", "cross", "triangle-down", "x")
_COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2")
_FIT_COLOUR = "#7f9cb5"
_OVER_COLOUR = "#e9a3a3"
_BUDGET_COLOUR = "#c0392b"

_CSS = (
    "body{font-family:sans-serif;margin:2em;max-width:1300px}table{border-collapse:collapse;margin-top:1em}"
    "td,th{border:1px solid #ccc;padding:4px 8px;font-size:13px;vertical-align:top}"
    "th{background:#f3f3f3}.note{color:#555;font-size:13px}"
)


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def _layout(d: Decisions) -> str:
    p = d.parallel
    return " ".join(b for b in p.describe().split(" ") if b != f"mb{p.microbatch}")


def _recompute(d: Decisions, labels: Labels | None) -> str:
    names = sorted(d.remat.all_names)
    if not names:
        return "nothing"
    if labels is not None:
        names = [labels.tensor(n) for n in labels.tensors_in_order(names)]
    shown = ", ".join(names[:3]) + (f" (+{len(names) - 3} more)" if len(names) > 3 else "")
    return f"{len(names)} tensors per block: {shown}"


def _precision(d: Decisions) -> str:
    c = d.precision
    return c.compute + (f", {len(c.ops)} ops overridden" if c.ops else "")


def describe(
    step_time_s: float,
    peak_bytes: float,
    fits: bool,
    budget: float,
    decisions: Decisions | None,
    labels: Labels | None = None,
) -> list[str]:
    """A priced plan in lines a reader recognises it by (the hover text of its point)."""
    lines = []
    if decisions is not None:
        f = decisions.fusion
        lines += [
            f"layout: {_layout(decisions)}",
            f"microbatch: {decisions.parallel.microbatch}",
            f"recompute: {_recompute(decisions, labels)}",
            f"precision: {_precision(decisions)}",
            f"fusion: {len(f.groups)} fused groups, {f.label}",
        ]
    lines.append(f"step time: {step_time_s * 1e3:.2f} ms")
    state = "fits" if fits else f"{_gib(peak_bytes - budget)} over budget"
    lines.append(f"peak: {_gib(peak_bytes)} per GPU ({state})")
    return lines


def _hover(lines: Sequence[str]) -> str:
    return "<br>".join(_html.escape(x) for x in lines)


def _ranges(
    ctx: PlanContext, results: dict[str, StrategyResult], points: Sequence[Point]
) -> tuple[tuple[float, float], tuple[float, float]]:
    """The time range (log10 ms) and memory range (GiB) around the budget and the chosen plans."""
    chosen = list(results.values())
    top = max([ctx.budget, *(r.estimate.memory.peak_bytes for r in chosen)]) * HEADROOM / GiB
    steps = [r.step_time_s for r in chosen]
    fastest_fit = [p.step_time_s for p in points if p.fits]
    lo = math.log10(min(steps + fastest_fit) * 1e3)
    hi = math.log10(max(steps) * 1e3)
    pad = max(math.log10(TIME_MARGIN), 0.15 * (hi - lo))
    return (lo - pad, hi + pad), (0.0, top)


def figure(ctx: PlanContext, results: dict[str, StrategyResult]) -> Any:
    """The plotly figure: the plans priced (pale where over budget), the budget line, and one
    marker per strategy at the plan it chose."""
    import plotly.graph_objects as go

    labels = ctx.index.labels
    budget = ctx.budget
    owners = [(n, p) for n, r in results.items() for p in r.considered]
    (x0, x1), (y0, y1) = _ranges(ctx, results, [p for _, p in owners])
    scatter = go.Scattergl if len(owners) > WEBGL_POINTS else go.Scatter
    fig = go.Figure()
    for fits, colour, size, opacity, what in (
        (True, _FIT_COLOUR, 6, 0.7, "plans priced that fit"),
        (False, _OVER_COLOUR, 5, 0.45, "plans priced over budget"),
    ):
        pts = [(n, p) for n, p in owners if p.fits is fits]
        if not pts:
            continue
        fig.add_trace(
            scatter(
                x=[p.step_time_s * 1e3 for _, p in pts],
                y=[p.peak_bytes / GiB for _, p in pts],
                mode="markers",
                name=f"{what} ({len(pts):,})",
                marker={"color": colour, "size": size, "opacity": opacity},
                hovertext=[
                    _hover(
                        [
                            *describe(p.step_time_s, p.peak_bytes, p.fits, budget, p.decisions, labels),
                            f"priced by: {n}",
                        ]
                    )
                    for n, p in pts
                ],
                hovertemplate="%{hovertext}<extra></extra>",
            )
        )
    xs = [p.step_time_s * 1e3 for _, p in owners] + [r.step_time_s * 1e3 for r in results.values()]
    left, right = min([*xs, 10**x0]) / 2, max([*xs, 10**x1]) * 2
    fig.add_trace(
        go.Scatter(
            x=[left, right],
            y=[budget / GiB, budget / GiB],
            mode="lines",
            name=f"memory budget ({budget / GiB:.1f} GiB)",
            line={"color": _BUDGET_COLOUR, "dash": "dash", "width": 2},
            hovertemplate=f"memory budget: {budget / GiB:.2f} GiB per GPU<extra></extra>",
        )
    )
    first_with: dict[str, str] = {}
    for i, (name, r) in enumerate(results.items()):
        e = r.estimate
        same = first_with.setdefault(r.plan.fingerprint, name)
        trust = validated_plan(ctx, r.plan, e)
        lines = [
            f"chosen by {name}" + (f" (the same plan as {same})" if same != name else ""),
            *describe(e.step_time_s, e.memory.peak_bytes, r.fits, budget, Decisions.of(r.plan), labels),
            f"plan {r.plan.fingerprint}",
            "inside the validated envelope"
            if trust.inside
            else "EXTRAPOLATED: " + "; ".join(trust.extrapolated),
            *("caution: " + c for c in trust.cautions),
        ]
        fig.add_trace(
            go.Scatter(
                x=[e.step_time_s * 1e3],
                y=[e.memory.peak_bytes / GiB],
                mode="markers",
                name=f"{name}: {e.step_time_s * 1e3:.2f} ms, {e.memory.peak_bytes / GiB:.2f} GiB"
                + ("" if r.fits else " (over budget)")
                + ("" if trust.inside else " (extrapolated)"),
                marker={
                    "symbol": _SYMBOLS[i % len(_SYMBOLS)],
                    "color": _COLOURS[i % len(_COLOURS)],
                    "size": 16 if same == name else 11,
                    "line": {"color": "black", "width": 1.5},
                },
                hovertext=[_hover(lines)],
                hovertemplate="%{hovertext}<extra></extra>",
                legendgroup="chosen",
                legendgrouptitle={"text": "chosen plan per strategy"} if i == 0 else None,
            )
        )
    devices = " + ".join(dict.fromkeys(g.device.name for g in ctx.cluster.groups))
    fig.update_layout(
        template="plotly_white",
        title=f"{ctx.model_name} on {ctx.gpus} x {devices}: peak memory against step time",
        xaxis={"title": "predicted step time (ms, log scale)", "type": "log", "range": [x0, x1]},
        yaxis={"title": "peak memory per GPU (GiB)", "range": [y0, y1]},
        hovermode="closest",
        height=640,
        legend={"itemsizing": "constant"},
        margin={"t": 110},
        annotations=[_note(owners, x0, x1, y1)],
    )
    return fig


def _note(owners: Sequence[tuple[str, Point]], x0: float, x1: float, y1: float) -> dict[str, Any]:
    """How many plans the zoomed axes leave out, above the plot."""
    n = len(owners)
    over = sum(not p.fits for _, p in owners)
    above = sum(p.peak_bytes / GiB > y1 for _, p in owners)
    beside = sum(p.peak_bytes / GiB <= y1 and not 10**x0 <= p.step_time_s * 1e3 <= 10**x1 for _, p in owners)
    bits = [f"{n:,} plans priced, {over:,} of them over the memory budget (pale)"]
    if above:
        bits.append(f"{above:,} plans lie above {y1:.1f} GiB, off the chart")
    if beside:
        bits.append(f"{beside:,} outside the time range shown")
    text = "; ".join(bits) + (". Double-click the plot to show every plan." if above or beside else ".")
    return {
        "text": _html.escape(text),
        "xref": "paper",
        "yref": "paper",
        "x": 0,
        "y": 1.02,
        "xanchor": "left",
        "yanchor": "bottom",
        "showarrow": False,
        "font": {"size": 12, "color": "#444"},
    }


def write_html(path: Path, ctx: PlanContext, results: dict[str, StrategyResult]) -> None:
    from coplan.plan import plan_summary
    from coplan.plan.context import policy_sets

    plot = figure(ctx, results).to_html(
        full_html=False,
        include_plotlyjs=True,  # embedded: the page opens without a network
        div_id=PLOT_ID,
        config={"displaylogo": False, "responsive": True},
    )
    rows = []
    for name, r in results.items():
        e = r.estimate
        s = plan_summary(r.plan, e, ctx.index, policy_sets(ctx))
        cells = (
            name,
            f"{e.step_time_s * 1e3:.2f}",
            f"{e.tokens_per_s:,.0f}",
            f"{e.mfu:.1%}",
            f"{e.memory.peak_bytes / GiB:.2f}",
            "yes" if r.fits else "no",
            f"{r.plan_time_s:.2f}",
            s["parallel"],
            s["remat"],
            s["fusion"],
            s["precision"],
            r.plan.fingerprint,
        )
        rows.append("<tr>" + "".join(f"<td>{_html.escape(str(x))}</td>" for x in cells) + "</tr>")
    head = "".join(
        f"<th>{h}</th>"
        for h in (
            "strategy",
            "step ms",
            "tokens/s",
            "MFU",
            "peak GiB",
            "fits",
            "plan s",
            "parallel",
            "recompute",
            "fusion",
            "precision",
            "fingerprint",
        )
    )
    title = (
        f"coplan compare: {ctx.model_name} on {ctx.cluster.summary()}, planned for the {ctx.stack.name} stack"
    )
    doc = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{_html.escape(title)}</title>
<style>{_CSS}</style>
</head><body>
<h1>{_html.escape(title)}</h1>
<p>Global batch {ctx.global_batch} x sequence {ctx.seq}; memory budget {ctx.budget / GiB:.2f} GiB
({human_bytes(ctx.budget)}) per GPU. Every figure is the coplan cost model's prediction; every
chosen plan was checked by the plan checker.</p>
<p class="note">Each point is one plan a strategy priced; hover over it to see which. The axes are
set around the budget and the chosen plans; drag to zoom, double-click to show every plan.
Recomputed tensors and precision overrides are named by module path, <code>[*]</code> standing for
every block of the model.</p>
{plot}
<table><tr>{head}</tr>{"".join(rows)}</table>
</body></html>
"""
    write_text(path, doc, "--html")
