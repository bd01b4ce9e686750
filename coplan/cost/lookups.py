"""Per-graph lookups of the graph digest (``coplan.cost.profile``): shard and precision classes.

Every tensor of a graph is priced by *shard class* (tensor-parallel ops' work divides by the TP
degree, replicated ops' only under sequence parallelism) and *precision class* (activations, fp32
values, fixed-width integers). Under a precision assignment (per-op dtypes, ``Precision``) some ops
run in another dtype: their outputs are stored in it, and a library kernel (GEMM, attention) that
needs an input in another dtype than its storage reads a cast copy, cast in the producer's
generated kernel, in its own, or by a kernel of its own. ``GraphLookups`` answers these questions
once per graph; ``profile._Ctx`` builds the kernels and parts on top of it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from coplan.cost.fusion import readers, source_op
from coplan.cost.liveness import is_temp
from coplan.cost.parts import ACT, F32, FIX, NV, REPL, TP, ZERO, Kernel, Precision, Vec, vadd
from coplan.hardware.device import VECTOR_FAMILIES
from coplan.ir.types import Graph, Op, OpKind, Phase, Tensor, TensorRole

#: Submodules of a block whose ops Megatron-style tensor parallelism shards.
_TP_MODULE = re.compile(
    r"(attn|attention|mlp|ffn|feed_forward|moe|expert|router|gate_proj|up_proj|down_proj)"
)
_FLOAT = frozenset({"float32", "float16", "bfloat16", "tf32", "float64", "float8_e4m3fn", "float8_e5m2"})
#: Bytes per element of each dtype an op may be given.
_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
#: The storage dtype of activations under each training dtype (fp8 recipes keep them in 16 bits).
_ACT_DTYPE = {"fp32": "fp32", "tf32": "fp32", "bf16": "bf16", "fp16": "fp16", "fp8": "bf16"}


class GraphLookups:
    """Per-graph lookups shared by all parts: the shard and precision class of each tensor, the
    dtype each op runs in under a precision assignment, and the casts that assignment needs."""

    def __init__(
        self,
        graph: Graph,
        precision: Precision | None = None,
        group_of: dict[int, tuple[int, ...]] | None = None,
    ) -> None:
        self.g = graph
        loss = next((op for op in graph.ops if op.kind is OpKind.LOSS and op.phase is Phase.FORWARD), None)
        shape = graph.tensors[loss.inputs[0]].shape if loss is not None else ()
        self.vocab = int(shape[-1]) if shape else 0
        self.tokens = max(1, graph.meta.batch * graph.meta.seq)
        container = graph.meta.block_container
        self.prefix = f"{container}." if container else ""
        emb = next((op for op in graph.ops if op.kind is OpKind.EMBEDDING), None)
        self.hidden = int(graph.tensors[emb.outputs[0]].shape[-1]) if emb is not None else 0
        self._shard: dict[int, int] = {}
        self._f32_ops: set[int] = set()
        for op in graph.ops:
            self._shard[op.id] = self._op_shard(op)
        for op in graph.ops:
            if (
                op.block is None
                and op.kind not in (OpKind.MATMUL, OpKind.EMBEDDING, OpKind.VIEW)
                and self._touches_vocab(op)
            ):
                self._f32_ops.add(op.id)  # Megatron computes the vocab-parallel loss on fp32 logits
        self.group_of = group_of or {}
        self.megatron_loss = False
        self.fused_loss = False  # the eager head's fused cross-entropy variant (``parts.FUSED_LOSS``)
        self.eager = False
        # Megatron's fused kernels recompute their intermediates in backward (``_fused_recomputed``)
        self.fused_backward = False
        self.compiled = False
        self.duplicated: frozenset[int] = frozenset()
        self._dtype: dict[int, str] = {}  # op id -> overridden dtype (backward ops follow forward)
        self._act = "fp32"
        self._casts: dict[tuple[int, str], tuple[int, bool]] = {}  # (tensor, dtype) -> (consumer, fused)
        self._extra_write: dict[tuple[int, ...], list[float]] = {}  # group -> cast copies written
        if precision is not None:
            compute, overrides = precision
            self._act = _ACT_DTYPE[compute]
            over = dict(overrides)
            for op in graph.ops:
                d = over.get(op.id)
                if d is None and op.forward_op is not None:
                    d = over.get(op.forward_op)
                if d == "fp32" and op.id in self._f32_ops:
                    continue  # the loss path on the vocabulary runs in fp32 already
                if d is not None and op.phase is not Phase.OPTIMIZER:
                    self._dtype[op.id] = d
            self._place_casts()

    # --- classification ------------------------------------------------------------------------

    def _touches_vocab(self, op: Op) -> bool:
        if not self.vocab:
            return False
        ts = self.g.tensors
        return any(self.vocab in ts[t].shape for t in (*op.inputs, *op.outputs))

    def _op_shard(self, op: Op) -> int:
        if op.block is None:
            return TP if self._touches_vocab(op) else REPL
        path = op.module_path
        if self.prefix and path.startswith(self.prefix):
            rest = path[len(self.prefix) :].split(".", 1)
            path = rest[1] if len(rest) > 1 else ""
        first = path.split(".", 1)[0]
        return TP if first and _TP_MODULE.search(first) else REPL

    def tensor_shard(self, t: Tensor) -> int:
        if t.producer is not None:
            return self._shard[t.producer]
        # graph inputs: parameters and optimizer state follow the ops that read them
        for c in t.consumers:
            op = self.g.ops[c]
            if op.kind is not OpKind.VIEW:
                return self._shard[c]
        return REPL

    def tensor_class(self, t: Tensor) -> int:
        if t.dtype not in _FLOAT:
            return FIX
        if t.role in (TensorRole.OPTIMIZER_STATE, TensorRole.OPTIMIZER_TEMP) or t.grad_of is not None:
            return F32
        if t.producer is not None and t.producer in self._f32_ops:
            return F32
        if t.producer is not None:
            prod = self.g.ops[t.producer]
            # a fused attention kernel's logsumexp is fp32 whatever the training dtype (the flash
            # kernels of PyTorch, FlashAttention and cuDNN all write it in fp32)
            if prod.kind is OpKind.ATTENTION and len(prod.outputs) > 1 and t.id == prod.outputs[1]:
                return F32
        return ACT

    def vec(self, t: Tensor) -> Vec:
        sh = self.tensor_shard(t)
        out = [0.0] * NV
        stored = self._stored_override(t)
        if stored is not None:
            # an overridden op's output: its own width whatever the training dtype
            out[FIX * 2 + sh] = float(t.numel * _DTYPE_BYTES[stored])
            return tuple(out)  # type: ignore[return-value]
        cls = self.tensor_class(t)
        out[cls * 2 + sh] = float(t.nbytes if cls == FIX else t.numel)
        return tuple(out)  # type: ignore[return-value]

    def _act_vec(self, t: Tensor) -> Vec:
        """``t`` stored in the training dtype's activation width, whatever its own class."""
        out = [0.0] * NV
        out[ACT * 2 + self.tensor_shard(t)] = float(t.numel)
        return tuple(out)  # type: ignore[return-value]

    def as_dtype(self, t: Tensor, dtype: str) -> Vec:
        """The element/byte vector of ``t`` stored as ``dtype``."""
        out = [0.0] * NV
        out[FIX * 2 + self.tensor_shard(t)] = float(t.numel * _DTYPE_BYTES[dtype])
        return tuple(out)  # type: ignore[return-value]

    # --- precision -----------------------------------------------------------------------------

    def _is_value(self, t: Tensor) -> bool:
        """An activation or activation gradient in floating point (what casts apply to)."""
        return t.dtype in _FLOAT and is_temp(t)

    def _stored_override(self, t: Tensor) -> str | None:
        """The dtype ``t`` is stored in when its producer is overridden (None: the default class)."""
        if not self._dtype:
            return None
        base = self.g.tensors[t.storage_id]
        p = base.producer
        d = self._dtype.get(p) if p is not None else None
        if d is None or not self._is_value(base):
            return None
        if d == "fp8":
            return None  # an fp8 GEMM writes its output in the activation dtype
        return d

    def stored_dtype(self, t: Tensor) -> str:
        """The dtype ``t`` is stored in under this precision assignment."""
        d = self._stored_override(t)
        if d is not None:
            return d
        return "fp32" if self.tensor_class(t) == F32 else self._act

    def needed_dtype(self, op: Op) -> str:
        """The dtype a library kernel (GEMM, attention) reads its activation inputs in."""
        d = self._dtype.get(op.id)
        if d is None:
            return self._act
        if d == "fp8" and op.kind is not OpKind.MATMUL:
            return "bf16"
        return d

    def op_dtype(self, op: Op) -> str:
        """The dtype an op runs in ("" for the training dtype)."""
        return self._dtype.get(op.id, "")

    def _generated(self, grp: tuple[int, ...]) -> bool:
        """Whether a kernel is generated code that can absorb a cast: a fused group of several
        real ops (an eager op is a fixed library kernel, and so is a lone GEMM)."""
        return sum(1 for i in grp if self.g.ops[i].kind is not OpKind.VIEW) >= 2

    def _place_casts(self) -> None:
        """Every (tensor, dtype) a library kernel needs that its storage is not in, and where the
        cast runs: in the producer's generated kernel (an extra write), in the consumer's own
        generated kernel (free), or as a kernel of its own."""
        g = self.g
        for op in g.ops:
            if op.phase is Phase.OPTIMIZER:
                continue
            # the loss on the vocabulary reads fp32 unless overridden: autocast casts a 16-bit
            # log-softmax output for ``nll_loss`` (on its fp32 list), and autograd keeps that copy,
            # ``nll_loss``'s input, for its backward (``saved_copy``); the cast's time is the eager
            # kernels' (``eager.py``, ``log_softmax:autocast``), so it is placed as absorbed
            loss = op.kind is OpKind.LOSS and op.phase is Phase.FORWARD and op.id in self._f32_ops
            if op.kind not in (OpKind.MATMUL, OpKind.ATTENTION) and not loss:
                continue
            need = self._dtype.get(op.id, "fp32") if loss else self.needed_dtype(op)
            for tid in op.inputs:
                t = g.tensors[tid]
                base = g.tensors[t.storage_id]
                if not self._is_value(base) or self.stored_dtype(base) == need:
                    continue
                key = (base.id, need)
                if key in self._casts:
                    continue
                src = source_op(g, tid)
                if op.id not in self._dtype and (src is None or src not in self._dtype):
                    # the default precision's own conversions (fp32 loss gradients into the LM
                    # head's GEMM) are part of the stack's fused kernels, priced without overrides too
                    continue
                if loss:
                    self._casts[key] = (op.id, True)
                    continue
                prod_grp = self.group_of.get(src, (src,)) if src is not None else ()
                own = self.group_of.get(op.id, (op.id,))
                if src is not None and g.ops[src].phase is op.phase and self._generated(prod_grp):
                    acc = self._extra_write.setdefault(tuple(prod_grp), [0.0] * NV)
                    for i, x in enumerate(self.as_dtype(base, need)):
                        acc[i] += x
                    self._casts[key] = (op.id, True)
                else:
                    self._casts[key] = (op.id, self._generated(own))

    def saved_copy(self, t: Tensor) -> Vec:
        """What keeping ``t`` for backward stores: a library kernel that read a cast copy keeps
        that copy (autocast's linear saves its 16-bit input, not the fp32 norm output); other
        backward readers keep ``t`` itself."""
        g = self.g
        needs: set[str] = set()
        total: Vec = ZERO
        for (tid, need), (consumer, _) in self._casts.items():
            if tid != t.id:
                continue
            if g.ops[consumer].kind is OpKind.LOSS:
                # the loss's cast input, which autograd keeps for ``nll_loss_backward(grad, self)``
                total = vadd(total, self.as_dtype(t, need))
            else:
                needs.add(need)
        if not needs and total == ZERO:
            return self.vec(t)
        plain = False
        for c in readers(g, t.id):
            op = g.ops[c]
            if op.phase is not Phase.BACKWARD:
                continue
            need = self.needed_dtype(op) if op.kind in (OpKind.MATMUL, OpKind.ATTENTION) else ""
            if need in needs:
                needs.discard(need)
                total = vadd(total, self.as_dtype(t, need))
            elif not need or need == self.stored_dtype(t):
                plain = True
        return vadd(total, self.vec(t)) if plain else total

    def _loss_copies(self, ops: Sequence[Op]) -> dict[int, Vec]:
        """The loss's cast inputs kept for its backward (``saved_copy``), by the backward op of the
        loss that releases them: autograd frees ``nll_loss``'s saved input when its node is done,
        before the log-softmax's backward, whose saved output the saved vector holds to the end."""
        out: dict[int, Vec] = {}
        if not self._casts:
            return out
        for (tid, need), (consumer, _) in self._casts.items():
            if self.g.ops[consumer].kind is not OpKind.LOSS:
                continue
            for op in ops:
                if op.phase is Phase.BACKWARD and op.kind is OpKind.LOSS and op.forward_op == consumer:
                    out[op.id] = vadd(out.get(op.id, ZERO), self.as_dtype(self.g.tensors[tid], need))
        return out

    def cast_kernels(self, ops: Sequence[Op]) -> list[Kernel]:
        """Stand-alone cast kernels needed by ``ops`` (one per tensor and dtype)."""
        out = []
        ids = {op.id for op in ops}
        for (tid, need), (consumer, fused) in self._casts.items():
            if fused or consumer not in ids:
                continue
            t = self.g.tensors[tid]
            op = self.g.ops[consumer]
            # read, convert, write; fp8 also finds the tensor's absolute maximum for its scale
            flops = float(t.numel * (3 if need == "fp8" else 1))
            out.append(
                Kernel(
                    op.phase,
                    "vector",
                    self.tensor_shard(t),
                    0.0,
                    flops,
                    vadd(self.vec(t), self.as_dtype(t, need)),
                    vec_split=(flops,) + (0.0,) * (len(VECTOR_FAMILIES) - 1),
                    fresh=(self.as_dtype(t, need),),
                    dtype=need,
                )
            )
        return out
