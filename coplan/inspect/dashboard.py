"""``coplan dashboard``: a local web page over the inspect history.

A standard-library ``ThreadingHTTPServer`` bound to 127.0.0.1 serves one self-contained page (plotly's
JavaScript is embedded from the installed ``plotly`` package, so the page works with no network) and
a small JSON API the page reads:

- ``/api/models``: the models in the history;
- ``/api/records?model=M[&kind=K]``: one summary row per record, oldest first, each with the id of
  the record it is compared against (``previous_id``) and the regressions ``diff.check`` finds there;
- ``/api/record/<id>``: one whole record;
- ``/api/diff/<a>/<b>``: ``diff.diff(a, b)`` and ``diff.check(a, b)``.

The history is only read: every request opens it with ``create=False`` in its own thread (a SQLite
connection must not cross threads) and closes it again, so records that ``coplan inspect`` adds
while the page is open show on the next reload.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import threading
from collections.abc import Callable
from functools import lru_cache
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlsplit

from coplan.errors import CoplanError, Interrupted

if TYPE_CHECKING:
    from coplan.inspect.history import History

HOST = "127.0.0.1"
DEFAULT_PORT = 8050

_RECORD = re.compile(r"^/api/record/(\d{1,18})$")
_DIFF = re.compile(r"^/api/diff/(\d{1,18})/(\d{1,18})$")


class DashboardError(CoplanError):
    """A history the dashboard cannot serve, or a port it cannot bind (exit code 2)."""


class _NotFound(Exception):
    """A request for a record, model or route that does not exist (HTTP 404)."""


# --- the history, read per request ----------------------------------------------------------------


def _open(db: Path) -> History:
    """The history at ``db``, opened without creating anything; use it in a ``with``."""
    from coplan.inspect.history import History

    return History(db, create=False)


def check_db(db: Path) -> list[str]:
    """The models of the history at ``db``; a ``DashboardError`` naming ``db`` if it is missing, not a
    file, unreadable or not a coplan history. Run before serving, so a wrong ``--db`` is one line."""
    import sqlite3

    from coplan.inspect.history import HistoryError

    if not db.exists():
        raise DashboardError(f"--db {db}: no such file (coplan inspect writes the history)")
    if not db.is_file():
        raise DashboardError(f"--db {db}: not a file")
    if not os.access(db, os.R_OK):
        raise DashboardError(f"--db {db}: not readable")
    try:
        with _open(db) as history:
            return list(history.models())
    except HistoryError as err:
        raise DashboardError(f"--db: {err}") from None
    except sqlite3.Error as err:  # a file that breaks SQLite past the history's own checks
        raise DashboardError(f"--db {db}: not a coplan history: {err}") from None


def records(db: Path, model: str, kind: str | None = None) -> dict[str, Any]:
    """The records of ``model`` (of ``kind``, if given), oldest first, each with ``previous_id`` and the
    regressions ``check(previous, record)`` reports; ``kinds`` lists every kind the model has."""
    from coplan.inspect.diff import check

    with _open(db) as history:
        if model not in history.models():
            raise _NotFound(f"no records of model {model!r}")
        every = history.rows(model=model)
        kinds = sorted({str(row.get("kind")) for row in every})
        rows = [row for row in every if kind is None or row.get("kind") == kind]
        rows.reverse()  # rows() is newest first (by time, then id); the plots run left to right
        # Each record's baseline is the one before it of its kind in this order: the record
        # History.previous names, without a query per record.
        before: dict[str, dict[str, Any]] = {}
        out = []
        for row in rows:
            whole = history.get(row["id"])
            previous = before.get(row["kind"])
            before[row["kind"]] = whole
            entry = dict(row)
            entry["previous_id"] = None if previous is None else previous.get("record_id")
            entry["regressions"] = [] if previous is None else check(previous, whole)
            out.append(entry)
    return {"model": model, "kind": kind, "kinds": kinds, "records": out}


def record(db: Path, record_id: int) -> dict[str, Any]:
    """The whole record ``record_id``."""
    from coplan.inspect.history import HistoryError

    with _open(db) as history:
        try:
            return dict(history.get(record_id))
        except HistoryError as err:
            raise _NotFound(str(err)) from None


def diff_of(db: Path, a: int, b: int) -> dict[str, Any]:
    """Record ``a`` against record ``b``: the pass-by-pass diff and the regressions of ``b``."""
    from coplan.inspect.diff import check, diff

    first, second = record(db, a), record(db, b)
    return {"a": a, "b": b, "diff": diff(first, second), "regressions": check(first, second)}


# --- the page ---------------------------------------------------------------------------------------


@lru_cache(maxsize=1)
def _plotly_js() -> str:
    from plotly.offline import get_plotlyjs

    # "</script" inside an inline script would end it; "<\/script" is the same string to JavaScript.
    return get_plotlyjs().replace("</script", "<\\/script")


def page(db: Path) -> str:
    """The dashboard's HTML, whole: no request leaves the machine. Data is fetched from the API and
    put in the document as text nodes only, never parsed as HTML."""
    from html import escape

    return (
        _PAGE.replace("{{DB}}", escape(str(db)))
        .replace("/*{{PLOTLY}}*/", _plotly_js())
        .replace("/*{{APP}}*/", _APP_JS)
    )


# --- the server -------------------------------------------------------------------------------------


class DashboardServer(ThreadingHTTPServer):
    """The HTTP server, holding the history path and the page (built once: plotly is 4 MB)."""

    daemon_threads = True

    def __init__(self, db: Path, port: int = DEFAULT_PORT, host: str = HOST) -> None:
        self.db = db
        self.page = page(db).encode()
        super().__init__((host, port), _Handler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host!s}:{port}/"


_SECURITY_HEADERS = {
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-store",
}


class _Handler(BaseHTTPRequestHandler):
    server: DashboardServer
    server_version = "coplan-dashboard"

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: the terminal shows the URL, not one line per request."""

    def do_GET(self) -> None:
        if not self._host_allowed():
            # A page on another site can point its own name at 127.0.0.1 (DNS rebinding); only the
            # names of this machine may read the history.
            self._json(HTTPStatus.FORBIDDEN, {"error": "forbidden host"})
            return
        url = urlsplit(self.path)
        path = url.path
        try:
            if path in ("/", "/index.html"):
                self._send(HTTPStatus.OK, "text/html; charset=utf-8", self.server.page, page=True)
            elif path == "/api/models":
                with _open(self.server.db) as history:
                    self._json(HTTPStatus.OK, {"db": str(self.server.db), "models": list(history.models())})
            elif path == "/api/records":
                query = parse_qs(url.query)
                model = query.get("model", [""])[0]
                if not model:
                    self._json(HTTPStatus.BAD_REQUEST, {"error": "model= is required"})
                    return
                kind = query.get("kind", [None])[0] or None
                self._json(HTTPStatus.OK, records(self.server.db, model, kind))
            elif match := _RECORD.match(path):
                self._json(HTTPStatus.OK, record(self.server.db, int(match[1])))
            elif match := _DIFF.match(path):
                self._json(HTTPStatus.OK, diff_of(self.server.db, int(match[1]), int(match[2])))
            elif path == "/favicon.ico":
                self._send(HTTPStatus.NO_CONTENT, "image/x-icon", b"")
            else:
                self._json(HTTPStatus.NOT_FOUND, {"error": f"no such page: {path}"})
        except _NotFound as err:
            self._json(HTTPStatus.NOT_FOUND, {"error": str(err)})
        except (BrokenPipeError, ConnectionResetError):
            pass  # the browser went away mid-answer
        except Exception as err:  # a broken record must not take the server down with it
            self._json(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": f"{type(err).__name__}: {err}"})

    def _host_allowed(self) -> bool:
        host = (self.headers.get("Host") or "").strip().lower()
        port = self.server.server_address[1]
        return host in {f"127.0.0.1:{port}", f"localhost:{port}", "127.0.0.1", "localhost"}

    def _json(self, status: HTTPStatus, data: Any) -> None:
        body = json.dumps(_finite(data), default=str, allow_nan=False).encode()
        self._send(status, "application/json; charset=utf-8", body)

    def _send(self, status: HTTPStatus, content_type: str, body: bytes, *, page: bool = False) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in _SECURITY_HEADERS.items():
            self.send_header(name, value)
        if page:
            # Inline scripts only (the page is one file), data from this server only, nothing else.
            self.send_header(
                "Content-Security-Policy",
                "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                "img-src data: blob:; font-src data:; connect-src 'self'; base-uri 'none'; "
                "form-action 'none'; frame-ancestors 'none'",
            )
        self.end_headers()
        self.wfile.write(body)


def _finite(data: Any) -> Any:
    """``data`` with NaN and infinity as null: the browser's JSON parser refuses them, and a diff of
    two records may divide by a zero step time."""
    if isinstance(data, float) and not math.isfinite(data):
        return None
    if isinstance(data, dict):
        return {str(k): _finite(v) for k, v in data.items()}
    if isinstance(data, list | tuple):
        return [_finite(v) for v in data]
    return data


def serve(
    db: Path,
    port: int = DEFAULT_PORT,
    *,
    open_browser: bool = False,
    announce: Callable[[str], None] | None = None,
    ready: threading.Event | None = None,
) -> None:
    """Serve the dashboard of the history at ``db`` on 127.0.0.1:``port`` (0: a free port) until
    Ctrl-C, which ends it as ``Interrupted`` (exit 130) after closing the socket.

    Checked before serving: the history (``check_db``) and the port; either wrong is a one-line
    ``DashboardError``.
    """
    db = Path(os.path.expanduser(str(db)))
    if isinstance(port, bool) or not 0 <= port <= 65535:
        raise DashboardError(f"--port {port}: must be 0 (any free port) to 65535")
    models = check_db(db)
    try:
        server = DashboardServer(db, port)
    except OSError as err:
        raise DashboardError(f"--port {port}: cannot listen on {HOST}: {err.strerror or err}") from None
    say = announce or _print
    say(f"coplan dashboard: {len(models)} model(s) in {db}\nserving {server.url} (Ctrl-C stops)")
    if open_browser:
        import webbrowser

        threading.Thread(target=webbrowser.open, args=(server.url,), daemon=True).start()
    if ready is not None:
        ready.set()
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        raise Interrupted("dashboard stopped; the history was only read") from None
    finally:
        server.server_close()


def _print(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>coplan dashboard</title>
<style>
body { font-family: system-ui, sans-serif; margin: 1rem 2rem; color: #222; }
header { display: flex; gap: 1.5rem; align-items: baseline; flex-wrap: wrap; }
h1 { font-size: 1.3rem; margin: 0; }
.db { color: #666; font-family: monospace; }
.plots { display: grid; grid-template-columns: repeat(auto-fit, minmax(480px, 1fr)); gap: 0.5rem; }
.plot { height: 280px; }
table { border-collapse: collapse; font-size: 0.9rem; margin: 0.5rem 0; }
th, td { border: 1px solid #ddd; padding: 0.2rem 0.5rem; text-align: left; vertical-align: top; }
th { background: #f4f4f4; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
td.nowrap { white-space: nowrap; }
code, .fp { font-family: monospace; }
tr.changed td { background: #fff8e1; }
tr.first-divergence td { background: #ffcdd2; font-weight: bold; }
.added { color: #b71c1c; }
.removed { color: #1b5e20; }
.muted { color: #777; }
#status { color: #b71c1c; }
#diff-panel { border-top: 2px solid #333; margin-top: 1rem; padding-top: 0.5rem; }
#diff-panel[hidden] { display: none; }
</style>
<script>/*{{PLOTLY}}*/</script>
</head>
<body>
<header>
  <h1>coplan dashboard</h1>
  <label>model <select id="model-select"></select></label>
  <label>kind <select id="kind-select"></select></label>
  <span class="db">{{DB}}</span>
  <span id="status" role="status"></span>
</header>
<p class="muted">One point per record, oldest on the left; red points are regressions against the
previous record of the same model. Click a point to see its diff against the previous record.</p>
<div class="plots">
  <div id="plot-kernels" class="plot"></div>
  <div id="plot-fallbacks" class="plot"></div>
  <div id="plot-unfused" class="plot"></div>
  <div id="plot-step" class="plot"></div>
</div>
<h2>Regressions</h2>
<table id="regressions">
  <thead><tr><th>record</th><th>created</th><th>kind</th><th>what</th><th>diff</th></tr></thead>
  <tbody></tbody>
</table>
<p id="no-regressions" class="muted" hidden>No regressions among these records.</p>
<section id="diff-panel" hidden>
  <h2 id="diff-title"></h2>
  <div id="diff-summary"></div>
  <div id="diff-regressions"></div>
  <h3>Passes</h3>
  <p id="diff-first-divergence"></p>
  <table id="diff-passes">
    <thead><tr><th>#</th><th>graph</th><th>pass</th><th>stage</th><th>fingerprint a</th>
    <th>fingerprint b</th><th>ops after</th><th></th></tr></thead>
    <tbody></tbody>
  </table>
  <div id="diff-lists"></div>
</section>
<script>/*{{APP}}*/</script>
</body>
</html>
"""

# The page's own code. Everything that came from a record reaches the document through
# textContent or a plotly text field escaped by esc(): op names and paths are data, never markup.
_APP_JS = r"""
"use strict";
const state = { all: [], records: [], byId: new Map() };

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v; else node.setAttribute(k, v);
  }
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}
// plotly renders a small HTML subset in text fields; escaping makes record strings plain text there
function esc(s) {
  return String(s).replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;")
    .replace(/"/g, "&quot;").replace(/'/g, "&#39;");
}
function status(text) { document.getElementById("status").textContent = text || ""; }
async function api(path) {
  const response = await fetch(path, { headers: { Accept: "application/json" } });
  const data = await response.json();
  if (!response.ok) throw new Error(data.error || response.statusText);
  return data;
}
function fmt(v) {
  if (v === null || v === undefined) return "";
  if (typeof v === "number") return Number.isInteger(v) ? String(v) : v.toPrecision(4);
  if (typeof v === "object") return JSON.stringify(v);
  return String(v);
}
function describe(item) {
  // a fallback, an unfused pattern or a kernel: whatever names it, as one line of text
  if (item === null || typeof item !== "object") return String(item);
  const parts = [];
  if (item.graph) parts.push(item.graph + ":");
  if (item.op) parts.push(item.op);
  if (Array.isArray(item.ops)) parts.push(item.ops.join(" + "));
  if (item.name) parts.push(item.name);
  if (item.location) parts.push("at " + item.location);
  if (Array.isArray(item.aten) && item.aten.length) parts.push("[" + item.aten.join(", ") + "]");
  if (item.count_a !== undefined) parts.push("x" + item.count_a + " \u2192 x" + item.count_b);
  else if (item.count !== undefined && item.count !== 1) parts.push("x" + item.count);
  if (item.reason) parts.push("(" + item.reason + ")");
  return parts.length ? parts.join(" ") : JSON.stringify(item);
}

async function loadModels() {
  const data = await api("/api/models");
  const select = document.getElementById("model-select");
  select.replaceChildren(...data.models.map((m) => el("option", { value: m }, m)));
  if (!data.models.length) { status("The history has no records yet."); return; }
  const wanted = new URLSearchParams(location.search).get("model");
  if (wanted && data.models.includes(wanted)) select.value = wanted;
  await loadRecords();
}

async function loadRecords() {
  const model = document.getElementById("model-select").value;
  const data = await api("/api/records?model=" + encodeURIComponent(model));
  state.all = data.records;
  const kindSelect = document.getElementById("kind-select");
  // inspect records are the ones with kernels, fallbacks and unfused patterns: shown first
  kindSelect.replaceChildren(...data.kinds.map((k) => el("option", { value: k }, k)));
  kindSelect.value = data.kinds.includes("inspect") ? "inspect" : data.kinds[0];
  showKind();
}

function showKind() {
  const kind = document.getElementById("kind-select").value;
  state.records = state.all.filter((r) => r.kind === kind);
  state.byId = new Map(state.records.map((r) => [r.id, r]));
  draw();
  regressionsTable();
  document.body.dataset.loaded = String(state.records.length);
}

// history times are UTC ISO-8601 ("2026-11-27T11:30:00Z"); plotly's date axis takes them without
// the zone, and would make a category axis of them with it
function plotTime(created) {
  return String(created || "").replace("T", " ").replace(/(Z|[+-]\d\d:?\d\d)$/, "");
}

function draw() {
  const recs = state.records;
  const x = recs.map((r) => plotTime(r.created));
  const bad = recs.map((r) => r.regressions.length > 0);
  const custom = recs.map((r) => r.id);
  const hover = recs.map((r) => esc("#" + r.id + " " + (r.fingerprint || "") +
    (r.git_commit ? " @" + String(r.git_commit).slice(0, 10) : "") +
    (r.regressions.length ? " - " + r.regressions.map((g) => g.message).join("; ") : "")));
  const marker = { color: bad.map((b) => (b ? "#d32f2f" : "#1f77b4")), size: bad.map((b) => (b ? 12 : 7)),
    symbol: bad.map((b) => (b ? "x" : "circle")) };
  const layout = (title, ytitle) => ({ title: { text: esc(title) }, margin: { l: 55, r: 15, t: 40, b: 40 },
    xaxis: { title: { text: "created (UTC)" } }, yaxis: { title: { text: ytitle }, rangemode: "tozero" },
    showlegend: false, hovermode: "closest" });
  const config = { displaylogo: false, responsive: true };
  const series = (field, name) => [{ x, y: recs.map((r) => r[field]), customdata: custom, text: hover,
    name, mode: "lines+markers", type: "scatter", marker, hovertemplate: "%{y}<br>%{text}<extra></extra>" }];
  const plots = [
    ["plot-kernels", series("kernels", "kernels"), layout("Kernels per step", "kernels")],
    ["plot-fallbacks", series("fallbacks", "fallbacks"), layout("Fallback kernels", "fallbacks")],
    ["plot-unfused", series("unfused", "unfused"), layout("Unfused patterns", "patterns")],
    ["plot-step", [
      Object.assign(series("predicted_step_s", "predicted")[0], { line: { dash: "dot" } }),
      Object.assign(series("measured_step_s", "measured")[0], { line: { color: "#2ca02c" } }),
    ], Object.assign(layout("Step time", "seconds"), { showlegend: true })],
  ];
  for (const [id, traces, lay] of plots) {
    const gd = document.getElementById(id);
    Plotly.react(gd, traces, lay, config);
    if (!gd.dataset.bound) {
      gd.on("plotly_click", (event) => {
        const point = event.points && event.points[0];
        if (point) showDiffOf(point.customdata);
      });
      gd.dataset.bound = "1";
    }
  }
}

function diffLink(a, b) {
  const attrs = { href: `#diff/${a}/${b}`, class: "diff-link", "data-a": String(a), "data-b": String(b) };
  return el("a", attrs, "#" + a + " \u2192 #" + b);
}

function regressionsTable() {
  const body = document.querySelector("#regressions tbody");
  const rows = [];
  for (const r of state.records) {
    for (const g of r.regressions) {
      rows.push(el("tr", { "data-record": String(r.id) }, el("td", {}, "#" + r.id),
        el("td", { class: "nowrap" }, r.created), el("td", {}, g.kind), el("td", {}, g.message),
        el("td", { class: "nowrap" }, diffLink(r.previous_id, r.id))));
    }
  }
  body.replaceChildren(...rows);
  document.getElementById("no-regressions").hidden = rows.length > 0;
}

function showDiffOf(id) {
  const r = state.byId.get(id);
  if (!r) return;
  if (r.previous_id === null || r.previous_id === undefined) {
    openPanel("#" + id + ": the first record of " + r.model + "; nothing earlier to compare against");
    return;
  }
  goTo("#diff/" + r.previous_id + "/" + id);
}

// a diff is a link (#diff/A/B); following the one already open shows it again
function goTo(hash) {
  if (location.hash === hash) route(); else location.hash = hash;
}

function openPanel(title) {
  const panel = document.getElementById("diff-panel");
  panel.hidden = false;
  document.getElementById("diff-title").textContent = title;
  for (const id of ["diff-summary", "diff-regressions", "diff-first-divergence", "diff-lists"]) {
    document.getElementById(id).replaceChildren();
  }
  document.querySelector("#diff-passes tbody").replaceChildren();
  delete panel.dataset.a; delete panel.dataset.b;
  return panel;
}

function pct(change) {
  return typeof change === "number" ? " (" + (change >= 0 ? "+" : "") + (100 * change).toFixed(1) + "%)" : "";
}

function arrow(part, unit) {
  // "a -> b" of one {a, b, ...} entry of the diff, with the change where it has one
  if (!part) return null;
  const side = (v) => (v === null || v === undefined ? "-" : fmt(v) + (unit || ""));
  const delta = typeof part.delta === "number" ? " (" + (part.delta >= 0 ? "+" : "") + part.delta + ")" : "";
  return side(part.a) + " \u2192 " + side(part.b) + delta + pct(part.change);
}

async function openDiff(a, b) {
  const data = await api("/api/diff/" + a + "/" + b);
  const d = data.diff;
  const panel = openPanel("Diff: record #" + a + " \u2192 #" + b);

  const facts = [
    ["fingerprint", d.fingerprint && (fmt(d.fingerprint.a) + " \u2192 " + fmt(d.fingerprint.b) +
      (d.fingerprint.same ? " (same)" : ""))],
    ["kernels", arrow(d.kernels)],
    ["fallbacks", arrow(d.fallbacks)],
    ["unfused patterns", arrow(d.unfused)],
    ["graph breaks", arrow(d.graph_breaks)],
    ["predicted step", arrow(d.predicted_step, " s")],
    ["measured step", arrow(d.measured_step, " s")],
  ].filter(([, text]) => text !== null && text !== undefined);
  const summary = el("table", { id: "diff-facts" }, el("tbody", {},
    ...facts.map(([name, text]) => el("tr", {}, el("th", {}, name), el("td", {}, text)))));
  const same = el("p", { class: "muted" }, "The two records are identical.");
  document.getElementById("diff-summary").replaceChildren(...(d.identical ? [summary, same] : [summary]));

  if (data.regressions.length) {
    document.getElementById("diff-regressions").replaceChildren(el("h3", {}, "Regressions"),
      el("ul", { id: "diff-regression-list" },
        ...data.regressions.map((g) => el("li", { class: "added" }, g.kind + ": " + g.message))));
  }

  const first = d.first_divergence;
  document.getElementById("diff-first-divergence").replaceChildren(first
    ? el("span", {}, "First divergence: ", el("strong", { id: "first-divergence-name" },
        first.graph + " / " + first.name), first.stage ? " (" + first.stage + ")" : "")
    : el("span", { class: "muted" }, "No pass diverges: every pass gives the same graph."));

  // the same rule as the diff's first_divergence: the first pass of b whose result differs from a's
  const passes = Array.isArray(d.passes) ? d.passes : [];
  const firstIndex = first ? passes.findIndex((p) => p.fingerprint_b !== null && p.changed) : -1;
  document.querySelector("#diff-passes tbody").replaceChildren(...passes.map((p, i) => {
    const cls = i === firstIndex ? "first-divergence changed" : (p.changed ? "changed" : "");
    const missing = (v) => v === null || v === undefined;
    const ops = (v) => (missing(v) ? "-" : String(v));
    const note = missing(p.fingerprint_a) ? "only in b" : missing(p.fingerprint_b) ? "only in a"
      : p.changed ? "changed" : "";
    return el("tr", { class: cls }, el("td", { class: "num" }, i + 1), el("td", {}, p.graph),
      el("td", {}, p.name), el("td", {}, p.stage || ""), el("td", { class: "fp" }, fmt(p.fingerprint_a)),
      el("td", { class: "fp" }, fmt(p.fingerprint_b)),
      el("td", { class: "num" }, ops(p.ops_a) + " \u2192 " + ops(p.ops_b)), el("td", {}, note));
  }));

  const sections = [];
  for (const what of ["fallbacks", "unfused", "kernels", "graph_breaks"]) {
    const part = d[what];
    if (!part) continue;
    for (const side of ["added", "removed", "count_changed"]) {
      const items = part[side];
      if (!Array.isArray(items) || !items.length) continue;
      const id = "diff-" + what.replace("_", "-") + "-" + side.replace("_", "-");
      const title = what.replace("_", " ") + " " + side.replace("_", " ");
      const cls = side === "removed" ? "removed" : "added";
      sections.push(el("div", { id }, el("h3", {}, title),
        el("ul", {}, ...items.map((item) => el("li", { class: cls }, describe(item))))));
    }
  }
  document.getElementById("diff-lists").replaceChildren(...sections);
  panel.dataset.a = String(a);
  panel.dataset.b = String(b);
  panel.scrollIntoView({ block: "start" });
}

async function route() {
  const m = /^#diff\/(\d+)\/(\d+)$/.exec(location.hash);
  if (!m) return;
  try { await openDiff(Number(m[1]), Number(m[2])); status(""); }
  catch (err) { status("diff: " + err.message); }
}

document.getElementById("model-select").addEventListener("change", () =>
  loadRecords().catch((err) => status(err.message)));
document.getElementById("kind-select").addEventListener("change", showKind);
document.getElementById("regressions").addEventListener("click", (event) => {
  const link = event.target.closest("a.diff-link");
  if (!link) return;
  event.preventDefault();
  goTo(link.getAttribute("href"));
});
window.addEventListener("hashchange", route);
loadModels().then(route).catch((err) => status(err.message));
"""
