"""Tables and the HTML report of ``coplan coupling``, drawn from the JSON object the study prints
(``coupling.to_json`` / ``coupling_measure.to_json``), so a saved result renders the same way.

The HTML report is one self-contained file (figures are PNGs embedded as base64, no scripts, no
network): a heat map of the pair matrix, a heat map of the coupling in every scenario, the
coupling against model size and against GPU count, and the tables.
"""

from __future__ import annotations

import base64
import html as _html
import io
import math
from collections.abc import Sequence
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from coplan.experiments.coupling import PAIR_NAMES, SPACES, THRESHOLD

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


def _png(fig: Any) -> str:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def heat_map(data: dict[str, Any]) -> str:
    """The space x space matrix: above the diagonal the largest coupling over the grid, below it
    the mean (joint over sequential - 1, in %); the diagonal is the mean single-space gain."""
    plt = _pyplot()
    n = len(SPACES)
    grid = [[math.nan] * n for _ in range(n)]
    text = [[""] * n for _ in range(n)]
    for name in PAIR_NAMES:
        a, b = name.split("+")
        i, j = SPACES.index(a), SPACES.index(b)
        p = data["pairs"][name]
        for (r, c), key in (((i, j), "max_joint_over_sequential"), ((j, i), "mean_joint_over_sequential")):
            v = p[key]
            grid[r][c] = (v - 1) * 100 if v is not None else math.nan
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
    fig, ax = plt.subplots(figsize=(6.4, 5.4), dpi=110)
    vmax = max([abs(v) for row in grid for v in row if not math.isnan(v)] + [THRESHOLD * 100 - 100])
    im = ax.imshow(grid, cmap="Reds", vmin=0, vmax=vmax)
    for r in range(n):
        for c in range(n):
            ax.text(c, r, text[r][c], ha="center", va="center", fontsize=8)
    ax.set_xticks(range(n), SPACES)
    ax.set_yticks(range(n), SPACES)
    ax.set_title("joint / sequential - 1 (%)\nmax over scenarios above the diagonal, mean below", fontsize=10)
    fig.colorbar(im, ax=ax, label="%")
    return _png(fig)


def scenario_map(data: dict[str, Any]) -> str:
    """Joint over sequential in every scenario (rows) and pair (columns); grey: not defined."""
    plt = _pyplot()
    cols = (*PAIR_NAMES, "all four")
    scs = data["scenarios"]
    vals = []
    for sc in scs:
        entries = [sc["pairs"][n] for n in PAIR_NAMES] + [sc["all4"]]
        vals.append(
            [
                (e["joint_over_sequential"] - 1) * 100 if e["joint_over_sequential"] else math.nan
                for e in entries
            ]
        )
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.26 * len(scs)), dpi=100)
    cmap = plt.get_cmap("Reds").with_extremes(bad="#ddd")
    vmax = max([v for row in vals for v in row if not math.isnan(v)] + [THRESHOLD * 100 - 100])
    im = ax.imshow(vals, cmap=cmap, vmin=0, vmax=vmax, aspect="auto")
    for r, sc in enumerate(scs):
        entries = [sc["pairs"][n] for n in PAIR_NAMES] + [sc["all4"]]
        for c, e in enumerate(entries):
            ax.text(c, r, _cell(e), ha="center", va="center", fontsize=6)
    ax.set_xticks(range(len(cols)), cols, rotation=30, ha="right", fontsize=8)
    ax.set_yticks(range(len(scs)), [sc["id"] for sc in scs], fontsize=6)
    ax.set_title("joint over sequential - 1 (%) per scenario")
    fig.colorbar(im, ax=ax, label="%")
    return _png(fig)


def scale_plot(data: dict[str, Any], key: str, label: str, log: bool) -> str:
    """Coupling against one scale axis: per pair, the mean and max over the other axes."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), dpi=100, sharey=True)
    for name in (*PAIR_NAMES, "all four"):
        pts: dict[float, list[float]] = {}
        for sc in data["scenarios"]:
            e = sc["all4"] if name == "all four" else sc["pairs"][name]
            if e["joint_over_sequential"] is not None:
                pts.setdefault(float(sc[key]), []).append((e["joint_over_sequential"] - 1) * 100)
        xs = sorted(pts)
        if not xs:
            continue
        style = "k--" if name == "all four" else "-"
        axes[0].plot(xs, [sum(pts[x]) / len(pts[x]) for x in xs], style, marker="o", label=name)
        axes[1].plot(xs, [max(pts[x]) for x in xs], style, marker="o", label=name)
    from matplotlib.ticker import NullFormatter

    xs_all = sorted({float(sc[key]) for sc in data["scenarios"]})
    for ax, what in zip(axes, ("mean", "max"), strict=True):
        if log:
            ax.set_xscale("log")
            ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xticks(xs_all, [f"{x:.3g}" for x in xs_all])
        ax.axhline((THRESHOLD - 1) * 100, color="red", linestyle=":", linewidth=1, label="claim threshold")
        ax.set_xlabel(label)
        ax.set_title(f"{what} over the other axes")
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("joint over sequential - 1 (%)")
    axes[1].legend(fontsize=7)
    return _png(fig)


def _table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    h = "".join(f"<th>{_html.escape(x)}</th>" for x in head)
    body = "".join("<tr>" + "".join(f"<td>{_html.escape(str(x))}</td>" for x in r) + "</tr>" for r in rows)
    return f"<table><tr>{h}</tr>{body}</table>"


def _img(b64: str, alt: str) -> str:
    return f'<p><img alt="{_html.escape(alt)}" src="data:image/png;base64,{b64}"></p>'


def study_html(data: dict[str, Any]) -> str:
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
{_img(heat_map(data), "heat map of the coupling matrix")}
{_table(MATRIX_HEAD, matrix_rows(data))}
<p>{_html.escape(all4_line(data))}</p>
<h3>Coupling against scale</h3>
{_img(scale_plot(data, "params", "model parameters", True), "coupling against model size")}
{_img(scale_plot(data, "gpus", "GPUs", True), "coupling against GPU count")}
<h3>Every scenario</h3>
{_img(scenario_map(data), "coupling per scenario")}
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

    Path(path).write_text(doc, encoding="utf-8")
