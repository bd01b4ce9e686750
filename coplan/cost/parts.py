"""The cost model's value types for a digested graph: kernels, parts and the graph profile.

``profile.py`` builds them once per graph (and fusion and precision assignment); ``kernels.py``
and ``estimate.py`` price them. Costs are element vectors split by *precision class* (activations,
fp32 values, fixed-width bytes) and *shard class* (replicated, tensor-parallel), so a configuration
weights them with one dot product.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar, cast

from coplan.ir.oprules import attention_causal, attention_cp
from coplan.ir.types import Graph, Op, OpKind, Phase

T = TypeVar("T")

# Element-vector layout: index = precision class * 2 + shard class.
ACT, F32, FIX = 0, 1, 2  # activation precision; always fp32; fixed width (already in bytes)
REPL, TP = 0, 1
NV = 6
Vec = tuple[float, float, float, float, float, float]
ZERO: Vec = (0.0, 0.0, 0.0, 0.0, 0.0, 0.0)

#: The share of an attention op's FLOPs a causal step computes. The IR counts attention as
#: ``torch.utils.flop_counter`` does, the full q x k score matrix (4 * b * h * s_q * s_k * d forward);
#: under a causal mask a flash kernel skips the tiles above the diagonal, so the cost model prices,
#: and model FLOPs (MFU) count, half of it: s^2/2 scores per (batch, head), not s(s+1)/2, the
#: diagonal's s/2 being below any tile. A bidirectional attention (an encoder's, ``is_causal=False``)
#: computes all of it (``attention_share``).
CAUSAL_FRACTION = 0.5


def attention_share(op: Op) -> float:
    """The share of attention op ``op``'s counted FLOPs a step computes: ``CAUSAL_FRACTION`` under a
    causal mask, all of them without (``coplan.ir.oprules.attention_causal``). Under context
    parallelism over ``c`` ranks (``attention_cp``) the op's shapes are one rank's share of the
    sequence, ``s / c`` queries and keys, while its queries meet all ``s`` keys: ``c`` times the
    counted FLOPs (``s/c x s`` scores against ``(s/c)^2``), under a causal mask the rank's ``1/c``
    of the causal half when the ranks hold balanced chunks (Megatron-Core and torchtitan split
    each sequence into ``2c`` chunks, rank ``i`` taking chunks ``i`` and ``2c - 1 - i``)."""
    return (CAUSAL_FRACTION if attention_causal(op) else 1.0) * attention_cp(op)


def model_flops(ops: Sequence[Op]) -> float:
    """Matrix FLOPs of the forward and backward ops among ``ops``, attention at the share its mask
    computes: the work a step needs, whatever its kernels spend (MFU's numerator)."""
    return float(
        sum(
            op.flops * (attention_share(op) if op.kind is OpKind.ATTENTION else 1.0)
            for op in ops
            if op.phase is not Phase.OPTIMIZER
        )
    )


def vadd(a: Sequence[float], b: Sequence[float]) -> Vec:
    return tuple(x + y for x, y in zip(a, b, strict=True))  # type: ignore[return-value]


def vdot(a: Sequence[float], w: Sequence[float]) -> float:
    return a[0] * w[0] + a[1] * w[1] + a[2] * w[2] + a[3] * w[3] + a[4] * w[4] + a[5] * w[5]


@dataclass(frozen=True, slots=True)
class Kernel:
    """One launched kernel (a fusion group), costs for the whole unsharded microbatch.

    ``kind`` is ``"matmul"``, ``"attention"``, ``"vector"`` or ``"free"`` (views only).
    ``dims`` are the GEMM's (M, N, K) and ``shard_dim`` the one tensor parallelism divides (-1: none).
    ``attn`` is (batch * heads, query length, key length, head dim) for attention kernels.
    ``tn`` marks a GEMM whose left operand is a transposed view (a weight gradient, ``grad.T @ x``).
    ``bytes`` is the element/byte vector of the tensors crossing the kernel's boundary.
    ``vec_split`` is ``vec_flops`` by vector family (``VECTOR_FAMILIES`` order; empty: all
    elementwise), ``fresh`` the vector of each tensor the kernel writes to newly allocated storage
    (not in place, not a view), which a host allocator may hand over unmapped. ``dtype`` is the
    precision of an overridden kernel (its anchor's, or all its ops'); "" runs in the training dtype.
    """

    phase: Phase
    kind: str
    shard: int
    mm_flops: float
    vec_flops: float
    bytes: Vec
    dims: tuple[int, int, int] = (0, 0, 0)
    shard_dim: int = -1
    attn: tuple[int, int, int, int] = (0, 0, 0, 0)
    ops: tuple[int, ...] = ()
    attn_core: bool = False
    vec_split: tuple[float, ...] = ()
    fresh: tuple[Vec, ...] = ()
    dtype: str = ""  # the precision it runs in when overridden ("": the training dtype)
    dropout: float = 0.0  # attention kernels: dropout probability on the attention probabilities
    share: float = CAUSAL_FRACTION  # attention kernels: the share of counted FLOPs its mask computes
    # attention kernels: the share of their work in calls whose tiles a causal mask makes unequal,
    # which the occupancy derating (``attention_parallel_half``) was fitted on; under context
    # parallelism a causal rank runs 1/c of its work as the diagonal step and the rest as full
    # blocks (``coplan.cost.kernels``)
    diagonal: float = 1.0
    tn: bool = False
    # generated kernels with a reduction too wide for registers: what their later loops load again
    # (``looped.loop_reads``; paid where ``Rates.looped_reductions``)
    loop_reads: Vec = ZERO
    # a GEMM carrying other ops of its group (an epilogue or prologue) in generated code: a GEMM
    # template, not the library's call, which takes none (``Rates.mm_template``)
    template: bool = False
    # an eager copy of a 16-bit tensor to fp32 (``x.float()``): ATen's dynamically casting loop
    # (``Rates.upcast``)
    upcast: bool = False


@dataclass(frozen=True, slots=True)
class QuantGemm:
    """One forward GEMM of a block, as Transformer Engine quantises its operands for fp8.

    Sizes are unsharded elements (the whole microbatch). GEMMs that read one input (separate Q, K
    and V, SwiGLU's gate and up) are one TE module in Megatron-Core and share ``input_key``.
    """

    input_key: int  # storage id of the activation input
    input_elems: float  # M x K
    output_elems: float  # M x N
    weight_elems: float  # K x N
    row_parallel: bool  # the input is tensor-parallel sharded (projection, FC2): output reduced
    from_norm: bool  # the input is a norm's output, which TE writes in fp8 itself (LayerNormLinear)
    dtype: str  # the GEMM kernel's overridden precision ("": the training dtype)


@dataclass(frozen=True, slots=True)
class Part:
    """A template block or one end of the model (embedding side ``pre``, loss side ``post``)."""

    name: str
    blocks: tuple[int, ...]
    forward: tuple[Kernel, ...]
    backward: tuple[Kernel, ...]
    optimizer: tuple[Kernel, ...]
    params: tuple[float, float]  # (replicated, tensor-parallel) parameter counts
    saved: dict[str, Vec]  # recompute mode -> saved element vector ("none", "selective", "full")
    transient: tuple[Vec, ...]  # live non-saved temporaries at each op of the part's fwd + bwd
    # the same where the compiler scheduled the whole step (``TrainingConfig.kernel_local_buffers``),
    # computed the first time a configuration asks (``scheduled_transient``); None: as ``transient``
    transient_scheduled: Callable[[], tuple[Vec, ...]] | None = field(default=None, compare=False, repr=False)
    # the same where only the casts of fp32 loss-path outputs are fused into the kernels computing
    # them (``TrainingConfig.fused_output_casts``); None: as ``transient``
    transient_cast: Callable[[], tuple[Vec, ...]] | None = field(default=None, compare=False, repr=False)
    tp_exits: tuple[float, ...] = ()  # elements of tensors leaving a sharded region (forward)
    tp_entries: tuple[float, ...] = ()  # elements of tensors entering a sharded region (forward)
    # their storages' tensor ids, in the same order (which a recompute set may drop and re-gather)
    tp_entry_ids: tuple[int, ...] = ()
    boundary: float = 0.0  # elements of the activation passed to the next pipeline stage
    scores: float = 0.0  # batch * heads * q * k elements of non-flash attention scores
    scores_dropout: float = 0.0  # of those, the elements of attention with dropout on the probabilities
    flash_saved: Vec = ZERO  # kept only for the fused attention's backward (its output, logsumexp)
    fp8_saved: Vec = ZERO  # change of the saved vector when the block's GEMMs run in fp8 (``fp8.py``)
    fp8_gemms: tuple[QuantGemm, ...] = ()  # the block's linear layers, as fp8 quantises them (``fp8.py``)
    model_flops: float = 0.0  # matrix FLOPs of forward + backward, attention causal (what MFU counts)
    op_ids: tuple[int, ...] = ()
    saved_items: tuple[tuple[int, str, Vec], ...] = ()  # (tensor id, name, vector) kept with no recompute
    # saved tensors of generated kernels: (name, producer op, forward readers, vector written);
    # recomputing one whose kernel holds every forward reader drops its write (``remat.unwritten_items``)
    unwritten: tuple[tuple[str, int, tuple[int, ...], Vec], ...] = ()
    # the head under Megatron's loss kernels (``loss.py``): (loss fusion, forward kernels, backward
    # kernels, change of the saved vector, transient points), replacing ``forward``/``backward``/
    # ``transient`` when priced
    loss_variants: tuple[tuple[str, tuple[Kernel, ...], tuple[Kernel, ...], Vec, tuple[Vec, ...]], ...] = ()
    # the block's (forward, backward) kernels with its MLP activation run eagerly (``activation.py``;
    # ``()``: the same as ``forward``/``backward``)
    eager_activation: tuple[tuple[Kernel, ...], tuple[Kernel, ...]] | tuple[()] = ()
    # parameter tensors the part reads, and the modules owning them (ZeRO-3's collectives per
    # tensor or per module, ``TrainingConfig.zero3_gather``)
    param_tensors: int = 0
    param_modules: int = 0
    # (replicated, tensor-parallel) parameter elements of each module owning parameters, in the
    # order the forward first reads them (DeepSpeed's reuse distance, ``zero.recompute_regathered``)
    param_module_sizes: tuple[tuple[float, float], ...] = ()
    cache: dict[object, object] = field(default_factory=dict, compare=False, repr=False)

    def memo(self, key: object, make: Callable[[], T]) -> T:
        """``make()``, computed once for this part and kept in ``cache`` under ``key``: what a
        block's graph alone decides, which the thousands of estimates of a search share."""
        if key not in self.cache:
            self.cache[key] = make()
        return cast("T", self.cache[key])

    def scheduled_transient(self) -> tuple[Vec, ...]:
        """``transient`` where the compiler scheduled the whole step, memoised on the part."""
        return self._transient_variant("transient_scheduled", self.transient_scheduled)

    def cast_transient(self) -> tuple[Vec, ...]:
        """``transient`` with the fp32 loss-path outputs written already cast, memoised."""
        return self._transient_variant("transient_cast", self.transient_cast)

    def _transient_variant(self, key: str, make: Callable[[], tuple[Vec, ...]] | None) -> tuple[Vec, ...]:
        """The transient points ``make`` computes the first time they are asked for (kept in
        ``cache`` under ``key``), or ``transient`` where the part has no such variant."""
        if make is None:
            return self.transient
        return self.memo(key, make)


def part_dtype(part: Part, dtype: str) -> str:
    """The precision ``part``'s kernels run in under training dtype ``dtype``: fp8 recipes keep
    the embedding and LM head in 16 bits (Transformer Engine quantises only the blocks' GEMMs)."""
    return dtype if part.blocks or dtype != "fp8" else "bf16"


#: The eager head's one loss variant (``Part.loss_variants``): a fused cross-entropy kernel each
#: way where eager PyTorch calls one (``TrainingConfig.eager_loss_cast`` "fused": flash-attn's
#: ``CrossEntropyLoss``, llm-foundry's default), with the memory of the ``loss.py`` kernels that
#: work as it does, Inductor's: the 16-bit logits kept for backward and a new 16-bit gradient
#: written there (Dao-AILab/flash-attention flash_attn/ops/triton/cross_entropy.py
#: ``CrossEntropyLoss`` at v2.4.2, llm-foundry's pin: ``ctx.save_for_backward(logits, lse,
#: labels)``, backward ``torch.empty_like(logits)`` unless ``inplace_backward``, off by default),
#: where the IR's log-softmax and loss keep fp32 log-probabilities and hold two fp32 logit-sized
#: gradients. Its time stays the IR's loss kernels' (``run_kernels``): the kernel's forward holds a
#: whole row of up to 64K columns in one Triton program, whose rate is not measured, and priced at
#: one read forward and a read and a write backward at the memory rate, llm-foundry's own MPT-125M
#: rows (the loss a large share of their steps) move 1-12 points faster, to as much as 23% fast
#: (``docs/stacks.md``).
FUSED_LOSS, FUSED_LOSS_AS = "fused", "inductor"


def loss_variant(part: Part, loss_fusion: str, loss_cast: str) -> str:
    """The loss variant whose memory a configuration holds for ``part``: the eager head's fused
    cross-entropy where the configuration's eager loss cast is that and ``part`` carries it, else
    Megatron's kernels as ``loss_fusion`` selects them (``loss.py``; an eager head carries none)."""
    if loss_cast == FUSED_LOSS and any(v[0] == FUSED_LOSS for v in part.loss_variants):
        return FUSED_LOSS
    return loss_fusion


def run_kernels(
    part: Part, loss_fusion: str, activation_fusion: bool
) -> tuple[tuple[Kernel, ...], tuple[Kernel, ...]]:
    """The (forward, backward) kernels a configuration runs for ``part``: Megatron's loss kernels
    where ``loss_fusion`` selects them (``loss.py``; the eager head's ``FUSED_LOSS`` variant is
    priced on the IR's kernels), the MLP activation op by op where it is not fused
    (``activation.py``), else the part's own."""
    fwd, bwd = part.forward, part.backward
    for name, f, b, _, _ in part.loss_variants:
        if name == loss_fusion:
            fwd, bwd = f, b
    if not activation_fusion and part.eager_activation:
        fwd, bwd = part.eager_activation
    return fwd, bwd


@dataclass(frozen=True, slots=True)
class GraphProfile:
    """What the cost model needs of a graph, per template block and model end."""

    graph: Graph
    fusion: str | tuple[tuple[int, ...], ...]
    templates: tuple[Part, ...]
    pre: Part
    post: Part
    n_layers: int
    batch: int
    seq: int
    vocab: int
    hidden: int
    heads: int
    model_flops: float  # forward + backward matrix FLOPs of one microbatch, whole model (``Part``)
    # parameter elements (replicated, TP-sharded) both ``pre`` and ``post`` read: a tied embedding,
    # counted once where one pipeline stage holds both ends (each end's stage keeps its own copy
    # otherwise, as Megatron-LM keeps the word embeddings on the first and last stage)
    shared_params: tuple[float, float] = (0.0, 0.0)
    # of those, the parameter tensors and the modules owning them
    shared_tensors: tuple[int, int] = (0, 0)

    def template_of(self, block: int) -> Part:
        for t in self.templates:
            if block in t.blocks:
                return t
        raise KeyError(block)

    @property
    def layer_templates(self) -> tuple[Part, ...]:
        """The template of each layer, in order."""
        order = sorted((b, t) for t in self.templates for b in t.blocks)
        return tuple(t for _, t in order)


#: A precision assignment: the training dtype and (op id, dtype) overrides (``TrainingConfig``).
Precision = tuple[str, tuple[tuple[int, str], ...]]
