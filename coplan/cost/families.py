"""Helpers of the graph digest (``cost.profile``): the vector family of an op, which sets the rate
its arithmetic runs at, and the pruning of dominated memory points."""

from __future__ import annotations

from collections.abc import Iterable

from coplan.cost.parts import NV, ZERO, Vec
from coplan.ir.types import Op, OpKind

#: Elementwise ops evaluated with a transcendental function (a polynomial or table per element, tens
#: of instructions where the op rules count a handful of FLOPs) or a long-latency square root unit
#: (an fp32 square root issues a few times less often than an add: AdamW's denominator).
_TRANSCENDENTAL = frozenset(
    {"gelu", "gelu_backward", "silu", "silu_backward", "tanh", "tanh_backward", "sigmoid", "sigmoid_backward"}
    | {"exp", "exp2", "expm1", "log", "log2", "log1p", "erf", "sin", "cos", "softplus", "sqrt", "rsqrt"}
)
#: The vector family of each op kind (``VECTOR_FAMILIES``); kinds not listed are elementwise.
_FAMILY_OF_KIND = {
    OpKind.REDUCTION: "reduction",
    OpKind.LOSS: "reduction",
    OpKind.NORM: "norm",
    OpKind.SOFTMAX: "softmax",
}


def vector_family(op: Op) -> str:
    """The vector family of one op: transcendental elementwise functions apart from the rest."""
    name = op.target.split(".")[1] if op.target.startswith("aten.") else op.target
    if op.kind is OpKind.ELEMENTWISE and name.removesuffix("_") in _TRANSCENDENTAL:
        return "transcendental"
    return _FAMILY_OF_KIND.get(op.kind, "elementwise")


def prune_dominated(points: Iterable[Vec]) -> tuple[Vec, ...]:
    """Drop points dominated component-wise by another (they can never be the maximum)."""
    uniq = sorted(set(points), key=lambda p: -sum(p))
    kept: list[Vec] = []
    for p in uniq:
        if not any(all(k[i] >= p[i] for i in range(NV)) for k in kept):
            kept.append(p)
    return tuple(kept) or (ZERO,)
