"""``coplan history``: the recorded ``inspect``, ``run`` and ``estimate`` records, and what changed.

    coplan history list [--model M] [--kind K] [--limit N]
    coplan history show REF
    coplan history diff A B
    coplan history check --baseline REF [--candidate REF] [--threshold 0.02]

All take ``--db PATH`` (default: ``$COPLAN_DB``, else the user's data folder) and ``--json``. A REF
is a record id, ``latest``, ``latest~N``, a git commit prefix (7+ hex digits) or a fingerprint
prefix (4+ hex digits). ``check`` is made for CI: exit 0 when nothing regressed, 1 when something
did (one line per regression), 2 on bad input (an unknown record, an unreadable database).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Any

import typer
from rich import box
from rich.markup import escape
from rich.table import Table

from coplan.cli.common import print_json, stdout
from coplan.cli.options import JsonOpt
from coplan.errors import CoplanError, SpecError

app = typer.Typer(
    name="history",
    help="Recorded inspect, run and estimate records: list, show, diff, and check for regressions.",
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


@app.callback(invoke_without_command=True)
def _help(ctx: typer.Context) -> None:
    # ``coplan history`` alone: its help and exit 0 (no_args_is_help would end in a usage error)
    if ctx.invoked_subcommand is None:
        typer.echo(ctx.get_help())
        raise typer.Exit(0)


DbOpt = Annotated[
    Path | None,
    typer.Option(
        "--db",
        help="The history database \\[default: $COPLAN_DB, else $XDG_DATA_HOME/coplan/history.sqlite, "
        "else ~/.local/share/coplan/history.sqlite].",
        show_default=False,
    ),
]


class Regressed(CoplanError):
    """``history check`` found a regression: exit 1, after the regressions are printed."""

    exit_code = 1


#: ``--history/--no-history`` and ``--db`` of the commands that record (estimate, run)
RecordHistoryOpt = Annotated[
    bool,
    typer.Option(
        "--history/--no-history",
        help="Record this result in the history database (coplan history).",
    ),
]
RecordDbOpt = Annotated[
    Path | None,
    typer.Option(
        "--db",
        help="The history database to record in (implies --history) \\[default: $COPLAN_DB, else "
        "the user's data folder].",
        show_default=False,
    ),
]


def recording_to(history: bool, db: Path | None) -> Path | None:
    """Where a command records (None: it does not), checked before any work (exit 2, one line)."""
    from coplan.inspect.history import check_writable, default_db_path

    if db is None and not history:
        return None
    return check_writable(db if db is not None else default_db_path())


def record(path: Path, entry: dict[str, Any]) -> int:
    """Store ``entry`` in the history at ``path``; its id (``--json`` output carries it as
    ``record_id``; text output ends with ``say_recorded``)."""
    from coplan.inspect.history import store

    return store(path, entry)


def say_recorded(record_id: int | None, path: Path | None) -> None:
    """``recorded as #12 in PATH`` on stderr, after a command's text output (nothing if not recorded)."""
    import sys

    if record_id is not None and path is not None:
        sys.stdout.flush()
        sys.stderr.write(f"recorded as #{record_id} in {path}\n")
        sys.stderr.flush()


def _open(db: Path | None) -> Any:
    from coplan.inspect.history import History, default_db_path

    return History(db if db is not None else default_db_path(), create=False)


def _seconds(s: Any) -> str:
    if not isinstance(s, int | float) or isinstance(s, bool) or not math.isfinite(s):
        return "-"
    if s >= 1:
        return f"{s:.4g} s"
    if s >= 1e-3:
        return f"{s * 1e3:.4g} ms"
    return f"{s * 1e6:.4g} us"


def _cell(x: Any) -> str:
    """A value as table text: ``-`` for none, and brackets escaped (records hold user text, such as
    reasons and file locations, that Rich would otherwise read as markup)."""
    return "-" if x is None else escape(str(x))


def _short(x: Any, n: int = 8) -> str:
    return x[:n] if isinstance(x, str) else "-"


def _change(x: Any) -> str:
    return f"{x:+.1%}" if isinstance(x, int | float) else "-"


# --- list --------------------------------------------------------------------------------------------


@app.command("list")
def list_(
    model: Annotated[str | None, typer.Option("--model", "-m", help="Only this model's records.")] = None,
    kind: Annotated[
        str | None, typer.Option("--kind", help="Only records of this kind: inspect, run or estimate.")
    ] = None,
    limit: Annotated[
        int, typer.Option("--limit", "-n", help="At most this many, newest first (0: all).")
    ] = 20,
    db: DbOpt = None,
    json: JsonOpt = False,
) -> None:
    """List the recorded records, newest first."""
    if limit < 0:
        raise SpecError("--limit", None, f"must be 0 or more, got {limit}")
    with _open(db) as history:
        rows = history.rows(model=model, kind=kind, limit=limit or None)
        path = history.path
    if json:
        print_json({"records": rows})
        return
    console = stdout()
    if not rows:
        console.print(f"no records in {path}", soft_wrap=True, markup=False)
        return
    # narrow enough for 80 columns: the year, torch, build and device are in ``history show``
    table = Table(
        box=box.SIMPLE_HEAD,
        title=escape(str(path)),
        title_justify="left",
        padding=0,  # the box's column separator is the space between columns
    )
    table.add_column("id", justify="right", no_wrap=True)
    for col in ("created", "kind"):
        table.add_column(col, no_wrap=True)
    table.add_column("model", min_width=9)  # the one column that wraps, rather than vanish
    for col in ("git", "finger\nprint"):
        table.add_column(col, no_wrap=True)
    table.add_column("kernels\nfb/unf", justify="right", no_wrap=True)
    table.add_column("predicted", justify="right", no_wrap=True)
    table.add_column("measured", justify="right", no_wrap=True)
    for r in rows:
        created = r["created"] or ""
        table.add_row(
            str(r["id"]),
            escape(created[5:16].replace("T", " ")) or "-",
            r["kind"],
            _cell(r["model"]),
            _short(r["git_commit"], 7),
            _short(r["fingerprint"]),
            "/".join(_cell(r[k]) for k in ("kernels", "fallbacks", "unfused")),
            _seconds(r["predicted_step_s"]),
            _seconds(r["measured_step_s"]),
        )
    console.print(table)


# --- show --------------------------------------------------------------------------------------------


def _header(r: dict[str, Any]) -> str:
    job = f"batch {r.get('batch')} x seq {r.get('seq')}" if r.get("batch") is not None else ""
    where = ", ".join(
        x
        for x in (
            f"device {r['device']}" if r.get("device") else "",
            f"priced on {r['hardware']}" if r.get("hardware") else "",
            f"torch {r['torch']} ({r.get('build')})" if r.get("torch") else "",
            f"git {_short(r.get('git_commit'), 12)}" if r.get("git_commit") else "",
        )
        if x
    )
    title = escape(f"#{r.get('record_id')} {r.get('kind')} {r.get('model')}")
    return f"[bold]{title}[/bold] " + escape(
        f"{job} at {r.get('created')}; {where}; fingerprint {r.get('fingerprint') or '-'}"
    )


@app.command("show")
def show(
    ref: Annotated[
        str, typer.Argument(help="The record: id, latest, latest~N, commit or fingerprint prefix.")
    ],
    db: DbOpt = None,
    json: JsonOpt = False,
) -> None:
    """One record: its passes, kernels, fallbacks, unfused patterns, graph breaks and times."""
    with _open(db) as history:
        record = history.get(ref)
    if json:
        print_json(record)
        return
    render_record(record)


def _rows(record: dict[str, Any], key: str) -> list[dict[str, Any]]:
    value = record.get(key)
    return [x for x in value if isinstance(x, dict)] if isinstance(value, list) else []


def render_record(r: dict[str, Any]) -> None:
    from coplan.inspect.diff import measured_of

    console = stdout()
    console.print(_header(r), soft_wrap=True)
    measured, samples = measured_of(r)
    spread = (
        f" ({len(samples)} samples, {_seconds(min(samples))} - {_seconds(max(samples))})" if samples else ""
    )
    compile_s = r.get("compile_s")
    console.print(
        f"step time: predicted {_seconds(r.get('predicted_step_s'))}, measured {_seconds(measured)}{spread}"
        + (f"; compiled in {compile_s:.3g} s" if isinstance(compile_s, int | float) else ""),
        soft_wrap=True,
        markup=False,
    )
    passes = _rows(r, "passes")
    if passes:
        table = Table(title="passes", title_justify="left", box=box.SIMPLE_HEAD, padding=0)
        for col in ("graph", "stage", "pass", "ops\nbefore", "ops\nafter", "fingerprint"):
            # pass names are the one column that may wrap: fingerprints are read whole
            table.add_column(col, justify="right" if col.startswith("ops") else "left", no_wrap=col != "pass")
        for p in passes:
            table.add_row(
                _cell(p.get("graph")),
                _cell(p.get("stage")),
                _cell(p.get("name")),
                _cell(p.get("ops_before")),
                _cell(p.get("ops_after")),
                _cell(p.get("fingerprint")),
            )
        console.print(table)
    graphs = _rows(r, "graphs")
    if graphs:
        console.print(
            f"kernels: {r.get('kernels')} ("
            + ", ".join(f"{g.get('name')} {g.get('kernels')} from {g.get('ops')} ops" for g in graphs)
            + ")",
            soft_wrap=True,
            markup=False,
        )
    fallbacks = _rows(r, "fallbacks")
    if fallbacks:
        console.print(f"[yellow]fallbacks to eager ({len(fallbacks)}):[/yellow]")
        for f in fallbacks:
            console.print(
                f"  {f.get('graph')}: {f.get('op')} x{f.get('count', 1)} ({f.get('reason')})",
                soft_wrap=True,
                markup=False,
            )
    unfused = _rows(r, "unfused")
    if unfused:
        table = Table(title="unfused patterns", title_justify="left", box=box.SIMPLE_HEAD)
        for col in ("graph", "ops", "x", "predicted saving", "why"):
            table.add_column(col, justify="right" if col in ("x", "predicted saving") else "left")
        for u in sorted(unfused, key=lambda u: -(u.get("predicted_saving_s") or 0)):
            table.add_row(
                _cell(u.get("graph")),
                " + ".join(str(x) for x in u.get("ops") or []),
                _cell(u.get("count")),
                _seconds(u.get("predicted_saving_s")),
                _cell(u.get("reason")),
            )
        console.print(table)
    breaks = _rows(r, "graph_breaks")
    if breaks:
        console.print(f"[yellow]graph breaks ({len(breaks)}):[/yellow]")
        for g in breaks:
            console.print(f"  {g.get('location')}: {g.get('reason')}", soft_wrap=True, markup=False)
    elif "graph_breaks" in r:
        console.print("graph breaks: none")


# --- diff --------------------------------------------------------------------------------------------


@app.command("diff")
def diff_(
    a: Annotated[str, typer.Argument(help="The earlier record (ref).")],
    b: Annotated[str, typer.Argument(help="The later record (ref).")],
    db: DbOpt = None,
    json: JsonOpt = False,
) -> None:
    """What changed from record A to record B, pass by pass."""
    from coplan.inspect.diff import diff

    with _open(db) as history:
        ra, rb = history.get(a), history.get(b)
    d = diff(ra, rb)
    if json:
        print_json(d)
        return
    render_diff(d)


def render_diff(d: dict[str, Any]) -> None:
    console = stdout()
    fp = d["fingerprint"]
    console.print(
        f"[bold]#{d['a']} -> #{d['b']}[/bold] "
        + escape(
            f"({' -> '.join(str(k) for k in d['kinds'])}, {' -> '.join(str(m) for m in d['models'])}): "
            f"fingerprint {fp['a'] or '-'} -> {fp['b'] or '-'} "
        )
        + ("[green](same)[/green]" if fp["same"] else "[yellow](changed)[/yellow]"),
        soft_wrap=True,
    )
    if d["identical"]:
        console.print("the same compilation and prediction")
    first = d["first_divergence"]
    if first:
        console.print(
            f"first divergence: pass {first['name']} on {first['graph']} ({first['stage']})",
            soft_wrap=True,
            markup=False,
        )
    changed = [p for p in d["passes"] if p["changed"]]
    if changed:
        table = Table(
            title=f"passes whose result changed ({len(changed)} of {len(d['passes'])})",
            title_justify="left",
            box=box.SIMPLE_HEAD,
            padding=0,
        )
        for col in ("graph", "pass", "ops\na", "ops\nb", "fingerprint a", "fingerprint b"):
            table.add_column(col, justify="right" if col.startswith("ops") else "left", no_wrap=col != "pass")
        for p in changed:
            name = p["name"] + (f" #{p['occurrence'] + 1}" if p["occurrence"] else "")
            table.add_row(
                p["graph"],
                name,
                _cell(p["ops_a"]),
                _cell(p["ops_b"]),
                _cell(p["fingerprint_a"]),
                _cell(p["fingerprint_b"]),
            )
        console.print(table)
    graphs = [g for g in d["graphs"] if g["changed"] or g["ops_delta"] or g["kernels_delta"]]
    if graphs:
        table = Table(title="graphs", title_justify="left", box=box.SIMPLE_HEAD)
        for col in ("graph", "ops a", "ops b", "kernels a", "kernels b"):
            table.add_column(col, justify="left" if col == "graph" else "right", no_wrap=True)
        for g in graphs:
            table.add_row(
                g["name"], _cell(g["ops_a"]), _cell(g["ops_b"]), _cell(g["kernels_a"]), _cell(g["kernels_b"])
            )
        console.print(table)
    k = d["kernels"]
    if k is not None:
        console.print(f"kernels: {k['a']} -> {k['b']}", soft_wrap=True, markup=False)
        for sign, rows in (("+", k["added"]), ("-", k["removed"])):
            for x in rows:
                what = ", ".join(x["aten"]) if x["aten"] else x["name"]
                console.print(
                    f"  {sign} {x['graph']}: {x['kind']} kernel {what} x{x['count']}",
                    soft_wrap=True,
                    markup=False,
                )
    for sign, rows in (("+", d["fallbacks"]["added"]), ("-", d["fallbacks"]["removed"])):
        for f in rows:
            console.print(
                f"fallback {sign} {f.get('graph')}: {f.get('op')} ({f.get('reason')})",
                soft_wrap=True,
                markup=False,
            )
    u = d["unfused"]
    for sign, rows in (("+", u["added"]), ("-", u["removed"])):
        for x in rows:
            console.print(
                f"unfused {sign} {x.get('graph')}: {' + '.join(map(str, x.get('ops') or []))} "
                f"x{x.get('count', 1)} (predicted saving {_seconds(x.get('predicted_saving_s'))})",
                soft_wrap=True,
                markup=False,
            )
    for c in u["count_changed"]:
        console.print(
            f"unfused {c['graph']}: {' + '.join(c['ops'])} x{c['count_a']} -> x{c['count_b']}",
            soft_wrap=True,
            markup=False,
        )
    for sign, rows in (("+", d["graph_breaks"]["added"]), ("-", d["graph_breaks"]["removed"])):
        for g in rows:
            console.print(
                f"graph break {sign} {g.get('location')}: {g.get('reason')}", soft_wrap=True, markup=False
            )
    for label, t in (("predicted", d["predicted_step"]), ("measured", d["measured_step"])):
        if t["a"] is not None or t["b"] is not None:
            console.print(
                f"{label} step time: {_seconds(t['a'])} -> {_seconds(t['b'])} ({_change(t['change'])})",
                soft_wrap=True,
                markup=False,
            )


# --- check -------------------------------------------------------------------------------------------


@app.command("check")
def check(
    baseline: Annotated[
        str,
        typer.Option(
            "--baseline", help="The record to compare against (ref), e.g. the main branch's commit."
        ),
    ],
    candidate: Annotated[
        str | None,
        typer.Option(
            "--candidate",
            help="The record to check (ref) \\[default: the newest record of the baseline's model and "
            "kind made after it].",
            show_default=False,
        ),
    ] = None,
    threshold: Annotated[
        float,
        typer.Option("--threshold", help="Relative step-time increase that counts as a regression."),
    ] = 0.02,
    db: DbOpt = None,
    json: JsonOpt = False,
) -> None:
    """Exit 1 and name each regression of the candidate against the baseline.

    A regression is a new fallback, a new unfused pattern, more kernels, a new graph break, or a
    predicted or measured step time worse by more than --threshold (measured: the candidate's
    fastest sample against the baseline's slowest). Each is one line on stdout, then one error line
    says how many. Exit 0 when nothing regressed, 2 on bad input.
    """
    from coplan.inspect.diff import check as regressions_of
    from coplan.inspect.history import HistoryError

    if not math.isfinite(threshold) or threshold < 0:
        raise SpecError("--threshold", None, f"must be a finite number >= 0, got {threshold}")
    with _open(db) as history:
        base = history.get(baseline)
        if candidate is None:
            cand = history.newer(base["record_id"])
            if cand is None:
                raise HistoryError(
                    f"no {base.get('kind')} record of {base.get('model')} newer than #{base['record_id']} "
                    f"in {history.path}: record one, or name it with --candidate"
                )
        else:
            cand = history.get(candidate)
    found = regressions_of(base, cand, threshold)
    job = f"{cand.get('model')}, {cand.get('kind')}"
    against = f"#{cand['record_id']} ({job}) against baseline #{base['record_id']}"
    if json:
        print_json(
            {
                "baseline": base["record_id"],
                "candidate": cand["record_id"],
                "regressions": found,
                "regressed": bool(found),
            }
        )
    else:
        console = stdout()
        for r in found:
            console.print(f"regression: {r['message']}", soft_wrap=True, markup=False)
        if not found:
            console.print(
                f"{against}: no regressions (threshold {threshold:.1%})", soft_wrap=True, markup=False
            )
    if found:
        n = len(found)
        raise Regressed(f"{against}: {n} regression{'s' if n != 1 else ''} (threshold {threshold:.1%})")
