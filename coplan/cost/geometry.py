"""The geometry of a library kernel, read from the IR: an attention op's (batch x heads, query,
key, head dim), a GEMM's (M, N, K) and the dimension tensor parallelism splits, and whether a GEMM's
left operand is a transposed view (the kernel rules of ``kernels.py`` price these)."""

from __future__ import annotations

from coplan.cost.parts import TP
from coplan.ir.types import Graph, Op, OpKind

#: 2-D transposes among the view ops (``transposed_lhs`` counts them up a GEMM operand's chain).
_TRANSPOSES = frozenset({"aten.t.default", "aten.transpose.int"})


def attn_geometry(g: Graph, op: Op) -> tuple[int, int, int, int]:
    """(batch * heads, query length, key length, head dim) of a forward attention op, from its
    output (batch, heads, q, d) and its FLOPs (4 * batch * heads * q * k * d)."""
    out = g.tensors[op.outputs[0]].shape
    if len(out) == 4:
        bh, sq, d = out[0] * out[1], out[2], out[3]
    elif len(out) == 3:
        bh, sq, d = out[0], out[1], out[2]
    else:
        return (1, 1, 1, 1)
    sk = round(op.flops / (4 * bh * sq * d)) if op.flops else sq
    return (int(bh), int(sq), int(max(1, sk)), int(d))


def transposed_lhs(g: Graph, op: Op) -> bool:
    """Whether a 2-D GEMM's left operand is a transposed view of contiguous storage (a weight
    gradient ``grad.T @ x``): an odd number of transposes up its chain of views in a captured
    graph; a Linear's weight gradient in a synthetic one (``coplan.capture.synthetic``)."""
    if op.target == "linear_bwd_weight":
        return True
    lhs = {"aten.mm.default": 0, "aten.addmm.default": 1}.get(op.target)
    if lhs is None or len(op.inputs) <= lhs:
        return False
    flips, t = 0, g.tensors[op.inputs[lhs]]
    while t.producer is not None:
        prod = g.ops[t.producer]
        if prod.kind is not OpKind.VIEW or not prod.inputs:
            break
        t = g.tensors[prod.inputs[0]]
        # a transpose of more dimensions (attention's head split) may restore contiguity
        flips += prod.target in _TRANSPOSES and len(t.shape) == 2
    return flips % 2 == 1


def mm_dims(g: Graph, op: Op, shard: int, tokens: int) -> tuple[tuple[int, int, int], int]:
    """(M, N, K) of a GEMM op from its output and FLOPs, and the index of the dimension tensor
    parallelism splits when ``shard`` is TP (the largest that is not the ``tokens`` dimension;
    -1: none)."""
    out = g.tensors[op.outputs[0]].shape
    if len(out) == 4:
        # an input gradient in attention's head layout (batch, heads, seq, head dim): the
        # GEMM is (batch * seq) x (heads * head dim), the head split is only a view
        m, n = int(out[0]) * int(out[2]), int(out[1]) * int(out[3])
    else:
        n = int(out[-1]) if out else 1
        m = 1
        for d in out[:-1]:
            m *= int(d)
    k = max(1, round(op.flops / (2 * max(1, m * n)))) if op.flops else 1
    dims = (m, n, k)
    if shard != TP:
        return dims, -1
    cands = [i for i, d in enumerate(dims) if d != tokens]
    if not cands:
        return dims, -1
    return dims, max(cands, key=lambda i: dims[i])
