"""Default fusion groups: which ops of a graph run as one kernel.

A fusion plan is a partition of the graph's ops into groups; each group is priced as one kernel
(one launch; memory traffic only for the tensors that cross its boundary). The planner's fusion pass
searches this space; the cost model needs a default that matches what production stacks launch.
"""

from __future__ import annotations

from coplan.ir.types import Graph, OpKind, Phase, Tensor, TensorRole

#: Elementwise work a Megatron-style stack fuses into chains (bias-GeLU, bias-dropout-add, SwiGLU,
#: rotary, grad accumulation adds).
_CHAINABLE = frozenset({OpKind.ELEMENTWISE, OpKind.COPY})


def default_groups(graph: Graph, mode: str) -> tuple[tuple[int, ...], ...]:
    """The kernels of ``graph`` under ``mode``.

    - ``"none"``: eager PyTorch; every op is its own kernel (views launch nothing, and are priced
      as free by the cost model whatever their group).
    - ``"megatron"``: Megatron-LM with its fused kernels. GEMMs, flash attention, norms and softmax
      are kernels of their own (Megatron computes GEMMs without the bias and fuses the bias into
      the following pointwise kernel); chains of pointwise ops in the same block and phase fuse
      into one kernel when the intermediate has no other reader; the optimizer is one multi-tensor
      kernel per block (Apex/TE fused Adam applies the update to many tensors per launch).
    """
    if mode == "none":
        return tuple((op.id,) for op in graph.ops)
    if mode != "megatron":
        raise ValueError(f"unknown fusion mode {mode!r}")
    parent = list(range(len(graph.ops)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    ops = graph.ops
    opt_root: dict[int | None, int] = {}
    for op in ops:
        if op.phase is Phase.OPTIMIZER:
            root = opt_root.setdefault(op.block, op.id)
            parent[find(op.id)] = find(root)
            continue
        if op.kind not in _CHAINABLE:
            continue
        for tid in op.inputs:
            src = source_op(graph, tid)
            if src is None:
                continue
            prod = ops[src]
            if prod.kind not in _CHAINABLE or prod.phase is not op.phase or prod.block != op.block:
                continue
            # the outputs this op reads may only be read inside the chain (through views), else the
            # intermediate must be materialised anyway and fusing saves nothing; the producer's other
            # outputs (a dropout mask kept for backward) are written by the fused kernel either way,
            # as Megatron's fused bias-dropout-add writes its mask
            read = [t for t in prod.outputs if op.id in readers(graph, t)]
            others = {c for t in read for c in readers(graph, t)} - {op.id}
            # ... or only by backward ops, where the fused kernel recomputes the intermediate from
            # its kept inputs instead of storing it (Megatron's bias_swiglu: SiLU and the product
            # in one forward kernel, SiLU recomputed in the backward one)
            if read and (
                not others
                or (
                    all(ops[c].phase is Phase.BACKWARD for c in others)
                    and all(fused_recomputed(graph, graph.tensors[t]) for t in read)
                )
            ):
                parent[find(op.id)] = find(prod.id)
    groups: dict[int, list[int]] = {}
    for op in ops:
        groups.setdefault(find(op.id), []).append(op.id)
    return tuple(tuple(g) for g in groups.values())


def source_op(graph: Graph, tid: int) -> int | None:
    """The op that really produced tensor ``tid`` (skipping view ops), or None for graph inputs."""
    seen = 0
    t = graph.tensors[tid]
    while t.producer is not None and seen < 64:
        prod = graph.ops[t.producer]
        if prod.kind is not OpKind.VIEW or not prod.inputs:
            return prod.id
        t = graph.tensors[prod.inputs[0]]
        seen += 1
    return None


def readers(graph: Graph, tid: int) -> set[int]:
    """Non-view ops reading ``tid`` directly or through views."""
    out: set[int] = set()
    stack = [tid]
    while stack:
        t = graph.tensors[stack.pop()]
        for c in t.consumers:
            op = graph.ops[c]
            if op.kind is OpKind.VIEW:
                stack.extend(op.outputs)
            else:
                out.add(c)
    return out


def fused_recomputed(g: Graph, t: Tensor) -> bool:
    """Whether a fused kernel of Megatron's stack recomputes ``t`` in its backward instead of
    storing it: the normalized input of a norm that no forward op reads (Transformer Engine's
    RMSNorm backward rebuilds ``x * rstd`` from ``x`` and ``rstd``; PyTorch's composite keeps
    it), and an intermediate of a pointwise chain (read in forward only by the chain's next
    pointwise op) whose producer's inputs are all kept (Megatron's ``bias_swiglu`` keeps its
    input and recomputes SiLU in backward; the chain's output, which a GEMM reads, stays)."""
    if t.producer is None:
        return False
    prod = g.ops[t.producer]
    if prod.kind is OpKind.NORM:
        x = g.tensors[prod.inputs[0]] if prod.inputs else None
        same = x is not None and tuple(t.shape) == tuple(x.shape) and t.id != prod.outputs[0]
        return same and not any(g.ops[c].phase is Phase.FORWARD for c in readers(g, t.id))
    if prod.kind is not OpKind.ELEMENTWISE:
        return False
    # read in forward only by the next pointwise op of the chain (which one fused kernel runs)
    fwd = [g.ops[c] for c in readers(g, t.id) if g.ops[c].phase is Phase.FORWARD]
    if not fwd or any(op.kind is not OpKind.ELEMENTWISE or op.block != prod.block for op in fwd):
        return False
    for tid in prod.inputs:
        src = g.tensors[g.tensors[tid].storage_id]
        if src.role is TensorRole.ACTIVATION and not g.tensors[tid].saved_for_backward:
            return False
    return True
