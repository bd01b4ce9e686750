"""Stable fingerprints and light snapshots of FX graphs, as the compiler hands them from pass to pass.

A fingerprint must be equal for two runs that compile the same program the same way, and differ
as soon as one pass does something else. So it hashes what a graph computes, in order: each node's
opcode, target, the wiring of its arguments (by position, not by name: FX names carry counters that
shift when an unrelated node appears), constant arguments and the shape and dtype of its value.
Source locations, node names and module paths are left out.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

import torch
import torch.fx

#: fingerprint length in hex digits (64 bits: collisions between two runs' graphs are not a concern)
FP_LEN = 16


def digest(parts: Iterable[str]) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode("utf-8", "replace"))
        h.update(b"\x00")
    return h.hexdigest()[:FP_LEN]


def target_name(node: torch.fx.Node) -> str:
    """``aten.mm.default`` for an op overload, ``module.qualname`` for a Python callable."""
    t = node.target
    if isinstance(t, str):
        return t
    if isinstance(t, torch._ops.OpOverload | torch._ops.OpOverloadPacket | torch._ops.HigherOrderOperator):
        return str(t)
    mod = getattr(t, "__module__", None) or ""
    name = getattr(t, "__qualname__", None) or getattr(t, "__name__", None) or repr(t)
    return f"{mod}.{name}" if mod else str(name)


def _value(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return f"T{tuple(v.shape)}:{str(v.dtype).removeprefix('torch.')}"
    if isinstance(v, list | tuple):
        return "(" + ",".join(_value(x) for x in v) + ")"
    if isinstance(v, torch.SymInt | torch.SymFloat | torch.SymBool):
        return f"S{v}"
    if v is None:
        return ""
    return type(v).__name__


def _arg(a: Any, index: dict[torch.fx.Node, int]) -> str:
    if isinstance(a, torch.fx.Node):
        return f"%{index.get(a, -1)}"
    if isinstance(a, list | tuple):
        return "[" + ",".join(_arg(x, index) for x in a) + "]"
    if isinstance(a, dict):
        return "{" + ",".join(f"{k}:{_arg(v, index)}" for k, v in sorted(a.items(), key=str)) + "}"
    if isinstance(a, float):
        return repr(round(a, 12))
    if isinstance(a, torch.dtype):
        return str(a).removeprefix("torch.")
    if isinstance(a, torch.device):
        return a.type
    if isinstance(a, slice | int | bool | str) or a is None:
        return repr(a)
    return type(a).__name__


def as_graph(g: torch.fx.GraphModule | torch.fx.Graph) -> torch.fx.Graph:
    return g.graph if isinstance(g, torch.fx.GraphModule) else g


def op_count(g: torch.fx.GraphModule | torch.fx.Graph) -> int:
    """Nodes that compute (``call_*``): what a pass adds or removes."""
    return sum(1 for n in as_graph(g).nodes if n.op.startswith("call_"))


def fingerprint(g: torch.fx.GraphModule | torch.fx.Graph) -> str:
    index: dict[torch.fx.Node, int] = {}
    parts = []
    for i, n in enumerate(as_graph(g).nodes):
        index[n] = i
        target = "" if n.op == "placeholder" else target_name(n)
        parts.append(
            f"{n.op}|{target}|{_arg(n.args, index)}|{_arg(n.kwargs, index)}|{_value(n.meta.get('val'))}"
        )
    return digest(parts)


def placeholder_names(g: torch.fx.GraphModule | torch.fx.Graph) -> list[str]:
    return [n.name for n in as_graph(g).nodes if n.op == "placeholder"]


def role_of(g: torch.fx.GraphModule | torch.fx.Graph) -> str:
    """What AOTAutograd made of a graph it hands to Inductor, read from its inputs' names:
    ``backward`` (it takes tangents), ``forward`` (primals only) or ``inference`` (neither: a graph
    without autograd, such as an optimizer step's)."""
    names = placeholder_names(g)
    if any(n.startswith("tangents") for n in names):
        return "backward"
    if any(n.startswith("primals") for n in names):
        return "forward"
    return "inference"
