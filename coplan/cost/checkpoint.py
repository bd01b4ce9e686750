"""Activation-checkpointing policies of PyTorch-native stacks, as recompute sets over the IR.

torchtitan's per-op selective checkpointing (``selective_ac_option = "op"``,
pytorch/torchtitan@9dec370ad2 torchtitan/parallelisms/parallelize_llama.py lines 214-260) keeps,
inside each checkpointed block, the outputs of ``aten.mm`` except every second one (a per-block
counter: the 2nd, 4th, 6th ``mm`` are recomputed), of SDPA's flash / efficient attention and of
the TP reduce-scatter, and recomputes everything else in backward. A Llama block calls ``mm`` in
the order wq, wk, wv, wo, w1, w3, w2, so it recomputes wk, wo and w3 (the up projection) and the
block's pointwise work (norms, RoPE, SiLU, the product, residual adds).
"""

from __future__ import annotations

from coplan.ir.types import Graph, OpKind, Phase, TensorRole


def _mm_calls(module_path: str) -> int:
    """``aten.mm`` calls of one IR linear: the IR's fused QKV projection is three (wq, wk, wv)."""
    return 3 if module_path.endswith(".c_attn") else 1


def selective_op_names(graph: Graph, block: int = 0) -> frozenset[str]:
    """Names of the tensors of ``block`` that torchtitan's per-op policy recomputes: every saved
    forward activation the block's ops write, except the outputs of the linear layers whose last
    ``mm`` call is odd-numbered and of attention. With the IR's fused QKV projection (calls 1-3,
    saved), wk's recompute is not represented: it is kept with q and v."""
    keep: set[int] = set()
    rec: set[int] = set()
    count = 0
    for op in graph.ops:
        if op.block != block or op.phase is not Phase.FORWARD or op.kind is OpKind.VIEW:
            continue
        if op.kind is OpKind.MATMUL:
            count += _mm_calls(op.module_path)
            (keep if count % 2 else rec).update(op.outputs)
        elif op.kind is OpKind.ATTENTION:
            keep.update(op.outputs)
        else:
            rec.update(op.outputs)
    # the block's output is the next block's input, which a checkpointed block keeps
    out = {t for t in rec if any(graph.ops[c].block != block for c in graph.tensors[t].consumers)}
    names = {
        graph.tensors[t].name
        for t in rec - keep - out
        if graph.tensors[t].role is TensorRole.ACTIVATION and graph.tensors[t].saved_for_backward
    }
    return frozenset(names)


def checkpointed_blocks(policy: str, layers: int) -> int | None:
    """How many of ``layers`` blocks a per-layer policy checkpoints fully, by the stack's own rule;
    None for a policy that is not per layer.

    ``selective-layer:N`` (torchtitan ``selective_ac_option = "N"``): a counter over the blocks,
    incremented before the test, checkpoints block ``i`` (from 1) where ``i % N == 0``
    (torchtitan/models/llama3/infra/parallelize.py ``_apply_ac_to_transformer_block``), so
    ``layers // N``. ``selective-fraction:p`` (fms-fsdp ``selective_checkpointing``): block ``i``
    (from 1) is checkpointed where ``i * p`` reaches a cut-off starting at 1/2 and rising by one
    with each checkpointed block (foundation-model-stack/fms-fsdp fms_fsdp/policies/ac_handler.py
    ``apply_fsdp_checkpointing``): evenly spaced, ``p`` of the blocks rounded half up."""
    if policy.startswith("selective-layer:"):
        every = int(policy.split(":", 1)[1])
        return layers // every if every > 0 else layers
    if policy.startswith("selective-fraction:"):
        share = float(policy.split(":", 1)[1])
        count, cut = 0, 0.5
        for i in range(1, layers + 1):
            if i * share >= cut:
                count, cut = count + 1, cut + 1
        return count
    return None


__all__ = ["checkpointed_blocks", "selective_op_names"]
