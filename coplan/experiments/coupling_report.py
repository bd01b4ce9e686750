"""Tables and the HTML report of ``coplan coupling``, drawn from the JSON object the study prints
(``coupling.to_json`` / ``coupling_measure.to_json``), so a saved result renders the same way.

The HTML report is one self-contained file (interactive plotly figures, plotly.js embedded once,
nothing loaded from the network): a heat map of the pair matrix, a heat map of the coupling in
every scenario, the coupling against model size and against GPU count, and the tables. Heat map
cells carry their figures in black or white, whichever contrasts more with the cell's colour.
"""

from __future__ import annotations

import html as _html
from collections.abc import Sequence
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from coplan.experiments.coupling import PAIR_NAMES, SPACES, THRESHOLD
from coplan.fileio import write_text

_CSS = (
    "body{font-family:sans-serif;margin:2em;max-width:1200px}table{border-collapse:collapse;margin:1em 0}"
    "td,th{border:1px solid #ccc;padding:3px 7px;font-size:12px;text-align:right}"
    "td:first-child,th:first-child{text-align:left}.note{color:#555;font-size:13px}"
)


def gain(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}x"


def signed(x: float | None) -> str:
    return "-" if x is None else f"{x:+.3f}"


def pct(x: float | None) -> str:
    return "-" if x is None else f"{(x - 1) * 100:+.1f}%"


# --- the terminal ---------------------------------------------------------------------------------


def matrix_rows(data: dict[str, Any]) -> list[list[str]]:
    """One row per pair and one for all four: the figures at the pair's entry scenario, then the
    coupling's mean and max over the grid (shared by the terminal table and the HTML)."""
    rows = []
    for name in PAIR_NAMES:
        p = data["pairs"][name]
        rows.append(
            [
                name,
                gain(p["single_a"]),
                gain(p["single_b"]),
                gain(p.get("a_then_b")),
                gain(p.get("b_then_a")),
                gain(p["sequential"]),
                gain(p["joint"]),
                signed(p["interaction"]),
                gain(p.get("interaction_ratio")),
                pct(p["joint_over_sequential"]),
                pct(p["mean_joint_over_sequential"]),
                pct(p["max_joint_over_sequential"]),
                f"{p['scenarios_above_threshold']}/{p['scenarios_compared']}",
                str(p["feasibility_coupled"]),
                p["scenario"] or "-",
            ]
        )
    a = data["all4"]
    rows.append(
        [
            "all four",
            "-",
            "-",
            "-",
            "-",
            gain(a["sequential"]),
            gain(a["joint"]),
            signed(a["interaction"]),
            gain(a.get("interaction_ratio")),
            pct(a["joint_over_sequential"]),
            pct(a["mean_joint_over_sequential"]),
            pct(a["max_joint_over_sequential"]),
            f"{a['scenarios_above_threshold']}/{a['scenarios_compared']}",
            str(a["feasibility_coupled"]),
            a["scenario"] or "-",
        ]
    )
    return rows


MATRIX_HEAD = (
    "pair",
    "A alone",
    "B alone",
    "A then B",
    "B then A",
    "sequential",
    "joint",
    "interaction",
    "joint/(A*B)",
    "joint/seq",
    "mean j/s",
    "max j/s",
    f">{(THRESHOLD - 1) * 100:.0f}%",
    "feas.",
    "scenario",
)


def all4_line(data: dict[str, Any]) -> str:
    a = data["all4"]
    singles = ", ".join(f"{s} {gain(g)}" for s, g in (a.get("singles") or {}).items())
    order = " -> ".join(a.get("sequential_order") or []) or "-"
    return (
        f"all four at {a['scenario'] or '-'}: alone {singles or '-'}; best of the 24 orders ({order}) "
        f"{gain(a['sequential'])}, the literature's order {gain(a.get('sequential_default_order'))}, "
        f"joint {gain(a['joint'])}"
    )


def verdict_lines(data: dict[str, Any]) -> list[str]:
    v = data["verdict_detail"]
    out = [
        f"verdict: {data['verdict'].upper()} ({v['criterion']}); largest joint/sequential "
        f"{pct(v['max_joint_over_sequential'])} ({v['max_pair']}, {v['max_scenario']})"
    ]
    rank = ", ".join(
        f"{r['pair']} {pct(r['max_joint_over_sequential'])} max / {pct(r['mean_joint_over_sequential'])} mean"
        for r in v["ranking"]
    )
    out.append(f"pairs by coupling: {rank}")
    if v["feasibility_coupled"]:
        out.append(
            f"feasibility coupling (joint fits, no sequential order does; not in the verdict): "
            f"{len(v['feasibility_coupled'])} pair-scenarios, e.g. {v['feasibility_coupled'][0]['pair']} "
            f"in {v['feasibility_coupled'][0]['scenario']}"
        )
    if data.get("partial"):
        out.append(
            f"partial: {len(data['scenarios'])} of {data['scenarios_total']} scenarios finished before the "
            "study was stopped; "
            + ("the verdict holds" if v.get("conclusive") else "the rest could still change the verdict")
        )
    t = data["trends"]
    for axis, label in (("model_size", "model size"), ("gpus", "GPU count")):
        rho = t[axis]["rho"]
        out.append(
            f"with {label}: coupling {t[axis]['trend']}"
            + (f" (Spearman rho {rho:+.2f} over all pairs and scenarios)" if rho is not None else "")
        )
    return out


def print_study(console: Console, data: dict[str, Any]) -> None:
    n = len(data["scenarios"])
    console.print(
        f"[bold]coupling of fusion, remat, parallel and precision[/bold]: grid {data['grid']!r}, "
        f"{n} scenarios, {data['seconds']:.0f} s; {data['plans_checked']:,} plans checked, "
        f"{data['invalid_plans']} invalid",
        soft_wrap=True,
    )
    d = data["defaults"]
    console.print("[dim]defaults: " + "; ".join(f"{k}: {v}" for k, v in d.items()) + "[/dim]", soft_wrap=True)
    table = Table(
        box=box.SIMPLE_HEAD,
        title="throughput gains over the default plan (predicted by the coplan cost model), each pair at "
        "its most coupled scenario",
    )
    for col in MATRIX_HEAD:
        table.add_column(col, justify="left" if col in ("pair", "scenario") else "right", overflow="fold")
    for row in matrix_rows(data):
        table.add_row(*row)
    console.print(table)
    console.print(all4_line(data), soft_wrap=True)
    per = Table(box=box.SIMPLE_HEAD, title="joint over sequential in every scenario")
    per.add_column("scenario", overflow="fold")
    per.add_column("default fits", justify="right")
    for name in (*PAIR_NAMES, "all four"):
        per.add_column(name, justify="right")
    for sc in data["scenarios"]:
        cells = [_cell(sc["pairs"][n]) for n in PAIR_NAMES] + [_cell(sc["all4"])]
        per.add_row(sc["id"], "yes" if sc["baseline_fits"] else "no", *cells)
    console.print(per)
    for line in verdict_lines(data):
        console.print(line, soft_wrap=True)


def _cell(entry: dict[str, Any]) -> str:
    c = entry["joint_over_sequential"]
    if c is None:
        return "joint only" if entry["feasibility_coupled"] else "none fit"
    return pct(c)


def print_measured(console: Console, data: dict[str, Any]) -> None:
    run = data["run"]
    console.print(
        f"[bold]fusion x remat measured[/bold] on {run['device_name']} ({run['device']}): "
        f"{run['model']} batch {run['global_batch']} x seq {run['seq']}, {run['steps']} steps per run, "
        f"priced with {run['cluster']}; budget on saved activations {run['budget_bytes'] / 1e6:.2f} MB",
        soft_wrap=True,
    )
    t = Table(box=box.SIMPLE_HEAD, title="corners: measured against predicted")
    for col in (
        "fusion",
        "remat",
        "recomputed",
        "step ms meas",
        "step ms pred",
        "err",
        "saved MB meas",
        "saved MB pred",
        "peak MB meas",
        "peak MB pred",
        "fits m/p",
        "groups honoured",
    ):
        t.add_column(col, justify="left" if col in ("fusion", "remat") else "right")
    for c in data["corners"]:
        m, p = c["measured"], c["predicted"]
        t.add_row(
            c["fusion"],
            c["remat"],
            str(c["recomputed"]),
            f"{m['step_time_s'] * 1e3:.1f}",
            f"{p['step_time_s'] * 1e3:.1f}",
            f"{p['step_time_s'] / m['step_time_s'] - 1:+.0%}",
            f"{m['saved_activation_bytes'] / 1e6:.2f}",
            f"{p['saved_activation_bytes'] / 1e6:.2f}",
            f"{m['peak_bytes'] / 1e6:.1f}",
            f"{p['peak_bytes'] / 1e6:.1f}",
            f"{'y' if c['fits_measured'] else 'n'}/{'y' if c['fits_predicted'] else 'n'}",
            f"{c['groups_honoured']}/{c['groups_planned']}",
        )
    console.print(t)
    f = Table(box=box.SIMPLE_HEAD, title="fusion x remat: gains over eager without recompute")
    for col in ("remat", "source", "fusion alone", "remat alone", "both", "interaction", "joint/(A*B)"):
        f.add_column(col, justify="left" if col in ("remat", "source") else "right")
    for row in data["factorial"]:
        for src in ("measured", "predicted"):
            x = row[src]
            f.add_row(
                row["remat"],
                src,
                gain(x["fusion"]),
                gain(x["remat"]),
                gain(x["both"]),
                signed(x["interaction"]),
                gain(x["interaction_ratio"]),
            )
    console.print(f)
    b = Table(box=box.SIMPLE_HEAD, title="under the memory budget: the study's figures for fusion+remat")
    for col in (
        "source",
        "single_a",
        "single_b",
        "a_then_b",
        "b_then_a",
        "sequential",
        "joint",
        "interaction",
        "joint/seq",
    ):
        b.add_column(col, justify="left" if col == "source" else "right")
    for src in ("measured", "predicted"):
        x = data["pairs"]["fusion+remat"][src]
        b.add_row(
            src,
            *(gain(x[k]) for k in ("single_a", "single_b", "a_then_b", "b_then_a", "sequential", "joint")),
            signed(x["interaction"]),
            pct(x["joint_over_sequential"]),
        )
    console.print(b)
    for note in data["notes"]:
        console.print(f"[dim]{note}[/dim]", soft_wrap=True)


# --- HTML ----------------------------------------------------------------------------------------

#: coupling (joint over sequential - 1, %): white to dark red; where some coupling is negative, a
#: diverging scale (blue below zero, red above) centred on zero
SEQUENTIAL = (
    "#fff5f0",
    "#fee0d2",
    "#fcbba1",
    "#fc9272",
    "#fb6a4a",
    "#ef3b2c",
    "#cb181d",
    "#a50f15",
    "#67000d",
)
DIVERGING = (
    "#053061",
    "#2166ac",
    "#4393c3",
    "#92c5de",
    "#d1e5f0",
    "#f7f7f7",
    "#fddbc7",
    "#f4a582",
    "#d6604d",
    "#b2182b",
    "#67001f",
)
#: cells without a figure (the diagonal's single-space gains, undefined couplings)
EMPTY = "#e4e4e4"
_CONFIG = {"displaylogo": False, "responsive": True}


def _rgb(colour: str) -> tuple[float, float, float]:
    h = colour.lstrip("#")
    return (int(h[0:2], 16), int(h[2:4], 16), int(h[4:6], 16))


def colour_at(scale: Sequence[str], t: float) -> tuple[float, float, float]:
    """The colour at ``t`` in [0, 1] of evenly spaced stops, interpolated in RGB as plotly.js
    draws a heat map's cells."""
    t = min(max(t, 0.0), 1.0) * (len(scale) - 1)
    i = min(int(t), len(scale) - 2)
    a, b = _rgb(scale[i]), _rgb(scale[i + 1])
    f = t - i
    return (a[0] + (b[0] - a[0]) * f, a[1] + (b[1] - a[1]) * f, a[2] + (b[2] - a[2]) * f)


def luminance(rgb: tuple[float, float, float]) -> float:
    """Relative luminance (WCAG 2): the sRGB channels linearised and weighted."""
    lin = [c / 255 / 12.92 if c / 255 <= 0.04045 else ((c / 255 + 0.055) / 1.055) ** 2.4 for c in rgb]
    return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]


def contrast(a: tuple[float, float, float], b: tuple[float, float, float]) -> float:
    """WCAG contrast ratio of two colours, 1 to 21 (4.5 is the minimum for body text)."""
    la, lb = sorted((luminance(a), luminance(b)), reverse=True)
    return (la + 0.05) / (lb + 0.05)


def text_colour(cell: tuple[float, float, float]) -> str:
    """Black or white, whichever contrasts more with ``cell`` (one of them always reaches 4.5)."""
    return "#000000" if contrast(cell, (0, 0, 0)) >= contrast(cell, (255, 255, 255)) else "#ffffff"


def _heat(
    z: list[list[float | None]],
    text: list[list[str]],
    xs: Sequence[str],
    ys: Sequence[str],
    title: str,
    height: int,
    font: int,
) -> Any:
    """A heat map of ``z`` (None: no figure) with ``text`` written on every cell in black or
    white by the cell's luminance."""
    import plotly.graph_objects as go

    vals = [v for row in z for v in row if v is not None]
    top = max([abs(v) for v in vals] + [THRESHOLD * 100 - 100])
    scale, lo, hi = (DIVERGING, -top, top) if any(v < 0 for v in vals) else (SEQUENTIAL, 0.0, top)
    stops = [[i / (len(scale) - 1), c] for i, c in enumerate(scale)]
    fig = go.Figure(
        go.Heatmap(
            z=z,
            x=list(xs),
            y=list(ys),
            zmin=lo,
            zmax=hi,
            colorscale=stops,
            colorbar={"title": {"text": "%"}},
            xgap=2,
            ygap=2,
            hoverongaps=False,
            hovertemplate="%{y} / %{x}: %{z:+.1f}%<extra></extra>",
        )
    )
    notes = []
    for r, y in enumerate(ys):
        for c, x in enumerate(xs):
            v = z[r][c]
            cell = _rgb(EMPTY) if v is None else colour_at(scale, (v - lo) / (hi - lo))
            notes.append(
                {
                    "x": x,
                    "y": y,
                    "text": _html.escape(text[r][c]).replace("\n", "<br>"),
                    "showarrow": False,
                    "font": {"color": text_colour(cell), "size": font},
                }
            )
    fig.update_layout(
        title={"text": title, "font": {"size": 14}},
        annotations=notes,
        plot_bgcolor=EMPTY,
        paper_bgcolor="#ffffff",
        height=height,
        xaxis={"side": "bottom", "showgrid": False, "type": "category"},
        yaxis={"autorange": "reversed", "showgrid": False, "type": "category"},
        margin={"l": 10, "r": 10, "t": 70, "b": 10},
    )
    return fig


def heat_map(data: dict[str, Any]) -> Any:
    """The space x space matrix: above the diagonal the largest coupling over the grid, below it
    the mean (joint over sequential - 1, in %); the diagonal is the mean single-space gain."""
    n = len(SPACES)
    grid: list[list[float | None]] = [[None] * n for _ in range(n)]
    text = [[""] * n for _ in range(n)]
    for name in PAIR_NAMES:
        a, b = name.split("+")
        i, j = SPACES.index(a), SPACES.index(b)
        p = data["pairs"][name]
        for (r, c), key in (((i, j), "max_joint_over_sequential"), ((j, i), "mean_joint_over_sequential")):
            v = p[key]
            grid[r][c] = (v - 1) * 100 if v is not None else None
            text[r][c] = pct(v) + ("\nmax" if key.startswith("max") else "\nmean")
    for k, s in enumerate(SPACES):
        gains = [
            g
            for sc in data["scenarios"]
            for name in PAIR_NAMES
            if s in name.split("+")
            for g in [sc["pairs"][name]["single_a" if name.startswith(s + "+") else "single_b"]]
            if g is not None
        ]
        mean = sum(gains) / len(gains) if gains else None
        text[k][k] = f"{s} alone\n{gain(mean)} mean"
    return _heat(
        grid,
        text,
        SPACES,
        SPACES,
        "joint / sequential - 1 (%): max over scenarios above the diagonal, mean below",
        520,
        13,
    )


def scenario_map(data: dict[str, Any]) -> Any:
    """Joint over sequential in every scenario (rows) and pair (columns); grey: not defined."""
    cols = (*PAIR_NAMES, "all four")
    scs = data["scenarios"]
    z: list[list[float | None]] = []
    text = []
    for sc in scs:
        entries = [sc["pairs"][n] for n in PAIR_NAMES] + [sc["all4"]]
        z.append(
            [(e["joint_over_sequential"] - 1) * 100 if e["joint_over_sequential"] else None for e in entries]
        )
        text.append([_cell(e) for e in entries])
    return _heat(
        z,
        text,
        cols,
        [sc["id"] for sc in scs],
        "joint over sequential - 1 (%) per scenario",
        160 + 24 * len(scs),
        11,
    )


def scale_plot(data: dict[str, Any], key: str, label: str, log: bool) -> Any:
    """Coupling against one scale axis: per pair, the mean and max over the other axes."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(
        rows=1,
        cols=2,
        shared_yaxes=True,
        subplot_titles=("mean over the other axes", "max over the other axes"),
    )
    colours = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#000000")
    for i, name in enumerate((*PAIR_NAMES, "all four")):
        pts: dict[float, list[float]] = {}
        for sc in data["scenarios"]:
            e = sc["all4"] if name == "all four" else sc["pairs"][name]
            if e["joint_over_sequential"] is not None:
                pts.setdefault(float(sc[key]), []).append((e["joint_over_sequential"] - 1) * 100)
        xs = sorted(pts)
        if not xs:
            continue
        line = {"color": colours[i % len(colours)], "dash": "dash" if name == "all four" else "solid"}
        for col, ys in ((1, [sum(pts[x]) / len(pts[x]) for x in xs]), (2, [max(pts[x]) for x in xs])):
            fig.add_trace(
                go.Scatter(
                    x=xs,
                    y=ys,
                    mode="lines+markers",
                    name=name,
                    line=line,
                    legendgroup=name,
                    showlegend=col == 1,
                    hovertemplate=f"{name}<br>{label} %{{x:.3g}}: %{{y:+.1f}}%<extra></extra>",
                ),
                row=1,
                col=col,
            )
    xs_all = sorted({float(sc[key]) for sc in data["scenarios"]})
    fig.update_xaxes(
        title_text=label,
        type="log" if log else "linear",
        tickvals=xs_all,
        ticktext=[f"{x:.3g}" for x in xs_all],
    )
    fig.update_yaxes(title_text="joint over sequential - 1 (%)", row=1, col=1)
    fig.add_hline(
        y=(THRESHOLD - 1) * 100,
        line={"color": "#c0392b", "dash": "dot", "width": 1},
        annotation_text="claim threshold",
        annotation_position="top left",
    )
    fig.update_layout(template="plotly_white", height=420, margin={"t": 60})
    return fig


def _table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    h = "".join(f"<th>{_html.escape(x)}</th>" for x in head)
    body = "".join("<tr>" + "".join(f"<td>{_html.escape(str(x))}</td>" for x in r) + "</tr>" for r in rows)
    return f"<table><tr>{h}</tr>{body}</table>"


class _Plots:
    """Figures as page elements; the first carries plotly.js itself (no network), the others
    use it."""

    def __init__(self) -> None:
        self.embedded = False

    def __call__(self, fig: Any, div_id: str, label: str) -> str:
        body = fig.to_html(full_html=False, include_plotlyjs=not self.embedded, div_id=div_id, config=_CONFIG)
        self.embedded = True
        return f'<div class="plot" role="img" aria-label="{_html.escape(label)}">{body}</div>'


def study_html(data: dict[str, Any]) -> str:
    plot = _Plots()  # in the page's order: the first figure brings plotly.js
    matrix = plot(heat_map(data), "coupling-matrix", "heat map of the coupling matrix")
    by_size = plot(
        scale_plot(data, "params", "model parameters", True), "coupling-size", "coupling against model size"
    )
    by_gpus = plot(scale_plot(data, "gpus", "GPUs", True), "coupling-gpus", "coupling against GPU count")
    per_scenario = plot(scenario_map(data), "coupling-scenarios", "coupling per scenario")
    scen_rows = [
        [sc["id"], f"{sc['params'] / 1e9:.2f}B", str(sc["gpus"]), "yes" if sc["baseline_fits"] else "no"]
        + [_cell(sc["pairs"][n]) for n in PAIR_NAMES]
        + [_cell(sc["all4"]), f"{sc['seconds']:.1f}"]
        for sc in data["scenarios"]
    ]
    defaults = "; ".join(f"{k}: {v}" for k, v in data["defaults"].items())
    lines = "".join(f"<p>{_html.escape(x)}</p>" for x in verdict_lines(data))
    return f"""
<h2>Simulated: the pair matrix (grid {_html.escape(data["grid"])}, {len(data["scenarios"])} scenarios)</h2>
<p class="note">Every figure is the coplan cost model's prediction; every plan was checked by the plan
checker ({data["plans_checked"]:,} plans, {data["invalid_plans"]} invalid). Gains are throughput ratios
over the default plan ({_html.escape(defaults)}). Sequential: one space optimised, then the other with the
first kept (better of the two orders); joint: both optimised together with the same search.</p>
{lines}
<h3>Heat map of the matrix</h3>
{matrix}
{_table(MATRIX_HEAD, matrix_rows(data))}
<p>{_html.escape(all4_line(data))}</p>
<h3>Coupling against scale</h3>
{by_size}
{by_gpus}
<h3>Every scenario</h3>
{per_scenario}
{_table(("scenario", "params", "GPUs", "default fits", *PAIR_NAMES, "all four", "s"), scen_rows)}
"""


def measured_html(data: dict[str, Any]) -> str:
    run = data["run"]
    rows = []
    for c in data["corners"]:
        m, p = c["measured"], c["predicted"]
        rows.append(
            [
                c["fusion"],
                c["remat"],
                str(c["recomputed"]),
                f"{m['step_time_s'] * 1e3:.1f}",
                f"{p['step_time_s'] * 1e3:.1f}",
                f"{m['saved_activation_bytes'] / 1e6:.2f}",
                f"{p['saved_activation_bytes'] / 1e6:.2f}",
                f"{m['peak_bytes'] / 1e6:.1f}",
                f"{p['peak_bytes'] / 1e6:.1f}",
                f"{c['groups_honoured']}/{c['groups_planned']}",
            ]
        )
    fac = [
        [
            r["remat"],
            src,
            gain(r[src]["fusion"]),
            gain(r[src]["remat"]),
            gain(r[src]["both"]),
            signed(r[src]["interaction"]),
        ]
        for r in data["factorial"]
        for src in ("measured", "predicted")
    ]
    pair = data["pairs"]["fusion+remat"]
    prow = [
        [src]
        + [
            gain(pair[src][k])
            for k in ("single_a", "single_b", "a_then_b", "b_then_a", "sequential", "joint")
        ]
        + [signed(pair[src]["interaction"]), pct(pair[src]["joint_over_sequential"])]
        for src in ("measured", "predicted")
    ]
    notes = "".join(f"<p class='note'>{_html.escape(n)}</p>" for n in data["notes"])
    corner_head = (
        "fusion",
        "remat",
        "recomputed",
        "step ms meas",
        "step ms pred",
        "saved MB meas",
        "saved MB pred",
        "peak MB meas",
        "peak MB pred",
        "groups honoured",
    )
    fac_head = ("remat", "source", "fusion alone", "remat alone", "both", "interaction")
    pair_head = ("source", "single_a", "single_b", "a_then_b", "b_then_a", "sequential", "joint")
    return f"""
<h2>Measured: fusion x remat on {_html.escape(run["device_name"])}</h2>
<p class="note">{_html.escape(run["model"])}, batch {run["global_batch"]} x seq {run["seq"]},
{run["steps"]} steps per run, predicted with {_html.escape(run["cluster"])}.</p>
{_table(corner_head, rows)}
{_table(fac_head, fac)}
{_table((*pair_head, "interaction", "joint/seq"), prow)}
{notes}
"""


def write_html(path: Any, study: dict[str, Any] | None, measured: dict[str, Any] | None) -> None:
    """One self-contained HTML file with whichever of the two results is given."""
    parts = []
    if study is not None:
        parts.append(study_html(study))
    if measured is not None:
        parts.append(measured_html(measured))
    doc = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>coplan coupling</title><style>{_CSS}</style></head><body>
<h1>coplan coupling: do fusion, remat, parallelism and precision interact?</h1>
{"".join(parts)}
</body></html>
"""
    from pathlib import Path

    write_text(Path(path), doc, "--html")
