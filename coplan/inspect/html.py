"""``coplan inspect --html``: one self-contained page of an inspect record.

The pass timeline (every pass of every graph, its fingerprint and op-count change, the passes that
changed the graph marked), fallbacks, graph breaks, the unfused-pattern table with each pattern's
predicted cost, the kernel table, and lineage search: type an op or kernel name, see where it went.
No network: the record is embedded as JSON and rendered by a few lines of script; every string
from the record reaches the page as text, never as markup.
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

from coplan.fileio import write_text

_STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#222;max-width:1200px}
h1{font-size:20px}h2{font-size:16px;margin-top:28px}
table{border-collapse:collapse;width:100%;margin:8px 0}
th,td{border-bottom:1px solid #ddd;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#f4f4f4}td.n{text-align:right;font-variant-numeric:tabular-nums}
tr.changed td{background:#fff7e0}code,.fp{font-family:ui-monospace,monospace;font-size:12px}
.bar{display:inline-block;height:8px;background:#4a7bd0;vertical-align:middle}
.muted{color:#777}#lineage-results li{margin:2px 0}input{font-size:14px;padding:4px;width:420px}
"""


def _script() -> str:
    from importlib.resources import files

    return files("coplan.inspect").joinpath("report.js").read_text(encoding="utf-8")


def _fmt_s(x: Any) -> str:
    return "-" if x is None else f"{float(x) * 1e3:.3f} ms"


def render(record: dict[str, Any]) -> str:
    e = html.escape
    measured = record.get("measured") or {}
    head = [
        ("model", f"{record.get('model')} (batch {record.get('batch')}, seq {record.get('seq')})"),
        ("device", f"{record.get('device')} (priced as {record.get('hardware')})"),
        ("torch", record.get("torch")),
        ("fingerprint", record.get("fingerprint")),
        ("kernels", f"{record.get('kernels')} ({record.get('bytes_moved', 0) / 2**20:.1f} MiB moved)"),
        (
            "step",
            f"predicted {_fmt_s(record.get('predicted_step_s'))}, measured {_fmt_s(measured.get('step_s'))}",
        ),
        ("compile", f"{record.get('compile_s', 0):.1f} s"),
    ]
    rows = "".join(f"<tr><th>{e(k)}</th><td>{e(str(v))}</td></tr>" for k, v in head)
    # a "</script>" inside the JSON would end its element early: every "<" goes as its JSON escape
    data = json.dumps(record, default=str).replace("<", "\\u003c")
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>coplan inspect: {e(str(record.get("model")))}</title>
<style>{_STYLE}</style></head><body>
<h1>coplan inspect: {e(str(record.get("model")))}</h1>
<table id="summary">{rows}</table>
<h2>Pass timeline</h2>
<p class="muted">Every pass of every graph in the order it ran; highlighted rows changed the op count
or are a stage boundary. Two runs of the same program give the same fingerprints; the first pass
whose fingerprint differs is where they diverged.</p>
<table id="passes"><thead><tr><th>graph</th><th>stage</th><th>pass</th><th>fingerprint</th>
<th>ops in</th><th>ops out</th><th>delta</th><th></th></tr></thead><tbody></tbody></table>
<h2>Unfused patterns</h2>
<p class="muted">Adjacent ops in different kernels that coplan's fusion rules let one kernel hold,
with Inductor's reason where it logged one and what fusing them would save per step (cost model).</p>
<table id="unfused"><thead><tr><th>graph</th><th>ops</th><th>count</th><th>via</th><th>reason</th>
<th>saving</th></tr></thead><tbody></tbody></table>
<h2>Fallbacks</h2>
<table id="fallbacks"><thead><tr><th>graph</th><th>op</th><th>count</th><th>reason</th></tr></thead>
<tbody></tbody></table>
<h2>Graph breaks</h2>
<table id="breaks"><thead><tr><th>frame</th><th>location</th><th>reason</th></tr></thead>
<tbody></tbody></table>
<h2>Lineage</h2>
<p><input id="lineage-q" placeholder="an op (forward/mul_3) or a kernel (cpp_fused_...)"></p>
<ul id="lineage-results"></ul>
<h2>Kernels</h2>
<table id="kernels"><thead><tr><th>graph</th><th>kernel</th><th>kind</th><th>from</th><th>bytes</th>
<th>predicted</th></tr></thead><tbody></tbody></table>
<script type="application/json" id="record">{data}</script>
<script>{_script()}</script>
</body></html>
"""


def write_html(record: dict[str, Any], path: Path) -> Path:
    write_text(path, render(record), option="--html")
    return path
