"""The plan's precision, enforced on Dynamo's graph by inserting casts; fp8 emulation; loss scaling.

Semantics (what the cost model prices, ``coplan.cost.profile``):

- ``compute`` is the dtype of matmul-class ops and of the activations stored between ops. Under a
  16-bit compute dtype with ``master_weights`` the parameters stay fp32 and every use reads a
  16-bit copy (one cast per parameter per step; autograd casts its gradient back to fp32); without
  master weights the model itself is stored in the compute dtype (``model_dtype``). ``tf32`` stores
  fp32 and allows tf32 matmuls (``matmul_precision``); on a CPU that is plain fp32.
- Non-matmul ops read and write the compute dtype; PyTorch's 16-bit norm and softmax kernels
  accumulate in fp32 internally, as the cost model assumes.
- The loss path on the vocabulary (``cross_entropy`` = the IR's ``log_softmax`` + ``nll_loss``)
  runs on fp32 logits unless the plan lowers those ops explicitly.
- ``ops`` overrides: ``fp32`` casts an op's floating inputs to fp32 and its output back to the
  compute dtype (the consumer's cast kernel); ``bf16``/``fp16`` runs it in 16 bits; ``fp8`` on a
  GEMM quantizes both operands to ``float8_e4m3fn`` with a per-tensor scale ``amax / 448`` and
  dequantizes them for the matmul (emulation: where the hardware has no fp8 units the rounding is
  what fp8 hardware would see, the arithmetic is not faster). Gradients pass straight through the
  quantization (the scale is treated as a constant), as fp8 training recipes do.

The pass is numerics-changing and kept apart from the partitioner (numerics-preserving).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from coplan.apply.names import map_ops
from coplan.ir.types import Graph
from coplan.plan.types import PrecisionPlan

DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "tf32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8": torch.bfloat16,  # fp8 plans keep bf16 activations; GEMM operands are quantized
}
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn

#: Relative gradient error accepted against the fp32 eager reference, per compute dtype (max over
#: parameters of ||g - g_ref|| / ||g_ref||). fp32: the same arithmetic in another order (fused
#: recompute, graph execution) differs by a few ulps accumulated over a step, ~1e-6; 1e-4 leaves
#: room for reductions of 10^5 terms. bf16 keeps 8 significant bits (rounding 2^-9 = 0.2% per op);
#: a gradient passes ~10 roundings per layer, which compound like a random walk to a few percent:
#: 5e-2. fp16 keeps 11 bits (2^-12 per op): 1e-2. fp8 e4m3 keeps 4 bits (3% per quantization): 0.15.
TOLERANCE: dict[str, float] = {"fp32": 1e-4, "tf32": 1e-2, "bf16": 5e-2, "fp16": 1e-2, "fp8": 0.15}


def compute_dtype(precision: PrecisionPlan) -> torch.dtype:
    return DTYPES[precision.compute]


def model_dtype(precision: PrecisionPlan) -> torch.dtype:
    """The dtype parameters are stored in: fp32 with master weights, else the compute dtype."""
    return torch.float32 if precision.master_weights else compute_dtype(precision)


def tolerance(precision: PrecisionPlan) -> float:
    """The gradient tolerance of the plan: its loosest dtype (an fp8 GEMM loosens a bf16 plan)."""
    used = {precision.compute, *(d for _, d in precision.ops)}
    return max(TOLERANCE[d] for d in used)


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
    overrides = dict(precision.ops)
    by_name = map_ops(ir, gm, overrides) if ir is not None and overrides else {}
    report.not_found = sorted(n for n in overrides if n not in by_name)
    lowered_loss = any(
        by_name.get(n) is not None and d != "fp32" and ir is not None and _is_loss(ir, n)
        for n, d in overrides.items()
    )
    if compute != torch.float32 and not lowered_loss:
        for node in list(g.nodes):
            if node.op == "call_function" and node.target is torch.nn.functional.cross_entropy:
                _cast_args(g, node, torch.float32)
                report.loss_casts += 1
    done: set[fx.Node] = set()
    for name, dtype in sorted(overrides.items()):
        node = by_name.get(name)
        if node is None or node in done:
            continue
        done.add(node)
        if dtype == "fp8":
            _cast_args(g, node, None, fn=fp8_quantize)
        else:
            _cast_args(g, node, DTYPES[dtype])
            if node.target is not torch.nn.functional.cross_entropy:
                back = _insert_after(g, node, _cast, compute)
                node.replace_all_uses_with(back, delete_user_cb=lambda u, b=back: u is not b)  # type: ignore[misc]
        report.overridden.append(name)
    g.lint()
    gm.recompile()
    return report


def _is_loss(ir: Graph, op_name: str) -> bool:
    return any(op.name == op_name and op.target in ("log_softmax", "nll_loss") for op in ir.ops)


def _cast_args(g: fx.Graph, node: fx.Node, dtype: torch.dtype | None, fn: object = None) -> None:
    """Cast (or pass through ``fn``) every tensor argument of ``node`` (positional, non-integer)."""
    new_args: list[Any] = []
    for a in node.args:
        if isinstance(a, fx.Node) and _is_float(a):
            with g.inserting_before(node):
                c = g.call_function(fn, (a,)) if fn is not None else g.call_function(_cast, (a, dtype))  # type: ignore[arg-type]
            c.meta = {k: v for k, v in node.meta.items() if k in ("nn_module_stack", "stack_trace")}
            new_args.append(c)
        else:
            new_args.append(a)
    node.args = tuple(new_args)


def _is_float(node: fx.Node) -> bool:
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
