"""The plan's precision, enforced on Dynamo's graph by inserting casts; fp8 emulation; loss scaling.

Semantics (what the cost model prices, ``coplan.cost.profile``):

- ``compute`` is the dtype of matmul-class ops and of the activations stored between ops. Under a
  16-bit compute dtype with ``master_weights`` the parameters stay fp32 and every use reads a
  16-bit copy (one cast per parameter per step; autograd casts its gradient back to fp32); without
  master weights the model itself is stored in the compute dtype (``model_dtype``). ``tf32`` stores
  fp32 and allows tf32 matmuls (``matmul_precision``); on a CPU that is plain fp32.
- Non-matmul ops read and write the compute dtype and accumulate in fp32 internally, as the cost
  model assumes. PyTorch's CPU ``layer_norm`` does not for its weight and bias gradients (they
  are summed over every token in 16 bits): the pass calls ``layer_norm`` instead, which takes those
  two sums in fp32 from the same saved tensors.
- RMSNorm in 16 bits is ``rms_norm``: statistics in fp32, the normalized input kept in the compute
  dtype as the IR prices it (PyTorch's composite keeps it in fp32). Buffers stay fp32 (RoPE's cos
  and sin tables, F32 in the IR); an op reading one writes the compute dtype (``buffer_readers``),
  so RoPE's q and k reach attention in the dtype of v.
- ``fp8``: GEMMs of the blocks quantize their operands (as an ``fp8`` override, below), the LM
  head and every other op run in bf16 (``fp8_gemms``).
- The loss path on the vocabulary (``cross_entropy`` = the IR's ``log_softmax`` + ``nll_loss``)
  runs on fp32 logits unless the plan lowers those ops explicitly.
- ``ops`` overrides: ``fp32`` casts an op's floating inputs to fp32 and its output back to the
  compute dtype (the consumer's cast kernel); ``bf16``/``fp16`` runs it in 16 bits; ``fp8`` on a
  GEMM quantizes both operands to ``float8_e4m3fn`` with a per-tensor scale ``amax / 448`` and
  dequantizes them for the matmul (emulation: where the hardware has no fp8 units the rounding is
  what fp8 hardware would see, the arithmetic is not faster). Gradients pass straight through the
  quantization (the scale is treated as a constant), as fp8 training recipes do. A plan names the
  ops of a reference block; the override applies to that op in every block (``every_block``).
  Which copy of an overridden op's output backward keeps is the partitioner's decision
  (``partition.kept_copies``: the 16-bit copy the next GEMM reads, not the fp32 output).

The pass is numerics-changing and kept apart from the partitioner (numerics-preserving).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from coplan.apply.names import PLAN_CAST, OpNodes, map_ops
from coplan.apply.vocab import LOG_SOFTMAX_OPS, NLL_OPS
from coplan.ir.types import Graph, Op, OpKind, Phase, TensorRole
from coplan.plan.types import PrecisionPlan

DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "tf32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8": torch.bfloat16,  # fp8 plans keep bf16 activations; GEMM operands are quantized
}
#: Dynamo-graph calls whose floating inputs are the logits the loss reads (cast to fp32), and the
#: loss ops whose outputs stay as they are (no cast back to the compute dtype)
LOSS_INPUTS = frozenset({torch.nn.functional.cross_entropy}) | LOG_SOFTMAX_OPS
LOSS_OPS = LOSS_INPUTS | NLL_OPS
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn

#: Unit roundoff u (half an ulp at 1: 2^-p for p significant bits) of each dtype's rounding.
UNIT_ROUNDOFF: dict[str, float] = {
    "fp32": 2.0**-24,
    "tf32": 2.0**-11,  # matmul operands only (fp32 storage)
    "bf16": 2.0**-8,
    "fp16": 2.0**-11,
    "fp8": 2.0**-4,  # float8_e4m3fn: GEMM operands only (activations stay bf16)
}
#: 16-bit roundings on the path of one parameter's gradient, per block and once more outside the
#: blocks (embedding, final norm, LM head, loss): every stored forward output it reads and every
#: backward output it passes through (a GPT block has ~8 of the first and ~12 of the second)
ROUNDINGS_16 = 20
#: fp8 roundings on that path per block: the quantized input its weight gradient reads and the
#: quantized weight its input gradient passes (gradients flow through the quantization unrounded)
ROUNDINGS_8 = 2
#: fp32's floor: the same fp32 arithmetic in another order (fused recompute, microbatches and ranks
#: splitting a sum, thread counts) moves a sum of N terms by ~u sqrt(N); measured ~6e-7 on a step,
#: 1e-4 leaves room for reductions of 10^5 terms and still catches a wrong term, which is O(1)
FP32_FLOOR = 1e-4


def tolerance(precision: PrecisionPlan, layers: int) -> float:
    """Relative gradient error accepted against the fp32 eager reference (the largest over
    parameters of ``||g - g_ref|| / ||g_ref||``) for a model of ``layers`` blocks.

    Each rounding of a value to a dtype of unit roundoff ``u`` changes it by a relative error
    uniform in ``[-u, u]`` (standard deviation ``u / sqrt(3)``); the ``n`` roundings on a
    gradient's path (``ROUNDINGS_16``, ``ROUNDINGS_8`` per block, plus one block's worth outside
    them) are independent and add like a random walk, so the tolerance is three standard
    deviations, ``3 sqrt(sum n_d u_d^2 / 3)``, over the plan's loosest 16-bit dtype and fp8 when
    it quantizes GEMMs; sums accumulate in fp32 (norms included: ``layer_norm``) and add fp32
    errors only. For 2 blocks that is 13.4 u: bf16 5.2e-2, fp16 6.5e-3, fp8 0.27 (with its bf16
    activations). Measured on a 2-block GPT (128 wide, 1024 tokens, against fp64): bf16 6.5e-3,
    fp16 8.2e-4, fp8 2.9e-2, each 11-13% of its tolerance, and growing by a third from 1 to 8
    blocks (bf16 5.9e-3 -> 8.5e-3) where the tolerance doubles: the bound is loose by a stable
    factor across dtypes, tight enough to catch a kernel that sums in 16 bits (CPU bf16
    ``layer_norm`` parameter gradients: 0.15, 38 u).
    """
    used = {precision.compute, *(d for _, d in precision.ops)}
    wide = {"bf16" if d == "fp8" else d for d in used}  # fp8 plans keep 16-bit activations
    stages = layers + 1
    var = ROUNDINGS_16 * stages * max(UNIT_ROUNDOFF[d] for d in wide) ** 2 / 3
    if "fp8" in used:
        var += ROUNDINGS_8 * stages * UNIT_ROUNDOFF["fp8"] ** 2 / 3
    return max(FP32_FLOOR, 3 * math.sqrt(var))


def compute_dtype(precision: PrecisionPlan) -> torch.dtype:
    return DTYPES[precision.compute]


def model_dtype(precision: PrecisionPlan) -> torch.dtype:
    """The dtype parameters are stored in: fp32 with master weights, else the compute dtype."""
    return torch.float32 if precision.master_weights else compute_dtype(precision)


def fp8_quantize(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded through float8_e4m3fn with a per-tensor scale (amax / 448), returned in
    ``x``'s dtype; the gradient passes straight through."""
    amax = x.detach().abs().amax().float().clamp(min=1e-12)
    scale = amax / FP8_MAX
    q = (x.detach().float() / scale).to(FP8).float() * scale
    return x + (q.to(x.dtype) - x).detach()


@dataclass
class CastReport:
    """What the pass did to one Dynamo graph."""

    param_casts: int = 0
    loss_casts: int = 0
    overridden: list[str] = field(default_factory=list)
    not_found: list[str] = field(default_factory=list)
    norms: int = 0  # norms replaced by ``layer_norm`` / ``rms_norm`` (fp32 sums, IR dtypes)
    table_casts: int = 0  # outputs of ops reading fp32 buffers cast to the compute dtype


def _insert_after(graph: fx.Graph, node: fx.Node, fn: object, *args: object) -> fx.Node:
    with graph.inserting_after(node):
        new = graph.call_function(fn, (node, *args))  # type: ignore[arg-type]
    new.meta = {
        k: v for k, v in node.meta.items() if k in ("nn_module_stack", "stack_trace", "source_fn_stack")
    }
    return new


def _cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.to(dtype) if x.is_floating_point() else x


def apply_precision(
    gm: fx.GraphModule, example_inputs: list[object], precision: PrecisionPlan, ir: Graph | None
) -> CastReport:
    """Insert the plan's casts into Dynamo's graph ``gm`` in place."""
    report = CastReport()
    g = gm.graph
    compute = compute_dtype(precision)
    placeholders = [n for n in g.nodes if n.op == "placeholder"]
    if compute != torch.float32 and precision.master_weights:
        for node, value in zip(placeholders, example_inputs, strict=False):
            if isinstance(value, torch.nn.Parameter) and value.is_floating_point():
                # after the last placeholder: FX graphs keep their inputs first
                with g.inserting_after(placeholders[-1]):
                    cast = g.call_function(_cast, (node, compute))
                node.replace_all_uses_with(cast, delete_user_cb=lambda u, c=cast: u is not c)
                report.param_casts += 1
    overrides = {**fp8_gemms(precision, ir), **every_block(ir, dict(precision.ops))}
    tables = buffer_readers(ir) if ir is not None and compute != torch.float32 else set()
    by_name = map_ops(ir, gm, {*overrides, *tables}) if ir is not None and (overrides or tables) else {}
    report.not_found = sorted(n for n, _ in precision.ops if n not in by_name)
    lowered_loss = any(
        by_name.get(n) is not None and d != "fp32" and ir is not None and _is_loss(ir, n)
        for n, d in overrides.items()
    )
    if compute != torch.float32 and not lowered_loss:
        for node in list(g.nodes):
            if node.op == "call_function" and node.target in LOSS_INPUTS:
                _cast_args(g, node, torch.float32)
                report.loss_casts += 1
    done: set[OpNodes] = set()
    for name, dtype in sorted(overrides.items()):
        op = by_name.get(name)
        if op is None or op in done:
            continue
        done.add(op)
        if dtype == "fp8":
            _cast_entries(g, op, None, fn=fp8_quantize)
        else:
            _cast_entries(g, op, DTYPES[dtype], mark=True)
            # the loss is a scalar, read in whatever dtype
            if not any(n.target in LOSS_OPS for n in op.exits):
                _cast_exits(g, op, compute, mark=True)
        report.overridden.append(name)
    for name in sorted(tables):
        op = by_name.get(name)
        if op is not None and op not in done:
            # it reads fp32 tables (RoPE's cos and sin): PyTorch promotes its result to fp32, the
            # plan has it write the compute dtype (what the next op reads and the IR stores)
            _cast_exits(g, op, compute)
            report.table_casts += len(op.exits)
    if compute != torch.float32:
        for node in g.nodes:
            if node.op == "call_function" and node.target in (
                torch.nn.functional.layer_norm,
                torch.layer_norm,
            ):
                node.target = layer_norm
                report.norms += 1
            elif node.op == "call_function" and node.target in (torch.nn.functional.rms_norm, torch.rms_norm):
                node.target = rms_norm
                report.norms += 1
    g.lint()
    gm.recompile()
    return report


class _LayerNormWideGrads(torch.autograd.Function):
    """``layer_norm`` in a 16-bit dtype whose weight and bias gradients are summed in fp32.

    The forward and the input gradient are PyTorch's own kernels (``native_layer_norm`` and its
    backward: the same saved tensors, 16-bit input and fp32 mean and rstd). The CPU kernel also
    sums ``dgamma = sum(dy * xhat)`` and ``dbeta = sum(dy)`` over every token, but in the input's
    dtype: over 1024 tokens of a bf16 step that costs 2e-2 to 4e-2 of relative error (6 u,
    growing with the tokens per thread), 40x what autocast's fp32 norm shows. The cost model
    prices a 16-bit norm that accumulates in fp32, as the CUDA kernel does; here the two sums are
    taken in fp32 from the saved tensors.
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        shape: list[int],
        w: torch.Tensor | None,
        b: torch.Tensor | None,
        eps: float,
    ) -> torch.Tensor:
        out, mean, rstd = torch.ops.aten.native_layer_norm(x, shape, w, b, eps)
        ctx.save_for_backward(x, w, mean, rstd)
        ctx.shape, ctx.has_bias, ctx.bias_dtype = shape, b is not None, b.dtype if b is not None else None
        return out

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
        x, w, mean, rstd = ctx.saved_tensors
        need_x, _, need_w, need_b, _ = ctx.needs_input_grad
        dx = torch.ops.aten.native_layer_norm_backward(
            dy, x, ctx.shape, mean, rstd, w, None, [need_x, False, False]
        )[0]
        lead = tuple(range(x.dim() - len(ctx.shape)))
        wide = dy.float()
        dw = db = None
        if w is not None and need_w:
            dw = (wide * ((x.float() - mean) * rstd)).sum(lead).to(w.dtype)
        if ctx.has_bias and need_b:
            db = wide.sum(lead).to(ctx.bias_dtype)
        return dx, None, dw, db, None


def layer_norm(
    x: torch.Tensor,
    normalized_shape: Any,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    """``F.layer_norm``, with fp32 sums for the parameter gradients of a 16-bit norm on a CPU
    (``_LayerNormWideGrads``); what the precision pass calls instead of ``F.layer_norm``."""
    shape = [normalized_shape] if isinstance(normalized_shape, int) else list(normalized_shape)
    wanted = any(p is not None and p.requires_grad for p in (weight, bias))
    if x.dtype in (torch.bfloat16, torch.float16) and x.device.type == "cpu" and wanted:
        out: torch.Tensor = _LayerNormWideGrads.apply(x, shape, weight, bias, eps)
        return out
    return torch.nn.functional.layer_norm(x, shape, weight, bias, eps)


def rms_norm(
    x: torch.Tensor,
    normalized_shape: Any,
    weight: torch.Tensor | None = None,
    eps: float | None = None,
) -> torch.Tensor:
    """``F.rms_norm`` as the IR prices it in 16 bits (``coplan.capture.synthetic``): ``rstd`` and
    ``x * rstd`` computed in fp32, the normalized input stored in ``x``'s dtype (what the weight
    gradient reads: 2 bytes an element, as priced), the weight applied in fp32 and the output
    rounded once. PyTorch's composite keeps ``x * rstd`` in fp32 for the weight gradient, twice
    the bytes the plan has; the forward values are the same up to that one rounding."""
    if x.dtype not in (torch.bfloat16, torch.float16):
        return torch.nn.functional.rms_norm(x, normalized_shape, weight, eps)
    shape = [normalized_shape] if isinstance(normalized_shape, int) else list(normalized_shape)
    dims = tuple(range(-len(shape), 0))
    wide = x.float()
    eps_ = torch.finfo(x.dtype).eps if eps is None else eps  # F.rms_norm's default
    rstd = torch.rsqrt(wide.pow(2).mean(dims, keepdim=True) + eps_)
    normed = (wide * rstd).to(x.dtype)
    if weight is None:
        return normed
    return (normed.float() * weight.float()).to(x.dtype)


def fp8_gemms(precision: PrecisionPlan, ir: Graph | None) -> dict[str, str]:
    """An fp8 plan's GEMMs: every linear layer inside the blocks (the cost model prices them in
    fp8 and the LM head in bf16, Transformer Engine's default recipe)."""
    if precision.compute != "fp8" or ir is None:
        return {}
    return {
        op.name: "fp8"
        for op in ir.ops
        if op.phase is Phase.FORWARD
        and op.block is not None
        and op.kind is OpKind.MATMUL
        and op.target == "linear"
    }


def every_block(ir: Graph | None, ops: dict[str, str]) -> dict[str, str]:
    """Per-op dtypes of a plan, which names the ops of a reference block (``PlanContext``'s
    convention, as for remat sets), given to the same op of every block of its structure: the
    cost model prices an override for all blocks (``PlanContext.expand_dtypes``), so the runner
    must apply it to all of them, not to block 0 alone. Names outside blocks, and any named
    explicitly, keep their own dtype."""
    if ir is None or not ops:
        return ops
    by_block: dict[int, list[Op]] = {}
    for op in ir.ops:
        if op.phase is Phase.FORWARD and op.block is not None:
            by_block.setdefault(op.block, []).append(op)
    where = {op.name: (b, i) for b, block in by_block.items() for i, op in enumerate(block)}
    shape = {b: tuple(op.target for op in block) for b, block in by_block.items()}
    out: dict[str, str] = {}
    for name, dtype in ops.items():
        if name not in where:
            continue
        ref, i = where[name]
        for b, block in by_block.items():
            if shape[b] == shape[ref]:
                out.setdefault(block[i].name, dtype)
    return {**out, **ops}


def _is_loss(ir: Graph, op_name: str) -> bool:
    return any(op.name == op_name and op.target in ("log_softmax", "nll_loss") for op in ir.ops)


def _cast_args(g: fx.Graph, node: fx.Node, dtype: torch.dtype | None, fn: object = None) -> None:
    """Cast (or pass through ``fn``) every tensor argument of ``node`` (positional, non-integer)."""
    _cast_entries(g, OpNodes((node,), (node,)), dtype, fn)


def _cast_entries(
    g: fx.Graph, op: OpNodes, dtype: torch.dtype | None, fn: object = None, mark: bool = False
) -> None:
    """Cast (or pass through ``fn``) every floating tensor ``op`` reads from outside itself;
    ``mark``: the casts are the plan's override, not part of the op (``names.PLAN_CAST``)."""
    for node, i in op.entries:
        a = node.args[i]
        if not (isinstance(a, fx.Node) and _is_float(a)):
            continue
        with g.inserting_before(node):
            c = g.call_function(fn, (a,)) if fn is not None else g.call_function(_cast, (a, dtype))  # type: ignore[arg-type]
        c.meta = {k: v for k, v in node.meta.items() if k in ("nn_module_stack", "stack_trace")}
        if mark:
            _mark_cast(c)
        node.args = (*node.args[:i], c, *node.args[i + 1 :])


def _cast_exits(g: fx.Graph, op: OpNodes, dtype: torch.dtype, mark: bool = False) -> None:
    """Cast every output of ``op`` to ``dtype`` for its readers outside the op (``mark``: as for
    ``_cast_entries``; unmarked, the cast is the op writing that dtype)."""
    inside = set(op.nodes)
    for node in op.exits:
        back = _insert_after(g, node, _cast, dtype)
        if mark:
            _mark_cast(back)
        node.replace_all_uses_with(back, delete_user_cb=lambda u, b=back: u is not b and u not in inside)  # type: ignore[misc]


def _mark_cast(node: fx.Node) -> None:
    # meta["custom"] is copied onto the aten nodes AOTAutograd traces from this one
    node.meta["custom"] = {**(node.meta.get("custom") or {}), PLAN_CAST: True}


def buffer_readers(ir: Graph) -> set[str]:
    """Forward ops that read a floating buffer (RoPE's fp32 cos and sin tables)."""
    return {
        op.name
        for op in ir.ops
        if op.phase is Phase.FORWARD
        and any(
            ir.tensors[t].role is TensorRole.BUFFER and ir.tensors[t].dtype == "float32" for t in op.inputs
        )
    }


def _is_float(node: fx.Node) -> bool:
    if node.op == "call_function" and node.target is _cast and isinstance(node.args[0], fx.Node):
        # a cast this pass inserted (a parameter's 16-bit copy) has no traced value of its own
        return _is_float(node.args[0])
    val = node.meta.get("example_value", node.meta.get("val"))
    return isinstance(val, torch.Tensor) and val.is_floating_point()


class LossScaler:
    """Dynamic loss scaling for fp16 (as ``torch.amp.GradScaler``): the loss is multiplied by
    ``scale`` before backward, gradients are divided by it before the optimizer step; a step whose
    gradients overflow is skipped and the scale halved; ``growth_interval`` clean steps double it."""

    def __init__(self, enabled: bool, init_scale: float = 2.0**16, growth_interval: int = 2000) -> None:
        self.enabled = enabled
        self.scale = init_scale if enabled else 1.0
        self.growth_interval = growth_interval
        self._good = 0
        self.skipped = 0

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale if self.enabled else loss

    def unscale(self, params: list[torch.nn.Parameter]) -> bool:
        """Divide gradients by the scale; False when one is not finite (the step must be skipped)."""
        if not self.enabled:
            return True
        finite = True
        for p in params:
            if p.grad is None:
                continue
            p.grad.div_(self.scale)
            if not bool(torch.isfinite(p.grad).all()):
                finite = False
        if finite:
            self._good += 1
            if self._good % self.growth_interval == 0:
                self.scale *= 2
        else:
            self.scale = max(self.scale / 2, 1.0)
            self._good = 0
            self.skipped += 1
        return finite
