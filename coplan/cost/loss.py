"""The language-model loss as Megatron-LM launches it: vocabulary-parallel cross-entropy.

The IR states the loss as PyTorch does (``log_softmax`` + ``nll_loss`` and their gradients: two
passes over the logits each way). Megatron-LM's kernels are another sequence, and its cost on a
large-vocabulary model is a visible part of the step, so under ``fusion="megatron"`` the head's loss
kernels are replaced by the ones Megatron runs, chosen by ``TrainingConfig.loss_fusion``
(Megatron's ``--cross-entropy-loss-fusion`` and ``--cross-entropy-fusion-impl``):

- ``"none"``: ``_VocabParallelCrossEntropy`` (megatron/core/tensor_parallel/cross_entropy.py at
  NVIDIA/Megatron-LM f2e5db402c; megatron/mpu/cross_entropy.py in 2021, same passes). Forward:
  ``logits.float()`` (read 16-bit, write fp32), ``max`` (read), ``-= max`` (read, write), ``exp``
  (read, write), ``sum`` (read), ``div_`` (read, write): 2 + 36 bytes per logit, six kernels, and a
  dozen token-sized kernels (target masks, the gather of the target logit, the log). Backward:
  ``mul_`` by the output gradient (read, write fp32) and the cast back to 16 bits through
  ``.float()``'s gradient (read fp32, write 16-bit): 14 bytes per logit. It keeps the fp32 softmax.
- ``"native"``: the same functions jit-fused (megatron/core/fusions/fused_cross_entropy.py):
  ``float`` + ``max`` in one kernel (read 16-bit, write fp32), ``sub`` + ``exp`` + ``sum`` in one
  (read, write fp32), ``div_`` (read, write fp32); backward ``mul_`` + cast (read fp32, write 16-bit).
- ``"te"``: Transformer Engine's Triton cross-entropy (transformer_engine/pytorch/triton/
  cross_entropy.py): an online-softmax pass reading the 16-bit logits, a second pass reading them
  and writing the gradient in place (16 bits); backward scales that gradient (read, write). It keeps
  the 16-bit gradient, not an fp32 softmax.
- ``"inductor"``: torch.compile's kernels for PyTorch's ``cross_entropy`` (``log_softmax`` +
  ``nll_loss``), which Inductor generates as one online-softmax reduction over the 16-bit logits
  forward and one kernel backward reading them and writing the 16-bit gradient (the kernels of a
  compiled GPT-2 step profiled on an H100, benchmarks/results/gpu/profile_compile.txt:
  ``triton_red_fused__log_softmax_mm_prepare_softmax_online``,
  ``triton_red_fused__log_softmax__log_softmax_backward_data__to_copy``). It keeps the 16-bit
  logits for the backward, not an fp32 softmax.

Token-sized work (per-token maxima, sums, losses) is priced by its launches only: its bytes are a
vocabulary-size fraction of the logits'.
"""

from __future__ import annotations

from collections.abc import Sequence

from coplan.cost.config import LOSS_FUSIONS
from coplan.cost.parts import ACT, F32, FIX, NV, TP, ZERO, Kernel, Vec
from coplan.ir.types import Graph, Op, OpKind, Phase

__all__ = ["LOSS_FUSIONS", "loss_ops", "megatron_loss"]

# (forward kernels, backward kernels): per big kernel (16-bit reads/writes, fp32 reads/writes) in
# logits, and the count of token-sized kernels; see the module docstring for where each comes from
_PLANS: dict[str, tuple[tuple[tuple[float, float], ...], int, tuple[tuple[float, float], ...], int]] = {
    "none": (((1, 1), (0, 1), (0, 2), (0, 2), (0, 1), (0, 2)), 12, ((0, 2), (1, 1)), 6),
    "native": (((1, 1), (0, 2), (0, 2)), 4, ((1, 1),), 2),
    "te": (((1, 0), (2, 0)), 2, ((2, 0),), 0),
    "inductor": (((1, 0),), 0, ((2, 0),), 0),
}


def _vec(act: float, f32: float, fix: float = 0.0) -> Vec:
    out = [0.0] * NV
    out[ACT * 2 + TP] = act
    out[F32 * 2 + TP] = f32
    out[FIX * 2 + TP] = fix
    return tuple(out)  # type: ignore[return-value]


def loss_ops(graph: Graph, ops: Sequence[Op], fp32_ops: set[int]) -> frozenset[int]:
    """The forward loss ops of a head (vocabulary-wide work outside blocks other than GEMMs and
    embeddings, which Megatron computes on fp32 logits) and the backward ops of their gradients."""
    fwd = {op.id for op in ops if op.phase is Phase.FORWARD and op.id in fp32_ops}
    bwd = {op.id for op in ops if op.phase is Phase.BACKWARD and op.forward_op in fwd}
    return frozenset(fwd | bwd)


def megatron_loss(graph: Graph, ops: Sequence[Op], impl: str) -> tuple[list[Kernel], list[Kernel], Vec]:
    """(forward kernels, backward kernels, change of the saved vector) of Megatron's cross-entropy
    ``impl`` over the logits read by the head's loss."""
    logits = 0.0
    tokens = 0.0
    for op in ops:
        if op.phase is Phase.FORWARD and op.kind in (OpKind.SOFTMAX, OpKind.LOSS, OpKind.ELEMENTWISE):
            t = graph.tensors[op.inputs[0]] if op.inputs else None
            if t is not None and t.shape and t.numel > logits:
                logits = float(t.numel)
                tokens = float(t.numel // t.shape[-1])
    fwd_plan, fwd_small, bwd_plan, bwd_small = _PLANS[impl]

    def kernels(phase: Phase, plan: tuple[tuple[float, float], ...], small: int) -> list[Kernel]:
        out = [Kernel(phase, "vector", TP, 0.0, logits, _vec(a * logits, f * logits)) for a, f in plan]
        out += [Kernel(phase, "vector", TP, 0.0, tokens, _vec(0.0, 0.0, 8 * tokens)) for _ in range(small)]
        return out

    # "te" keeps the 16-bit gradient, "inductor" the 16-bit logits, in place of the IR's fp32
    # log-probabilities
    saved = _vec(logits, -logits) if impl in ("te", "inductor") else ZERO
    return kernels(Phase.FORWARD, fwd_plan, fwd_small), kernels(Phase.BACKWARD, bwd_plan, bwd_small), saved
