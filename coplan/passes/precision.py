"""The precision pass: AMP-style rules, with the other decisions fixed.

As ``torch.autocast`` does: matmul-class ops run in bf16 where the device has bf16 units, else in
fp16 with dynamic loss scaling, else fp32; the ops on autocast's fp32 list (norms, softmax,
log-softmax, the loss) run in fp32 and store fp32 outputs, so a GEMM reading one needs a cast back
to 16 bits (a kernel of its own unless fusion puts it into a generated kernel); master weights stay
fp32. AMP never picks fp8 (that takes a Transformer Engine recipe), so neither does this pass.

The other precision variants a search may choose (``precision_variant``):

- ``fused``: no per-op overrides: sensitive ops accumulate in fp32 inside their (fused) kernels and
  read and write the compute dtype, as Megatron-LM's fused norm, softmax and cross-entropy kernels
  do; the loss on the vocabulary stays fp32;
- ``autocast``: the AMP rules above;
- ``loss16``: ``fused`` with the loss path (log-softmax, loss) in 16 bits too, which the checker
  allows only under a stated numerics tolerance (``plan.checker.SENSITIVE_16BIT_ERROR``).
"""

from __future__ import annotations

from dataclasses import replace

from coplan.ir.types import Graph, Op, OpKind, Phase, TensorRole
from coplan.passes.base import register
from coplan.plan.context import PlanContext
from coplan.plan.types import Plan, PrecisionPlan

PRECISION_VARIANTS: tuple[str, ...] = ("fused", "autocast", "loss16")
#: op kinds (and aten targets of elementwise ops) on torch.autocast's fp32 list
_AUTOCAST_FP32_KINDS = frozenset({OpKind.NORM, OpKind.SOFTMAX, OpKind.LOSS})
_AUTOCAST_FP32_TARGETS = frozenset({"log_softmax", "softmax", "layer_norm", "rms_norm"})
_LOSS_TARGETS = frozenset({"log_softmax", "cross_entropy", "nll_loss"})


def _forward_ops(ctx: PlanContext) -> list[Op]:
    """Forward ops a precision decision names: the reference blocks' and those outside blocks."""
    idx = ctx.index
    refs = sorted(set(idx.ref_of.values()))
    ops = [op for r in refs for op in idx.block_ops[r]] + list(idx.outside)
    return [op for op in ops if op.phase is Phase.FORWARD]


def _target(op: Op) -> str:
    return op.target.split(".")[1] if op.target.startswith("aten.") else op.target


def autocast_ops(ctx: PlanContext) -> tuple[tuple[str, str], ...]:
    """fp32 overrides for the ops autocast runs in fp32."""
    return tuple(
        (op.name, "fp32")
        for op in _forward_ops(ctx)
        if op.kind in _AUTOCAST_FP32_KINDS or _target(op).removesuffix("_") in _AUTOCAST_FP32_TARGETS
    )


#: op kinds torch.autocast runs in its 16-bit dtype whatever their inputs (its lower-precision
#: list: ``linear``, ``matmul``, ``scaled_dot_product_attention``)
_AUTOCAST_16BIT_KINDS = frozenset({OpKind.MATMUL, OpKind.ATTENTION})


def autocast_stream_ops(ctx: PlanContext, compute: str = "bf16") -> tuple[tuple[str, str], ...]:
    """fp32 overrides for what ``torch.autocast`` over fp32 parameters computes in fp32: its fp32
    list (``autocast_ops``) and, by type promotion, every other op reading an fp32 tensor or
    parameter. The embedding is on neither of autocast's lists, so it returns its fp32 weight's
    rows; the residual stream it starts stays fp32 through every block (an fp32 input plus a GEMM's
    16-bit output promotes to fp32), so each norm reads fp32 and each GEMM after one casts its
    input; a 16-bit tensor times an fp32 buffer (RoPE's tables, which ``module.to(torch.float32)``
    leaves fp32) is fp32 too. What ``coplan run`` baselines run: the model in fp32 under autocast
    (``coplan.apply.train``); a plan's own steps cast the model, buffers included
    (``model_dtype``), instead. Found by propagating dtypes over the whole forward graph in order,
    then named for the reference blocks and the ops outside."""
    graph = ctx.index.graph
    fp32 = {
        t.id
        for t in graph.tensors
        if t.role in (TensorRole.PARAMETER, TensorRole.BUFFER) and t.dtype.startswith("float")
    }
    listed = {name for name, _ in autocast_ops(ctx)}
    promoted: set[int] = set()
    for op in graph.ops:
        if op.phase is not Phase.FORWARD or op.kind in _AUTOCAST_16BIT_KINDS:
            continue
        on_list = op.kind in _AUTOCAST_FP32_KINDS or _target(op).removesuffix("_") in _AUTOCAST_FP32_TARGETS
        if on_list or op.kind is OpKind.EMBEDDING or any(t in fp32 for t in op.inputs):
            fp32.update(op.outputs)
            promoted.add(op.id)
    names = {op.name for op in _forward_ops(ctx) if op.id in promoted or op.name in listed}
    # ``F.cross_entropy`` asks log-softmax for the logits' own dtype, which autocast keeps
    # (``coplan.cost.eager``, ``log_softmax:autocast``): it runs in 16 bits, and ``nll_loss``, on
    # autocast's fp32 list, reads a cast copy (``coplan.cost.profile``)
    half = "fp16" if compute == "fp16" else "bf16"
    loss = dict(loss16_ops(ctx, half))
    return tuple(
        (op.name, half if op.name in loss and _target(op) == "log_softmax" else "fp32")
        for op in _forward_ops(ctx)
        if op.name in names
    )


def loss16_ops(ctx: PlanContext, dtype: str) -> tuple[tuple[str, str], ...]:
    """16-bit overrides for the loss path on the vocabulary (outside the blocks)."""
    return tuple(
        (op.name, dtype)
        for op in _forward_ops(ctx)
        if op.block is None and (op.kind is OpKind.LOSS or _target(op).removesuffix("_") in _LOSS_TARGETS)
    )


#: per-op dtype assignments of a block template are enumerated where it has at most this many
#: ops whose dtype is a choice (2^n assignments; transformer blocks have 2 or 3)
MAX_BLOCK_CHOICES = 4


def block_assignments(ctx: PlanContext, precision: PrecisionPlan) -> list[PrecisionPlan]:
    """``precision`` with the block templates' autocast-list ops (norms, softmaxes) each in fp32 or
    fused in the compute dtype, every combination, the ops outside the blocks as ``precision`` has
    them: what a per-op search decides for the blocks. Only under a 16-bit compute dtype, and only
    where the blocks have at most ``MAX_BLOCK_CHOICES`` such ops (otherwise ``[precision]``)."""
    if precision.compute in ("fp32", "tf32"):
        return [precision]
    idx = ctx.index
    in_blocks = {op.name for r in set(idx.ref_of.values()) for op in idx.block_ops[r]}
    choices = sorted(name for name, _ in autocast_ops(ctx) if name in in_blocks)
    if not choices or len(choices) > MAX_BLOCK_CHOICES:
        return [precision]
    outside = tuple((n, d) for n, d in precision.ops if n not in in_blocks)
    out = []
    for mask in range(2 ** len(choices)):
        chosen = tuple((n, "fp32") for i, n in enumerate(choices) if mask >> i & 1)
        out.append(replace(precision, ops=tuple(sorted(outside + chosen))))
    return out


def precision_variant(ctx: PlanContext, compute: str, variant: str) -> PrecisionPlan | None:
    """The precision plan of ``variant`` for ``compute`` (None: the variant does not apply)."""
    scaling = compute == "fp16"
    if variant == "fused" or compute in ("fp32", "tf32"):
        return PrecisionPlan(compute=compute, loss_scaling=scaling) if variant == "fused" else None
    if variant == "autocast":
        return PrecisionPlan(compute=compute, ops=autocast_ops(ctx), loss_scaling=scaling)
    if variant == "loss16":
        half = "fp16" if compute == "fp16" else "bf16"
        ops = loss16_ops(ctx, half)
        return PrecisionPlan(compute=compute, ops=ops, loss_scaling=scaling) if ops else None
    raise ValueError(f"unknown precision variant {variant!r}; variants: {', '.join(PRECISION_VARIANTS)}")


#: what automatic mixed precision computes in, by preference: a 16-bit type where the devices have
#: one (bf16 first: fp16's speed without loss scaling), else full precision; fp8 only where the job
#: allows nothing else
AMP_ORDER = ("bf16", "fp16", "fp32", "tf32", "fp8")


def amp_precision(ctx: PlanContext) -> PrecisionPlan:
    allowed = ctx.compute_dtypes
    compute = next((d for d in AMP_ORDER if d in allowed), "fp32")
    plan = precision_variant(ctx, compute, "autocast") or precision_variant(ctx, compute, "fused")
    assert plan is not None
    return plan


def op_moves(ctx: PlanContext, precision: PrecisionPlan) -> list[PrecisionPlan]:
    """``precision`` with one op's dtype changed, for each op whose dtype is a choice: an op on
    autocast's fp32 list in fp32 or accumulating in fp32 inside its kernel (``fused``), and, where
    the job's tolerance allows 16 bits on sensitive ops, the loss path in 16 bits or not. Only
    under a 16-bit compute dtype (fp32 and tf32 steps have nothing to lower)."""
    from coplan.plan.checker import SENSITIVE_16BIT_ERROR

    if precision.compute in ("fp32", "tf32"):
        return []
    half = "fp16" if precision.compute == "fp16" else "bf16"
    choices: dict[str, str] = {n: "fp32" for n, _ in autocast_ops(ctx)}
    if ctx.numerics.tolerance >= SENSITIVE_16BIT_ERROR:
        choices.update(dict(loss16_ops(ctx, half)))
    have = precision.overrides
    out = []
    for name in sorted(choices):
        ops = dict(have)
        if name in ops:
            del ops[name]
        else:
            ops[name] = choices[name]
        out.append(replace(precision, ops=tuple(ops.items())))
    return out


@register("precision")
def precision_pass(graph: Graph, plan: Plan, ctx: PlanContext) -> Plan:
    return plan.with_(precision=amp_precision(ctx))
