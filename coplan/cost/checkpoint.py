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

from collections.abc import Callable

from coplan.cost.parts import NV, Vec
from coplan.ir.types import Graph, Op, OpKind, Phase, Tensor, TensorRole


def _mm_calls(module_path: str) -> int:
    """``aten.mm`` calls of one IR linear: the IR's fused QKV projection is three (wq, wk, wv)."""
    return 3 if module_path.endswith(".c_attn") else 1


def _policy(graph: Graph, block: int) -> tuple[set[int], set[int]]:
    """(outputs the per-op policy saves, outputs it recomputes) of ``block``'s forward ops, by the
    policy's ``mm`` counter (the IR's fused QKV projection is calls 1-3, whose last is odd)."""
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
    return keep, rec


def selective_op_names(graph: Graph, block: int = 0) -> frozenset[str]:
    """Names of the tensors of ``block`` that torchtitan's per-op policy recomputes: every saved
    forward activation the block's ops write, except the outputs of the linear layers whose last
    ``mm`` call is odd-numbered and of attention. The IR's fused QKV projection is kept whole here;
    ``selective_op_correction`` takes wk's columns out."""
    keep, rec = _policy(graph, block)
    # the block's output is the next block's input, which a checkpointed block keeps
    out = {t for t in rec if any(graph.ops[c].block != block for c in graph.tensors[t].consumers)}
    names = {
        graph.tensors[t].name
        for t in rec - keep - out
        if graph.tensors[t].role is TensorRole.ACTIVATION and graph.tensors[t].saved_for_backward
    }
    return frozenset(names)


def selective_op_correction(graph: Graph, block: int, vec: Callable[[Tensor], Vec], eager: bool) -> Vec:
    """What ``block`` keeps under torchtitan's per-op policy beyond the IR's saved tensors less
    ``selective_op_names``: less the key projection's columns of the IR's fused QKV output (wk is the
    policy's 2nd ``mm``, recomputed), and, in eager PyTorch, plus the outputs of the saved ``mm``
    calls that no backward reads (the MLP's down projection, the 7th): eager selective
    checkpointing caches every ``MUST_SAVE`` output until the recompute takes it
    (torch/utils/checkpoint.py at v2.13.0, ``_CachingTorchDispatchMode``), where a compiled block's
    partitioner saves only what its backward reads. ``vec``: a tensor's element vector as stored.
    Measured on this CPU with torchtitan's policy (``tests/unit/test_inductor_saved.py``)."""
    keep, _ = _policy(graph, block)
    out = [0.0] * NV
    for op in graph.ops:
        if op.block != block or op.phase is not Phase.FORWARD:
            continue
        if op.kind is OpKind.ATTENTION and len(op.inputs) >= 2:
            qkv = _qkv_output(graph, op)
            if qkv is not None:
                k = graph.tensors[op.inputs[1]].shape
                cols = float(k[1] * k[3]) if len(k) == 4 else 0.0
                t = graph.tensors[qkv]
                share = cols / t.shape[-1] if t.shape and t.shape[-1] else 0.0
                out = [a - share * b for a, b in zip(out, vec(t), strict=True)]
        if eager and op.kind is OpKind.MATMUL:
            for tid in op.outputs:
                t = graph.tensors[tid]
                if tid in keep and not t.saved_for_backward and t.role is TensorRole.ACTIVATION:
                    out = [a + b for a, b in zip(out, vec(t), strict=True)]
    return tuple(out)  # type: ignore[return-value]


def _qkv_output(graph: Graph, attn: Op) -> int | None:
    """The fused QKV projection's output that ``attn``'s keys are computed from (None where the
    block has no fused QKV projection)."""
    seen: set[int] = set()
    stack = [attn.inputs[1]]
    while stack:
        tid = graph.tensors[stack.pop()].storage_id
        if tid in seen:
            continue
        seen.add(tid)
        producer = graph.tensors[tid].producer
        if producer is None:
            continue
        op = graph.ops[producer]
        if op.kind is OpKind.MATMUL:
            return tid if op.module_path.endswith(".c_attn") else None
        stack.extend(op.inputs)
    return None


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


__all__ = ["checkpointed_blocks", "selective_op_correction", "selective_op_names"]
