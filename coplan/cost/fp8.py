"""What fp8 training keeps for backward: Transformer Engine stores GEMM inputs in fp8.

Under fp8 (Transformer Engine's ``fp8_autocast``), a ``Linear`` / ``LayerNormLinear`` casts its
input to fp8 for the forward GEMM and keeps that fp8 copy (one byte per element) for the weight
gradient, not the 16-bit input (transformer_engine/pytorch/module/linear.py,
``_Linear.forward``: ``ctx.save_for_backward(... inputmat ...)`` saves the casted input when fp8
is on, NVIDIA/TransformerEngine v1.7). So a block activation whose only forward readers are GEMMs
(the norms' outputs, the GeLU or SwiGLU output feeding the second MLP GEMM) is kept at one byte
instead of two, and one that a GEMM reads but another op also keeps for its own backward (the
attention output, which the fused attention kernel keeps in 16 bits) is kept twice: 16 bits and
the GEMM's fp8 copy. The embedding, LM head and loss stay in 16 bits (``estimate``).
"""

from __future__ import annotations

from collections.abc import Sequence

from coplan.cost.fusion import readers
from coplan.cost.parts import ACT, FIX, NV, Vec
from coplan.ir.types import Graph, OpKind, Phase


def fp8_saved_delta(graph: Graph, saved_items: Sequence[tuple[int, str, Vec]]) -> Vec:
    """Change of a block's saved element/byte vector when its GEMMs run in fp8."""
    out = [0.0] * NV
    for tid, _, vec in saved_items:
        t = graph.tensors[tid]
        fwd = [graph.ops[c] for c in readers(graph, tid) if graph.ops[c].phase is Phase.FORWARD]
        gemm = [op for op in fwd if op.kind is OpKind.MATMUL]
        if not gemm:
            continue
        bwd = [graph.ops[c] for c in readers(graph, tid) if graph.ops[c].phase is Phase.BACKWARD]
        only_gemms = all(op.kind is OpKind.MATMUL for op in bwd)
        for cls_shard in (ACT * 2, ACT * 2 + 1):
            if vec[cls_shard]:
                # the fp8 copy: one byte per element, in the same shard class
                out[FIX * 2 + cls_shard % 2] += float(t.numel)
                if only_gemms:  # the 16-bit value is not kept
                    out[cls_shard] -= vec[cls_shard]
    return tuple(out)  # type: ignore[return-value]
