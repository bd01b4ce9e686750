"""The HTML report of ``coplan compare``: every plan the strategies priced, memory against step
time, with each strategy's chosen plan marked, and a table of what each decided."""

from __future__ import annotations

import base64
import html as _html
import io
from pathlib import Path
from typing import TYPE_CHECKING

from coplan.cli.common import human_bytes

if TYPE_CHECKING:
    from coplan.plan.context import PlanContext
    from coplan.search.result import StrategyResult


_CSS = (
    "body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
    "td,th{border:1px solid #ccc;padding:4px 8px;font-size:13px}"
)


def _plot(ctx: PlanContext, results: dict[str, StrategyResult]) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    pts = [p for r in results.values() for p in r.considered]
    fit = [p for p in pts if p.fits]
    over = [p for p in pts if not p.fits]
    if fit:
        ax.scatter(
            [p.step_time_s * 1e3 for p in fit],
            [p.peak_bytes / 2**30 for p in fit],
            s=8,
            c="#9ab",
            alpha=0.5,
            label=f"plans priced that fit ({len(fit)})",
        )
    if over:
        ax.scatter(
            [p.step_time_s * 1e3 for p in over],
            [p.peak_bytes / 2**30 for p in over],
            s=8,
            c="#dbb",
            alpha=0.5,
            label=f"plans priced over budget ({len(over)})",
        )
    markers = "o^sDvP*X"
    for i, (name, r) in enumerate(results.items()):
        ax.scatter(
            [r.step_time_s * 1e3],
            [r.estimate.memory.peak_bytes / 2**30],
            s=90,
            marker=markers[i % len(markers)],
            edgecolors="black",
            zorder=5,
            label=f"{name}",
        )
    ax.axhline(ctx.budget / 2**30, color="red", linestyle="--", linewidth=1, label="memory budget")
    ax.set_xscale("log")
    ax.set_xlabel("predicted step time (ms, log)")
    ax.set_ylabel("peak memory per GPU (GiB)")
    ax.set_title(f"{ctx.model_name} on {ctx.gpus} x {ctx.cluster.groups[0].device.name}")
    ax.legend(fontsize=8, loc="best")
    ax.grid(True, alpha=0.3)
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def write_html(path: Path, ctx: PlanContext, results: dict[str, StrategyResult]) -> None:
    from coplan.plan import plan_summary

    img = _plot(ctx, results)
    rows = []
    for name, r in results.items():
        e = r.estimate
        s = plan_summary(r.plan, e, ctx.index)
        rows.append(
            "<tr>"
            + "".join(
                f"<td>{_html.escape(str(x))}</td>"
                for x in (
                    name,
                    f"{e.step_time_s * 1e3:.2f}",
                    f"{e.tokens_per_s:,.0f}",
                    f"{e.mfu:.1%}",
                    human_bytes(e.memory.peak_bytes),
                    "yes" if r.fits else "no",
                    f"{r.plan_time_s:.2f}",
                    s["parallel"],
                    s["remat"],
                    s["fusion"],
                    s["precision"],
                    r.plan.fingerprint,
                )
            )
            + "</tr>"
        )
    head = "".join(
        f"<th>{h}</th>"
        for h in (
            "strategy",
            "step ms",
            "tokens/s",
            "MFU",
            "peak",
            "fits",
            "plan s",
            "parallel",
            "remat",
            "fusion",
            "precision",
            "fingerprint",
        )
    )
    title = f"coplan compare: {ctx.model_name} on {ctx.cluster.summary()}"
    doc = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{_html.escape(title)}</title>
<style>{_CSS}</style>
</head><body>
<h1>{_html.escape(title)}</h1>
<p>Global batch {ctx.global_batch} x sequence {ctx.seq}; memory budget {human_bytes(ctx.budget)} per GPU.
Every figure is the coplan cost model's prediction; every plan was checked by the plan checker.</p>
<img alt="memory against step time" src="data:image/png;base64,{img}">
<table><tr>{head}</tr>{"".join(rows)}</table>
</body></html>
"""
    path.write_text(doc, encoding="utf-8")
