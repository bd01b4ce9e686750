"""Patterns that should have fused and did not: adjacent ops in different kernels of a compiled
graph that coplan's fusion rules (``coplan.plan.checker.pair_problem``) let one kernel hold.

Adjacent means the consumer reads the producer's output, through views, or through a fallback
kernel that returns a tensor of its input's shape and dtype (an opaque op the compiler cannot see
into: an identity-like custom op in the way is exactly how a norm stops fusing with its
activation). Each pattern is named by the ops its ends came from (``original_aten``: the aten op
before decomposition), counted once per pair of kernels, carries Inductor's own reason where its
scheduler logged one, and is priced by the cost model: the time of the two kernels minus the time of
one kernel doing both without the intermediate's traffic.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from coplan.inspect.analyze import CompiledGraph
from coplan.inspect.price import Pricer, pattern_name, short
from coplan.ir.oprules import rule_for
from coplan.ir.types import OpKind
from coplan.plan.checker import pair_problem

_BOOKKEEPING = {"getitem"}


def node_kind(n: dict[str, Any]) -> OpKind | None:
    if n["op"] != "call_function":
        return None
    name = short(n["target"])
    if name in _BOOKKEEPING:
        return OpKind.VIEW
    return rule_for(name, pointwise=n["pointwise"], is_view=n["view"]).kind


def pattern_kind(n: dict[str, Any]) -> OpKind | None:
    """The kind of the op a node came from (a ``sub`` of a decomposed log-softmax is a softmax):
    what fusion legality is judged on, as coplan's planner judges ops before decomposition."""
    own = node_kind(n)
    orig = n.get("original_aten")
    if own is None or not orig:
        return own
    kind = rule_for(short(orig + ".default"), pointwise=n.get("original_pointwise", False)).kind
    return own if kind is OpKind.OTHER else kind


def _why_table(g: CompiledGraph) -> list[tuple[set[str], set[str], str]]:
    origins = {m: set(o) for k in g.scheduler for m, o in k.get("member_origins", {}).items()}

    def of(name: str) -> set[str]:
        out: set[str] = set()
        for member in name.split("_"):
            out |= origins.get(member, set())
        return out

    return [(of(a), of(b), reason) for a, b, reason in g.why]


def _reason(why: list[tuple[set[str], set[str], str]], p: str, c: str) -> str | None:
    found = None
    for a, b, reason in why:
        if (p in a and c in b) or (c in a and p in b):
            found = reason  # the last word: the scheduler tries pairs again as nodes grow
    return found


def unfused(g: CompiledGraph, kernels: list[dict[str, Any]], pricer: Pricer) -> list[dict[str, Any]]:
    nodes = {n["name"]: n for n in g.nodes}
    kernel_of: dict[str, list[int]] = defaultdict(list)
    for i, k in enumerate(kernels):
        for o in k["ops"]:
            kernel_of[o].append(i)
    users: dict[str, list[str]] = defaultdict(list)
    for n in g.nodes:
        for i in n["inputs"]:
            users[i].append(n["name"])
    why = _why_table(g)
    priced = [pricer.kernel(k, nodes, g.name) for k in kernels]

    def source(name: str) -> str:
        """Walk back through views (which no kernel needs to hold) to the op that computed."""
        seen = 0
        while name in nodes and node_kind(nodes[name]) is OpKind.VIEW and nodes[name]["inputs"] and seen < 64:
            name = nodes[name]["inputs"][0]
            seen += 1
        return name

    found: dict[tuple[int, int], dict[str, Any]] = {}
    for c in g.nodes:
        ck = node_kind(c)
        if ck is None or ck is OpKind.VIEW or not kernel_of.get(c["name"]):
            continue
        for inp in c["inputs"]:
            p = source(inp)
            if p not in nodes or not kernel_of.get(p):
                continue
            via: list[str] = []
            pk = node_kind(nodes[p])
            fallback = next((kernels[i] for i in kernel_of[p] if kernels[i]["kind"] == "fallback"), None)
            if fallback is not None and pk is OpKind.OTHER:
                q = _passthrough_input(nodes[p], nodes)
                if q is None:
                    continue
                via = [fallback.get("op") or nodes[p]["target"]]
                p = source(q)
                if p not in nodes or not kernel_of.get(p):
                    continue
                pk = node_kind(nodes[p])
            if pk is None or set(kernel_of[p]) & set(kernel_of[c["name"]]):
                continue
            pkind, ckind = pattern_kind(nodes[p]), pattern_kind(c)
            if pkind is None or ckind is None or pair_problem(pkind, ckind) is not None:
                continue
            a, b = kernel_of[p][0], kernel_of[c["name"]][0]
            if a == b or (a, b) in found:
                continue
            inter = nodes[p]["bytes"]
            # the consumer's read is saved; the producer's write too unless someone else reads it
            others = [u for u in users[p] if u not in kernels[b]["ops"] and u not in kernels[a]["ops"]]
            saved = inter * (1 if others else 2)
            reason = _reason(why, p, c["name"])
            if reason is None:
                reason = _default_reason(kernels[a], kernels[b], via)
            found[(a, b)] = {
                "ops": [pattern_name(nodes[p]), pattern_name(c)],
                "graph": g.name,
                "nodes": [p, c["name"]],
                "kernels": [kernels[a]["name"], kernels[b]["name"]],
                "via": via,
                "reason": reason,
                "predicted_saving_s": pricer.saving(priced[a], priced[b], saved),
            }
    return _aggregate(found.values())


def _passthrough_input(n: dict[str, Any], nodes: dict[str, dict[str, Any]]) -> str | None:
    """The one tensor input of an opaque op whose output has that input's shape and dtype."""
    tensors = [i for i in n["inputs"] if i in nodes and nodes[i]["shape"] is not None]
    if len(tensors) != 1:
        return None
    src = nodes[tensors[0]]
    if src["shape"] == n["shape"] and src["dtype"] == n["dtype"]:
        return tensors[0]
    return None


def _default_reason(a: dict[str, Any], b: dict[str, Any], via: list[str]) -> str:
    if via:
        return f"separated by fallback kernel {via[0]}: no fusion across an op Inductor does not generate"
    for k in (a, b):
        if k["kind"] == "extern":
            return (
                f"library call {k.get('op') or k['name']}: Inductor fuses ops only into GEMMs it "
                "generates (max_autotune templates)"
            )
    return "Inductor kept them in separate kernels and logged no reason"


def _aggregate(items: Any) -> list[dict[str, Any]]:
    """One entry per (graph, ops, via): its instances counted, savings summed, the first reason."""
    groups: dict[tuple[str, tuple[str, ...], tuple[str, ...]], dict[str, Any]] = {}
    for it in items:
        key = (it["graph"], tuple(it["ops"]), tuple(it["via"]))
        g = groups.get(key)
        if g is None:
            groups[key] = {
                "ops": it["ops"],
                "graph": it["graph"],
                "via": it["via"],
                "count": 1,
                "reason": it["reason"],
                "nodes": [it["nodes"]],
                "kernels": [it["kernels"]],
                "predicted_saving_s": it["predicted_saving_s"],
            }
        else:
            g["count"] += 1
            g["nodes"].append(it["nodes"])
            g["kernels"].append(it["kernels"])
            g["predicted_saving_s"] += it["predicted_saving_s"]
    return sorted(groups.values(), key=lambda g: -g["predicted_saving_s"])
