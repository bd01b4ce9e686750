"""Generated reductions too wide to hold a row in registers: the passes a looped reduction makes.

Inductor's Triton backend holds a whole reduced row in registers (a *persistent* reduction) only
while the row is at most 1,024 elements long (``InductorChoices.should_use_persistent_reduction``
in ``torch/_inductor/choices.py`` at v2.13.0: threshold 1024 for inner reductions; the block is
``rnumel`` itself, so a wider row would spill the registers). A wider row is reduced in a loop over
blocks of it, and whatever needs the reduction's result (the softmax's output needs its max and
sum; a norm's output its mean and variance) runs in a second loop after the first ends. Pointwise
producers inside the kernel are inlined, not stored, so every loop that needs them loads their
inputs again from memory: a fused softmax over GPT-2's 50,257-wide logits reads the logits twice
(Inductor's online softmax, ``config.online_softmax``, merges the max and the sum into one loop),
a fused RMSNorm over LLaMA-2 7B's 4,096-wide rows reads its input twice.

``loop_reads`` counts those extra loads for one kernel; ``kernels.Rates.looped_reductions`` says
where they are paid (GPUs: a row that wide does not stay in a cache between loops when every SM
streams rows of its own; a CPU core's loops over one row hit its own cache). Library kernels
(eager PyTorch, Megatron's fused kernels) stage the row in shared memory instead and are not
priced here.
"""

from __future__ import annotations

from collections.abc import Callable

from coplan.cost.parts import NV, ZERO, Vec
from coplan.ir.types import Graph, Op, OpKind, Tensor

__all__ = ["PERSISTENT_ROWS", "ROW_KINDS", "loop_reads", "reduced_extent", "reduces"]

#: The widest row Inductor's Triton backend reduces in registers (inner reductions).
PERSISTENT_ROWS = 1024

#: reductions a generated kernel can hold (row-wise: norms, softmax, loss, sums)
ROW_KINDS = frozenset({OpKind.REDUCTION, OpKind.NORM, OpKind.SOFTMAX, OpKind.LOSS})
#: ops Inductor computes with a row reduction although the IR calls them elementwise
_ROW_TARGETS = frozenset({"log_softmax", "_log_softmax", "log_softmax_bwd", "softmax", "_softmax"})
#: row ops whose reduction loop reads only their first input (``_log_softmax_backward_data``
#: decomposes to ``grad - exp(out) * sum(grad)``: the saved output is read when writing rows only);
#: every other row op reads all its inputs in both loops (softmax backward sums ``grad * out``)
_REDUCES_FIRST_ONLY = frozenset({"log_softmax_bwd", "_log_softmax_backward_data"})
#: pointwise ops a generated kernel inlines into whatever reads them (recomputed per loop)
_INLINED = frozenset({OpKind.ELEMENTWISE, OpKind.COPY, OpKind.VIEW, OpKind.CREATION})


def reduces(op: Op) -> bool:
    """Whether ``op`` reduces (a sum, a norm, a softmax, a loss, decomposed or not): what a
    generated kernel can hold only as a reduction (the plan checker's rules use it too)."""
    return op.kind in ROW_KINDS or op.target.removeprefix("aten.") in _ROW_TARGETS


def reduced_extent(graph: Graph, op: Op) -> tuple[int, bool]:
    """(elements reduced per output, whether the op's own output needs its reduction's result): a
    row op (norm, softmax) whose output has its input's shape reduces the last dimension and then
    writes rows from the result; a reduction with a smaller output reduces the ratio of sizes."""
    if not reduces(op) or not op.inputs or not op.outputs:
        return 0, False
    src = graph.tensors[op.inputs[0]]
    out = graph.tensors[op.outputs[0]]
    if out.numel >= src.numel and src.shape:
        return int(src.shape[-1]), True
    return int(src.numel // max(1, out.numel)), False


def loop_reads(graph: Graph, group: tuple[int, ...], vec: Callable[[Tensor], Vec]) -> Vec:
    """The bytes a kernel holding ``group`` (op ids in graph order) loads beyond one read of each
    input, when it is generated code with a reduction wider than ``PERSISTENT_ROWS``.

    Each op is given the loop it runs in: the first (0) unless it reads a value that a wide
    reduction in the kernel finishes, then the loop after it. An input is loaded in every loop
    that evaluates an op reading it, an inlined producer being evaluated in every loop that needs
    its output; a row op such as a softmax also re-reads its input in the loop writing its output.
    """
    inside = set(group)
    ops = [graph.ops[i] for i in group]
    wide = {}
    for op in ops:
        extent, rows_out = reduced_extent(graph, op)
        if extent > PERSISTENT_ROWS:
            wide[op.id] = rows_out
    if not wide:
        return ZERO
    ready: dict[int, int] = {}  # tensor -> the loop from which the kernel has its value
    loop: dict[int, int] = {}
    for op in ops:
        at = max((ready.get(t, 0) for t in op.inputs), default=0)
        loop[op.id] = at
        done = at + 1 if op.id in wide else at
        for t in op.outputs:
            ready[t] = done
    needed: dict[int, set[int]] = {}  # tensor -> the loops that load or recompute it
    for op in reversed(ops):
        at = loop[op.id]
        own = {at, at + 1} if wide.get(op.id) else {at}
        if op.kind in _INLINED or wide.get(op.id):
            # inlined (or a row op whose rows are wanted later): evaluated wherever its output is
            for t in op.outputs:
                own |= needed.get(t, set())
        first_only = wide.get(op.id) and op.target.removeprefix("aten.") in _REDUCES_FIRST_ONLY
        for j, t in enumerate(op.inputs):
            needed.setdefault(t, set()).update(own - {at} if first_only and j else own)
    total = [0.0] * NV
    seen: set[int] = set()
    for op in ops:
        for t in op.inputs:
            src = graph.tensors[t]
            if t in seen or (src.producer is not None and src.producer in inside):
                continue
            seen.add(t)
            extra = len(needed.get(t, ())) - 1
            if extra > 0:
                v = vec(src)
                for i in range(NV):
                    total[i] += extra * v[i]
    return tuple(total)  # type: ignore[return-value]
