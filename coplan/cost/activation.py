"""The MLP activation run eagerly, op by op, instead of as Megatron's fused kernel.

Megatron-Core fuses the MLP activation with its neighbours (``bias_gelu``, ``bias_swiglu``), and
NeMo 1.x compiles its squared ReLU (``jit_fuser`` over ``torch.pow(relu(x), 2)``,
nemo/collections/nlp/modules/common/megatron/utils.py); the ``"megatron"`` fusion groups price
that as fused pointwise chains (for squared ReLU: one backward kernel; forward, ``relu`` and
``square`` stay two kernels because ``relu``'s output is kept for backward). NeMo 2.x runs the
same squared ReLU eagerly (nemo/collections/llm/fn/activation.py, v2.0 to v2.3: "# @torch.jit.script
# remove until we have serialization"): every op of the activation and of its gradient is a kernel
of its own, and PyTorch's gradient of ``pow(x, 2)`` is itself three
kernels (``pow_backward``: ``grad * (2 * x.pow(1))``; derivatives.yaml / FunctionsManual.cpp),
where the IR states it as one op. ``TrainingConfig.activation_fusion = False`` prices that.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from coplan.cost.parts import Kernel, Vec
from coplan.ir.types import Graph, Op, OpKind, Phase, Tensor

#: Elementwise passes (a read and a write of the op's output) eager PyTorch runs for an IR op
#: beyond the op itself: the gradient of ``pow(x, 2)`` computes ``x.pow(1)`` and ``2 * ...`` before
#: the product with the incoming gradient that the IR's ``square_bwd`` is.
EAGER_EXTRA_PASSES: dict[str, int] = {"square_bwd": 2}


def extra_passes(graph: Graph, op: Op, vec: Callable[[Tensor], Vec], shard: int) -> list[Kernel]:
    """The kernels eager PyTorch runs for ``op`` beyond the one the IR states."""
    n = EAGER_EXTRA_PASSES.get(op.target, 0)
    if not n or not op.outputs:
        return []
    out = graph.tensors[op.outputs[0]]
    v = vec(out)
    both: Vec = tuple(2 * x for x in v)  # type: ignore[assignment]
    return [Kernel(op.phase, "vector", shard, 0.0, float(out.numel), both, ops=(op.id,)) for _ in range(n)]


def activation_ops(graph: Graph, ops: Sequence[Op]) -> frozenset[int]:
    """The MLP activation of a block: its forward pointwise ops in an ``mlp`` module (not in one
    of the MLP's linear layers) and the backward ops of their gradients. None for an MoE block,
    whose ``mlp`` module also routes and combines tokens."""
    if any(p in ("router", "experts") for op in ops for p in op.module_path.split(".")):
        return frozenset()
    fwd = {
        op.id
        for op in ops
        if op.phase is Phase.FORWARD and op.kind is OpKind.ELEMENTWISE and _in_mlp(op.module_path)
    }
    bwd = {op.id for op in ops if op.phase is Phase.BACKWARD and op.forward_op in fwd}
    return frozenset(fwd | bwd)


def _in_mlp(path: str) -> bool:
    parts = path.split(".")
    return "mlp" in parts and not any(p.startswith(("c_", "fc", "up_", "down_", "gate_")) for p in parts)


def eager_variant(
    graph: Graph,
    ops: Sequence[Op],
    fwd: Sequence[Kernel],
    bwd: Sequence[Kernel],
    kernel: Callable[[tuple[int, ...]], Kernel],
    vec: Callable[[Tensor], Vec],
    shard: Callable[[Op], int],
) -> tuple[tuple[Kernel, ...], tuple[Kernel, ...]] | tuple[()]:
    """The block's (forward, backward) kernels with its MLP activation run eagerly, or ``()`` where
    that changes nothing (no activation ops, or each already a kernel of its own). For fused kernel
    groups; eager ones (fusion ``"none"``) have the extra passes already (``extra_passes``)."""
    act = activation_ops(graph, ops)
    if not act:
        return ()
    changed = False

    def split(kernels: Sequence[Kernel]) -> tuple[Kernel, ...]:
        nonlocal changed
        out: list[Kernel] = []
        for k in kernels:
            real = [graph.ops[i] for i in k.ops if graph.ops[i].kind is not OpKind.VIEW]
            if not act.intersection(k.ops) or (len(real) == 1 and not EAGER_EXTRA_PASSES.get(real[0].target)):
                out.append(k)
                continue
            changed = True
            for op in real:
                out.append(kernel((op.id,)))
                out.extend(extra_passes(graph, op, vec, shard(op)))
        return tuple(out)

    f, b = split(fwd), split(bwd)
    return (f, b) if changed else ()
