"""What fp8 training keeps for backward and what its casts cost: Transformer Engine's fp8 GEMMs.

Memory. Under fp8 (Transformer Engine's ``fp8_autocast``), a ``Linear`` / ``LayerNormLinear``
casts its input to fp8 for the forward GEMM and keeps that fp8 copy (one byte per element) for the
weight gradient, not the 16-bit input (transformer_engine/pytorch/module/linear.py,
``_Linear.forward``: ``ctx.save_for_backward(... inputmat ...)`` saves the casted input when fp8
is on, NVIDIA/TransformerEngine v1.7). So a block activation whose only forward readers are GEMMs
(the norms' outputs, the GeLU or SwiGLU output feeding the second MLP GEMM) is kept at one byte
instead of two, and one that a GEMM reads but another op also keeps for its own backward (the
attention output, which the fused attention kernel keeps in 16 bits) is kept twice: 16 bits and
the GEMM's fp8 copy. The embedding, LM head and loss stay in 16 bits (``estimate``).

Time. An fp8 GEMM on Hopper reads both operands in fp8 and K-major, so TE quantises every GEMM
input and output gradient, and transposes the ones the weight gradient reads, in memory-bound
kernels of their own (``quant_bytes``): only the norm before QKV and FC1 writes fp8 itself
(``LayerNormLinear``); the attention output and the MLP activation, which Megatron-Core computes
outside TE, are cast by the next GEMM's module. Weights are cast once per step
(``weight_cast_bytes``), and their fp8 copies stay allocated through it (``weight_cache_bytes``).
This follows TE v1.8 (Jul 2024); TE 2 reorganises the casts around quantizer objects, and is
priced the same. torchao's ``tensorwise`` recipe casts the same operands with one scale each, and
is priced the same way; its ``rowwise`` recipe is priced by ``rowwise_bytes``. MoE experts
(batched 3-D weights) run at the fp8 rate without these casts, and the router is not an fp8 GEMM.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from coplan.cost.config import TrainingConfig
from coplan.cost.fusion import readers
from coplan.cost.parts import ACT, FIX, NV, TP, Kernel, QuantGemm, Vec
from coplan.hardware.device import DeviceSpec
from coplan.ir.types import Graph, Op, OpKind, Phase, Tensor, TensorRole


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


def quant_gemms(
    graph: Graph, kernels: Sequence[Kernel], tensor_shard: Callable[[Tensor], int]
) -> tuple[QuantGemm, ...]:
    """The forward GEMMs of a block's ``kernels`` (linear layers: an activation times a 2-D
    weight) as ``QuantGemm`` entries."""
    out = []
    for k in kernels:
        if k.kind != "matmul":
            continue
        mm = next(graph.ops[i] for i in k.ops if graph.ops[i].kind is OpKind.MATMUL)
        x = w = None
        for tid in mm.inputs:
            t = graph.tensors[tid]
            if graph.tensors[t.storage_id].role is TensorRole.PARAMETER:
                if w is None and len(t.shape) == 2:  # the weight (an addmm's bias comes first)
                    w = t
            elif x is None:
                x = t
        if x is None or w is None:
            continue  # not a linear layer: a batched GEMM of two activations, or MoE experts' 3-D weights
        if mm.module_path.rsplit(".", 1)[-1] in _PLAIN_LINEAR:
            continue  # an MoE router: a plain PyTorch linear layer in Megatron-Core, not TE's
        src = _through_views(graph, x)
        y = graph.tensors[mm.outputs[0]]
        out.append(
            QuantGemm(
                input_key=src.storage_id,
                input_elems=float(x.numel),
                output_elems=float(y.numel),
                weight_elems=float(w.numel),
                row_parallel=tensor_shard(src) == TP,
                from_norm=src.producer is not None and _is_norm(graph.ops[src.producer]),
                dtype=k.dtype,
            )
        )
    return tuple(out)


#: Linear layers of a block that Megatron-Core runs outside Transformer Engine (MoE routers)
_PLAIN_LINEAR = frozenset({"router", "gate"})


def _through_views(graph: Graph, t: Tensor) -> Tensor:
    """The tensor a view chain starts from (what a real kernel wrote)."""
    while t.producer is not None:
        op = graph.ops[t.producer]
        if op.kind is not OpKind.VIEW or not op.inputs:
            break
        t = graph.tensors[op.inputs[0]]
    return t


#: A norm module's name (a captured RMSNorm is elementwise ops inside it: ``ln_1``, ``norm``,
#: ``input_layernorm``)
_NORM_MODULE = re.compile(r"^ln(_\w+)?$|norm")


def _is_norm(op: Op) -> bool:
    return op.kind is OpKind.NORM or bool(_NORM_MODULE.search(op.module_path.rsplit(".", 1)[-1]))


def quant_bytes(
    gemms: Sequence[QuantGemm], tp: int, sequence_parallel: bool
) -> tuple[float, float, int, int]:
    """(forward bytes, backward bytes, forward kernels, backward kernels) per GPU of the casts and
    transposes Transformer Engine runs around a block's fp8 GEMMs in one microbatch.

    Per element, TE v1.8 (``module/linear.py``, ``module/layernorm_linear.py``, ``module/base.py``
    ``grad_output_preprocess``): a norm-fed input (LayerNormLinear) is written in fp8 by the norm
    and transposed for the weight gradient in backward (read 1, write 1 byte); another input is
    cast and transposed in one forward kernel (read 2, write 1 + 1), or under sequence parallelism
    cast forward where it lives (2 + 1; a column-parallel one on the local sequence shard, before
    its fp8 all-gather) and transposed backward (1 + 1). An output gradient is cast and transposed
    in one kernel (2 + 1 + 1); a row-parallel GEMM's under sequence parallelism is cast on the
    local shard (2 + 1), gathered in fp8, then transposed whole (1 + 1). Transposes of
    column-parallel inputs and of row-parallel output gradients are whole (gathered, or
    replicated) on every GPU.
    """
    sp = sequence_parallel and tp > 1
    fwd = bwd = 0.0
    nf = nb = 0
    inputs: dict[int, QuantGemm] = {}
    grads: dict[int, float] = {}
    for g in gemms:
        if g.dtype not in ("", "fp8"):
            continue  # kept in 16 bits by a precision override
        inputs.setdefault(g.input_key, g)
        grads[g.input_key] = grads.get(g.input_key, 0.0) + g.output_elems
    for key, g in inputs.items():
        x = g.input_elems / tp if g.row_parallel else g.input_elems
        if g.from_norm:
            bwd += 2 * x
            nb += 1
        elif sp:
            # cast where the input lives (a column-parallel input on the local sequence shard, then
            # gathered in fp8), transposed whole for the weight gradient
            fwd += 3 * (x if g.row_parallel else x / tp)
            bwd += 2 * x
            nf += 1
            nb += 1
        else:
            fwd += 4 * x
            nf += 1
        dy = grads[key]
        if g.row_parallel and sp:
            bwd += 3 * dy / tp + 2 * dy
            nb += 2
        else:
            bwd += 4 * (dy if g.row_parallel or tp == 1 else dy / tp)
            nb += 1
    return fwd, bwd, nf, nb


def weight_cache_bytes(gemms: Sequence[QuantGemm], tp: int) -> float:
    """Bytes per GPU of the fp8 copies of a block's weights TE keeps through the step: a weight and
    its transpose, one byte each (``get_fp8_workspace`` with a ``cache_name``, which Megatron-Core's
    ``is_first_microbatch`` selects: transformer_engine/pytorch/module/base.py, v1.8)."""
    return sum(2 * g.weight_elems / tp for g in gemms if g.dtype in ("", "fp8"))


def weight_cast_bytes(gemms: Sequence[QuantGemm], tp: int) -> float:
    """Bytes per GPU of casting a block's fp8 weights and their transposes (read 2, write 1 + 1),
    once per step: Megatron-Core passes ``is_first_microbatch`` so TE caches them after that."""
    return sum(4 * g.weight_elems / tp for g in gemms if g.dtype in ("", "fp8"))


#: Bytes per element of torchao's rowwise casts (``torchao/testing/training/roofline_utils.py``,
#: ``get_tensor_memory_traffic_ovhd_s`` for ``rowwise``, the recipe's own roofline): an activation
#: or an output gradient is cast along its rows (read 2, write 1) and, for the other GEMM that reads
#: it, transposed in 16 bits and cast along the other axis (read 2, write 2 + 1; read 2, write 1):
#: 8 bytes, the first cast in forward for an input. A weight: cast (2 + 1) in forward, transposed
#: (2 + 2) and cast (2 + 1) in backward: 10 bytes.
ROWWISE_ACT_BYTES = (3.0, 5.0)  # (cast along rows, transpose and cast along columns)
ROWWISE_WEIGHT_BYTES = (3.0, 7.0)  # (forward, backward)
#: Bytes per element of the rescale after each backward GEMM: torchao runs the gradients' GEMMs
#: without fast accumulation through cuBLAS's tensorwise kernel with unit scales and multiplies the
#: output by the row scales in a kernel of its own (``torchao/float8/float8_ops.py``
#: ``addmm_float8_unwrapped``: "The rowwise CUTLASS-based kernel is so slow without fast-accum",
#: pytorch/ao#1325, Dec 2024, until pytorch/ao#2595, Jul 2025; pytorch/ao#2184: Inductor codegens at
#: least one extra kernel per GEMM for it): read 2, write 2.
ROWWISE_RESCALE_BYTES = 4.0


def rowwise_bytes(gemms: Sequence[QuantGemm], tp: int) -> tuple[float, float, int, int]:
    """(forward bytes, backward bytes, forward kernels, backward kernels) per GPU of torchao's
    rowwise casts and rescales around a block's fp8 GEMMs in one microbatch, weights included:
    ``Float8Linear`` casts its weight at every forward call and again in backward
    (``torchao/float8/float8_linear.py``, ``matmul_with_hp_or_float8_args``), keeping no fp8 copy.

    Tensor parallelism without fp8 gathers (torchtitan enables ``Float8ColwiseParallel`` only for
    tensorwise scaling, ``torchtitan/models/llama3/infra/parallelize.py`` ``apply_tp``) casts what
    each rank holds after the 16-bit collectives: a column-parallel GEMM's whole input and a
    row-parallel GEMM's whole output gradient on every rank, the sharded ones on their shard. Casts
    of one input shared by several GEMMs are one (torch.compile's graph CSE)."""
    act_fwd, act_bwd = ROWWISE_ACT_BYTES
    w_fwd, w_bwd = ROWWISE_WEIGHT_BYTES
    fwd = bwd = 0.0
    nf = nb = 0
    seen: set[int] = set()
    for g in gemms:
        if g.dtype not in ("", "fp8"):
            continue  # kept in 16 bits by a precision override
        x = g.input_elems / tp if g.row_parallel else g.input_elems
        dy = g.output_elems if g.row_parallel else g.output_elems / tp
        w = g.weight_elems / tp
        if g.input_key not in seen:
            seen.add(g.input_key)
            fwd += act_fwd * x
            bwd += act_bwd * x
            nf += 1
            nb += 2  # the column amax, then the transposing cast
        bwd += (act_fwd + act_bwd) * dy + ROWWISE_RESCALE_BYTES * (x + w)
        fwd += w_fwd * w
        bwd += w_bwd * w
        nf += 1
        nb += 3 + 2 + 3  # output gradient's casts; two rescales; weight's transpose, amax, cast
    return fwd, bwd, nf, nb


def runs_fp8(dtype: str, device: DeviceSpec) -> bool:
    """Whether training in ``dtype`` runs Transformer Engine's fp8 on ``device`` (a device without
    fp8 matrix units runs the GEMMs in 16 bits, and TE none of its fp8 machinery)."""
    return dtype == "fp8" and device.supports("fp8")


@dataclass(frozen=True, slots=True)
class Fp8Cost:
    """What fp8 adds to one block template on one device, per microbatch."""

    forward_s: float  # casts and transposes, forward (re-run under full recompute)
    backward_s: float
    forward_kernels: int
    backward_kernels: int
    weight_cast_s: float  # the microbatch's share of the weights' casts
    weight_cache_bytes: float  # fp8 weight copies kept through the step (``weight_cache_bytes``)


def fp8_cost(
    gemms: Sequence[QuantGemm], config: TrainingConfig, bandwidth: float, launch_s: float
) -> Fp8Cost:
    """The block's fp8 casts at ``bandwidth`` bytes/s and ``launch_s`` per kernel."""
    if config.fp8_scaling == "rowwise":
        # weights cast at every use, inside the forward and backward (``rowwise_bytes``)
        fb, bb, nf, nb = rowwise_bytes(gemms, config.tp)
        return Fp8Cost(fb / bandwidth + nf * launch_s, bb / bandwidth + nb * launch_s, nf, nb, 0.0, 0.0)
    fb, bb, nf, nb = quant_bytes(gemms, config.tp, config.sequence_parallel)
    cast = weight_cast_bytes(gemms, config.tp) / bandwidth
    if config.fp8_params:
        cast /= 2  # the optimizer writes the fp8 weights; only their transposes are made in the step
    # cast in the step's first microbatch and cached (a share per microbatch), or, where weights
    # are gathered per layer and freed after use, at every use
    share = cast if config.gathers_per_unit else cast / config.num_microbatches
    return Fp8Cost(
        fb / bandwidth + nf * launch_s,
        bb / bandwidth + nb * launch_s,
        nf,
        nb,
        share,
        weight_cache_bytes(gemms, config.tp),
    )
