"""What changed between two records, and which of the changes are regressions.

Pure functions on record dicts (the ``coplan inspect`` record, or a ``run`` / ``estimate`` one);
no database. ``diff(a, b)`` lines the two compilations up pass by pass and lists what ``b`` has that
``a`` has not, and the reverse: kernels, fallbacks, unfused patterns, graph breaks, step times.
``check(baseline, candidate)`` turns the changes that make a step slower into regressions, each with
a one-line message, for ``coplan history check`` in a user's CI.

Identities across records, chosen so that renumbering does not count as a change:
- a pass: (graph, name, occurrence), the n-th run of that pass on that graph;
- a kernel: (graph, kind, the sorted aten ops it runs), or its name without the trailing number
  Inductor appends (``cpp_fused_gelu_3`` -> ``cpp_fused_gelu``) where it lists no aten ops;
- a fallback: (graph, op); an unfused pattern: (graph, ops); a graph break: (location, reason).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from typing import Any

_TRAILING_INDEX = re.compile(r"_\d+$")

#: Regression kinds ``check`` reports, in the order it reports them.
REGRESSION_KINDS = ("fallback", "unfused", "kernels", "graph_break", "predicted_step", "measured_step")


def _list(record: dict[str, Any], key: str) -> list[dict[str, Any]]:
    value = record.get(key)
    return [x for x in value if isinstance(x, dict)] if isinstance(value, list) else []


def _number(x: Any) -> float | None:
    if isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x):
        return float(x)
    return None


def _count(x: Any) -> int:
    return x if isinstance(x, int) and not isinstance(x, bool) and x > 0 else 1


def relative(a: float | None, b: float | None) -> float | None:
    """``b / a - 1``; None unless both are numbers and ``a`` is positive."""
    if a is None or b is None or a <= 0:
        return None
    return b / a - 1


# --- passes -------------------------------------------------------------------------------------


def _keyed_passes(record: dict[str, Any]) -> list[tuple[tuple[str, str, int], dict[str, Any]]]:
    seen: Counter[tuple[str, str]] = Counter()
    out = []
    for p in _list(record, "passes"):
        graph, name = str(p.get("graph", "")), str(p.get("name", ""))
        out.append(((graph, name, seen[graph, name]), p))
        seen[graph, name] += 1
    return out


def _passes(a: dict[str, Any], b: dict[str, Any]) -> list[dict[str, Any]]:
    """Every pass of either record, in ``b``'s execution order, then those only ``a`` ran."""
    in_a = dict(_keyed_passes(a))
    in_b = _keyed_passes(b)
    rows = []

    def row(
        key: tuple[str, str, int], pa: dict[str, Any] | None, pb: dict[str, Any] | None
    ) -> dict[str, Any]:
        fa = pa.get("fingerprint") if pa else None
        fb = pb.get("fingerprint") if pb else None
        either = pb if pb is not None else pa
        assert either is not None
        return {
            "graph": key[0],
            "name": key[1],
            "occurrence": key[2],
            "stage": either.get("stage"),
            "fingerprint_a": fa,
            "fingerprint_b": fb,
            "ops_a": pa.get("ops_after") if pa else None,
            "ops_b": pb.get("ops_after") if pb else None,
            "changed": pa is None or pb is None or fa != fb,
        }

    for key, pb in in_b:
        rows.append(row(key, in_a.pop(key, None), pb))
    rows.extend(row(key, pa, None) for key, pa in in_a.items())
    return rows


def _first_divergence(passes: list[dict[str, Any]], graph: str | None = None) -> dict[str, Any] | None:
    """The first pass ``b`` ran (of ``graph``, if given) whose result differs from ``a``'s."""
    for p in passes:
        if p["fingerprint_b"] is None or (graph is not None and p["graph"] != graph):
            continue
        if p["changed"]:
            return {"graph": p["graph"], "name": p["name"], "stage": p["stage"]}
    return None


# --- graphs, kernels, fallbacks, unfused, breaks --------------------------------------------------


def _graphs(a: dict[str, Any], b: dict[str, Any]) -> list[dict[str, Any]]:
    ga = {str(g.get("name")): g for g in _list(a, "graphs")}
    gb = {str(g.get("name")): g for g in _list(b, "graphs")}
    names = list(gb) + [n for n in ga if n not in gb]
    rows = []
    for name in names:
        x, y = ga.get(name, {}), gb.get(name, {})
        ops_a, ops_b = _number(x.get("ops")), _number(y.get("ops"))
        k_a, k_b = _number(x.get("kernels")), _number(y.get("kernels"))
        rows.append(
            {
                "name": name,
                "fingerprint_a": x.get("fingerprint"),
                "fingerprint_b": y.get("fingerprint"),
                "ops_a": x.get("ops"),
                "ops_b": y.get("ops"),
                "ops_delta": int(ops_b - ops_a) if ops_a is not None and ops_b is not None else None,
                "kernels_a": x.get("kernels"),
                "kernels_b": y.get("kernels"),
                "kernels_delta": int(k_b - k_a) if k_a is not None and k_b is not None else None,
                "changed": x.get("fingerprint") != y.get("fingerprint"),
            }
        )
    return rows


def kernel_key(k: dict[str, Any]) -> tuple[str, str, tuple[str, ...]]:
    """A kernel's identity across records (see the module docstring)."""
    aten = k.get("aten")
    ops = tuple(sorted({str(x) for x in aten})) if isinstance(aten, list) and aten else ()
    if not ops:
        ops = (_TRAILING_INDEX.sub("", str(k.get("name", ""))),)
    return str(k.get("graph", "")), str(k.get("kind", "")), ops


def _multiset_delta(
    a: list[dict[str, Any]], b: list[dict[str, Any]], key: Any
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(in ``b`` more often than in ``a``, in ``a`` more often than in ``b``): one entry per key
    (its first occurrence), with ``count`` the difference."""
    ca, cb = Counter(key(x) for x in a), Counter(key(x) for x in b)
    first_a: dict[Any, dict[str, Any]] = {}
    first_b: dict[Any, dict[str, Any]] = {}
    for x in a:
        first_a.setdefault(key(x), x)
    for x in b:
        first_b.setdefault(key(x), x)
    added = [{**first_b[k], "count": n} for k, n in (cb - ca).items()]
    removed = [{**first_a[k], "count": n} for k, n in (ca - cb).items()]
    return added, removed


def _kernels(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any] | None:
    na, nb = a.get("kernels"), b.get("kernels")
    if not isinstance(na, int) and not isinstance(nb, int):
        return None  # a run or estimate record: no kernel list
    added, removed = _multiset_delta(_list(a, "kernel_table"), _list(b, "kernel_table"), kernel_key)

    def brief(k: dict[str, Any]) -> dict[str, Any]:
        return {
            "graph": k.get("graph"),
            "name": k.get("name"),
            "kind": k.get("kind"),
            "aten": k.get("aten", []),
            "count": k["count"],
        }

    return {
        "a": na,
        "b": nb,
        "delta": nb - na if isinstance(na, int) and isinstance(nb, int) else None,
        "added": [brief(k) for k in added],
        "removed": [brief(k) for k in removed],
    }


def _fallback_key(f: dict[str, Any]) -> tuple[str, str]:
    return str(f.get("graph", "")), str(f.get("op", ""))


def _fallbacks(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    fa = {_fallback_key(f): f for f in _list(a, "fallbacks")}
    fb = {_fallback_key(f): f for f in _list(b, "fallbacks")}
    return {
        "a": len(fa),
        "b": len(fb),
        "added": [f for k, f in fb.items() if k not in fa],
        "removed": [f for k, f in fa.items() if k not in fb],
    }


def unfused_key(u: dict[str, Any]) -> tuple[str, tuple[str, ...]]:
    """An unfused pattern's identity across records: (graph, its ops in order)."""
    ops = u.get("ops")
    return str(u.get("graph", "")), tuple(str(x) for x in ops) if isinstance(ops, list) else ()


def _unfused(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    ua = {unfused_key(u): u for u in _list(a, "unfused")}
    ub = {unfused_key(u): u for u in _list(b, "unfused")}
    changed = []
    for key, u in ub.items():
        if key in ua and _count(ua[key].get("count")) != _count(u.get("count")):
            changed.append(
                {
                    "graph": key[0],
                    "ops": list(key[1]),
                    "count_a": _count(ua[key].get("count")),
                    "count_b": _count(u.get("count")),
                    "predicted_saving_s": u.get("predicted_saving_s"),
                    "reason": u.get("reason"),
                }
            )
    return {
        "a": len(ua),
        "b": len(ub),
        "added": [u for k, u in ub.items() if k not in ua],
        "removed": [u for k, u in ua.items() if k not in ub],
        "count_changed": changed,
    }


def _break_key(g: dict[str, Any]) -> tuple[str, str]:
    # not the frame id: it numbers frames in the order Dynamo met them, which shifts with any change
    return str(g.get("location", "")), str(g.get("reason", ""))


def _graph_breaks(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    added, removed = _multiset_delta(_list(a, "graph_breaks"), _list(b, "graph_breaks"), _break_key)
    return {
        "a": len(_list(a, "graph_breaks")),
        "b": len(_list(b, "graph_breaks")),
        "added": added,
        "removed": removed,
    }


# --- times -----------------------------------------------------------------------------------------


def measured_of(record: dict[str, Any]) -> tuple[float | None, list[float]]:
    """(measured step time, its samples) of a record; (None, []) where nothing was measured."""
    m = record.get("measured")
    if not isinstance(m, dict):
        return None, []
    samples = m.get("samples")
    values = [v for v in (_number(x) for x in samples) if v is not None] if isinstance(samples, list) else []
    return _number(m.get("step_s")), values


def _times(a: dict[str, Any], b: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    pa, pb = _number(a.get("predicted_step_s")), _number(b.get("predicted_step_s"))
    (ma, sa), (mb, sb) = measured_of(a), measured_of(b)
    predicted = {"a": pa, "b": pb, "change": relative(pa, pb)}
    measured = {
        "a": ma,
        "b": mb,
        "change": relative(ma, mb),
        "a_range": [min(sa), max(sa)] if sa else None,
        "b_range": [min(sb), max(sb)] if sb else None,
    }
    return predicted, measured


# --- the diff --------------------------------------------------------------------------------------


def diff(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """What changed from record ``a`` to record ``b``.

    Keys: ``a`` and ``b`` (record ids, or None), ``kinds`` and ``models`` (a, b), ``fingerprint``
    (a, b, same), ``passes`` (one row per pass, ``b``'s execution order: fingerprints and op counts
    after the pass on both sides, ``changed``), ``first_divergence`` (the first pass of ``b`` whose
    result differs from ``a``'s: graph, name, stage; None if none does), ``graphs`` (op and kernel
    deltas per graph), ``kernels`` (counts, and kernels added and removed; None for run and
    estimate records), ``fallbacks``, ``unfused`` (added, removed, count_changed), ``graph_breaks``,
    ``predicted_step`` and ``measured_step`` (a, b, relative change), and ``identical``: the same
    compilation and prediction (fingerprints, passes, graphs, kernels, fallbacks, unfused patterns,
    breaks and predicted time; measured times differ between any two runs, so they do not count).
    Run and estimate records have no passes: only their fingerprint and times are compared.
    """
    passes = _passes(a, b)
    predicted, measured = _times(a, b)
    out: dict[str, Any] = {
        "a": a.get("record_id"),
        "b": b.get("record_id"),
        "kinds": [a.get("kind"), b.get("kind")],
        "models": [a.get("model"), b.get("model")],
        "fingerprint": {
            "a": a.get("fingerprint"),
            "b": b.get("fingerprint"),
            "same": a.get("fingerprint") == b.get("fingerprint"),
        },
        "passes": passes,
        "first_divergence": _first_divergence(passes),
        "graphs": _graphs(a, b),
        "kernels": _kernels(a, b),
        "fallbacks": _fallbacks(a, b),
        "unfused": _unfused(a, b),
        "graph_breaks": _graph_breaks(a, b),
        "predicted_step": predicted,
        "measured_step": measured,
    }
    k = out["kernels"]
    out["identical"] = (
        out["fingerprint"]["same"]
        and not any(p["changed"] for p in passes)
        and not any(g["changed"] for g in out["graphs"])
        and (k is None or (k["delta"] in (0, None) and not k["added"] and not k["removed"]))
        and not any(out[s]["added"] or out[s]["removed"] for s in ("fallbacks", "unfused", "graph_breaks"))
        and not out["unfused"]["count_changed"]
        and predicted["a"] == predicted["b"]
    )
    return out


# --- regressions -----------------------------------------------------------------------------------


def _where(first: dict[str, Any] | None) -> str:
    return f"; first diverged at pass {first['graph']}/{first['name']}" if first else ""


def _ops(ops: Any) -> str:
    return " + ".join(str(x) for x in ops) if isinstance(ops, list | tuple) else str(ops)


def _seconds(s: float) -> str:
    if s >= 1:
        return f"{s:.4g} s"
    if s >= 1e-3:
        return f"{s * 1e3:.4g} ms"
    return f"{s * 1e6:.4g} us"


def check(
    baseline: dict[str, Any], candidate: dict[str, Any], threshold: float = 0.02
) -> list[dict[str, Any]]:
    """The regressions of ``candidate`` against ``baseline``; [] when there are none.

    Each is ``{"kind", "message", ...details}`` with ``kind`` one of ``REGRESSION_KINDS``:
    - ``fallback``: an op that falls back to eager in the candidate and did not in the baseline;
    - ``unfused``: a new unfused pattern, or more instances of one, with its ``predicted_saving_s``
      (what the cost model says fusing it would save, i.e. what it costs);
    - ``kernels``: more kernels per step, with the kernels added;
    - ``graph_break``: a graph break the baseline did not have;
    - ``predicted_step``: predicted step time above ``baseline * (1 + threshold)``;
    - ``measured_step``: measured step time worse by more than ``threshold``. Measured times are
      noisy, so the test is against the spread of the samples: it is a regression only when the
      candidate's *fastest* sample is slower than the baseline's *slowest* sample times
      ``1 + threshold`` (each side's median ``step_s`` where it has no samples); and never between
      two records of the same compiled program on the same torch build, device and sizes
      (``same_program``), whose times differ only by the machine's noise (two identical GPT-2
      inspects on a shared 2-core CPU measured 1.90 s and 1.50 s).
    The fallback, unfused and kernel regressions name the first pass whose result diverged (in the
    graph concerned where it has one). The deterministic ones (fallbacks, unfused, kernels, breaks)
    take no threshold: identical compilations have none of them, so identical records give [].
    """
    if not (isinstance(threshold, int | float) and math.isfinite(threshold) and threshold >= 0):
        raise ValueError(f"threshold must be a finite number >= 0, got {threshold!r}")
    d = diff(baseline, candidate)
    passes = d["passes"]

    def first(graph: Any) -> dict[str, Any] | None:
        return _first_divergence(passes, str(graph)) or d["first_divergence"]

    out: list[dict[str, Any]] = []
    for f in d["fallbacks"]["added"]:
        fd = first(f.get("graph"))
        why = f": {f['reason']}" if f.get("reason") else ""
        out.append(
            {
                "kind": "fallback",
                "message": f"new fallback {f.get('op')} in {f.get('graph')}{why}{_where(fd)}",
                "graph": f.get("graph"),
                "op": f.get("op"),
                "kernel": f.get("kernel"),
                "reason": f.get("reason"),
                "first_divergence": fd,
            }
        )
    for u, before in [(u, 0) for u in d["unfused"]["added"]] + [
        (c, c["count_a"]) for c in d["unfused"]["count_changed"] if c["count_b"] > c["count_a"]
    ]:
        fd = first(u.get("graph"))
        count = _count(u.get("count_b", u.get("count")))
        saving = _number(u.get("predicted_saving_s"))
        cost = f", predicted cost {_seconds(saving)} per step" if saving is not None else ""
        what = "new unfused pattern" if not before else f"more unfused instances ({before} ->)"
        why = f" ({u['reason']})" if u.get("reason") else ""
        out.append(
            {
                "kind": "unfused",
                "message": f"{what} {_ops(u.get('ops'))} in {u.get('graph')} x{count}{why}{cost}{_where(fd)}",
                "graph": u.get("graph"),
                "ops": list(u.get("ops") or []),
                "count": count,
                "count_before": before,
                "reason": u.get("reason"),
                "predicted_saving_s": saving,
                "first_divergence": fd,
            }
        )
    k = d["kernels"]
    if k is not None and isinstance(k["delta"], int) and k["delta"] > 0:
        grown = [g for g in d["graphs"] if isinstance(g["kernels_delta"], int) and g["kernels_delta"] > 0]
        fd = first(grown[0]["name"]) if grown else d["first_divergence"]
        where = ", ".join(f"{g['name']} {g['kernels_delta']:+d}" for g in grown)
        out.append(
            {
                "kind": "kernels",
                "message": f"more kernels: {k['a']} -> {k['b']} ({k['delta']:+d}"
                + (f": {where}" if where else "")
                + f"){_where(fd)}",
                "a": k["a"],
                "b": k["b"],
                "delta": k["delta"],
                "added": k["added"],
                "first_divergence": fd,
            }
        )
    for g in d["graph_breaks"]["added"]:
        out.append(
            {
                "kind": "graph_break",
                "message": f"new graph break at {g.get('location')}: {g.get('reason')}",
                "location": g.get("location"),
                "reason": g.get("reason"),
                "frame": g.get("frame"),
            }
        )
    p = d["predicted_step"]
    if p["a"] is not None and p["b"] is not None and p["b"] > p["a"] * (1 + threshold):
        out.append(
            {
                "kind": "predicted_step",
                "message": f"predicted step time {_seconds(p['a'])} -> {_seconds(p['b'])} "
                f"({p['change']:+.1%}, threshold {threshold:.1%})",
                **p,
                "threshold": threshold,
            }
        )
    out.extend(_measured_regression(baseline, candidate, threshold))
    return out


#: what makes two records the same compiled program on the same software and hardware
_SAME = ("fingerprint", "torch", "build", "device", "hardware", "batch", "seq")


def same_program(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Two records of one compiled step (every fingerprint, torch build, device and sizes equal):
    any difference in their measured times is the machine's, not the compiler's."""
    if not a.get("fingerprint") or a.get("kind") != b.get("kind"):
        return False
    return all(a.get(k) == b.get(k) for k in _SAME)


def _measured_regression(
    baseline: dict[str, Any], candidate: dict[str, Any], threshold: float
) -> list[dict[str, Any]]:
    if same_program(baseline, candidate):
        return []
    (ma, sa), (mb, sb) = measured_of(baseline), measured_of(candidate)
    slowest_a = max(sa) if sa else ma
    fastest_b = min(sb) if sb else mb
    if slowest_a is None or fastest_b is None or not fastest_b > slowest_a * (1 + threshold):
        return []
    change = relative(ma, mb)
    median = (
        f" (median {_seconds(ma)} -> {_seconds(mb)}, {change:+.1%})"
        if ma and mb and change is not None
        else ""
    )
    return [
        {
            "kind": "measured_step",
            "message": f"measured step time: fastest sample {_seconds(fastest_b)} is slower than the "
            f"baseline's slowest {_seconds(slowest_a)} by more than {threshold:.1%}{median}",
            "a": ma,
            "b": mb,
            "change": change,
            "baseline_slowest": slowest_a,
            "candidate_fastest": fastest_b,
            "threshold": threshold,
        }
    ]
