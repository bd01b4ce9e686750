"""A graph digested once for the cost model: kernels, saved sets and liveness per block template.

Estimating a configuration must take milliseconds (a search prices thousands), so everything that
depends only on the graph and the fusion groups is computed here, once: the graph's blocks are
grouped into templates (blocks with the same ops and shapes), and each template's kernels carry
their costs split by *precision class* (activations, fp32 values, fixed-width integers) and by
*shard class* (tensor-parallel ops whose work divides by the TP degree, replicated ops whose work
divides only under sequence parallelism). ``estimate`` then prices a configuration with a few
dot products per kernel.

Tensor-parallel layout (Megatron-LM's): inside a block, ops of the attention and MLP submodules are
sharded (column-parallel in, row-parallel out); norms and residual adds are replicated. Outside
blocks, the ops that touch the vocabulary dimension (word embedding, LM head, loss) are
vocabulary-parallel. Collectives sit on the boundaries between the two classes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import partial

from coplan.cost.activation import eager_variant, extra_passes
from coplan.cost.boundaries import pipeline_boundary, tp_boundaries
from coplan.cost.families import vector_family
from coplan.cost.fp8 import fp8_saved_delta, quant_gemms
from coplan.cost.fusion import default_groups, fused_recomputed, readers
from coplan.cost.geometry import attn_geometry, mm_dims, transposed_lhs
from coplan.cost.liveness import fused_temporaries, liveness
from coplan.cost.lookups import GraphLookups
from coplan.cost.looped import loop_reads
from coplan.cost.loss import LOSS_FUSIONS, loss_ops, megatron_loss
from coplan.cost.parts import (
    CAUSAL_FRACTION,
    FUSED_LOSS,
    FUSED_LOSS_AS,
    NV,
    REPL,
    ZERO,
    GraphProfile,
    Kernel,
    Part,
    Precision,
    Vec,
    attention_share,
    model_flops,
    vadd,
)
from coplan.cost.remat import unwritten_items
from coplan.hardware.device import VECTOR_FAMILIES
from coplan.ir.oprules import attention_causal, attention_cp, attention_dropout
from coplan.ir.types import Graph, Op, OpKind, Phase, Tensor, TensorRole


def profile_graph(
    graph: Graph,
    fusion: str | tuple[tuple[int, ...], ...] = "megatron",
    precision: Precision | None = None,
) -> GraphProfile:
    """Digest ``graph`` under the fusion groups ``fusion`` (a mode of ``default_groups`` or groups)
    and, when ``precision`` has per-op overrides, the dtypes and casts they imply."""
    groups = default_groups(graph, fusion) if isinstance(fusion, str) else fusion
    group_of: dict[int, tuple[int, ...]] = {}
    copies: dict[int, int] = {}
    for g in groups:
        for i in g:
            # an op in several groups is a duplicated producer (``FusionPlan.duplicated``): its
            # first group, its home, writes what it must keep; the others compute a copy
            group_of.setdefault(i, tuple(g))
            copies[i] = copies.get(i, 0) + 1
    ctx = _Ctx(graph, precision if precision and precision[1] else None, group_of)
    ctx.duplicated = frozenset(i for i, n in copies.items() if n > 1)
    # Megatron's own loss kernels replace the IR's where the stack is Megatron's and no per-op
    # override takes the loss path below fp32 (Megatron computes it on fp32 logits; an fp32
    # override, autocast's choice for softmax and the loss, is what its kernels do anyway)
    loss32 = all(ctx._dtype.get(i, "fp32") == "fp32" for i in ctx._f32_ops)
    ctx.megatron_loss = fusion == "megatron" and loss32
    # eager PyTorch's head may instead call a fused cross-entropy kernel (``parts.FUSED_LOSS``)
    ctx.fused_loss = fusion == "none" and loss32
    ctx.fused_backward = fusion == "megatron"
    # eager PyTorch (fusion "none") runs some IR ops as several kernels (``activation.py``)
    ctx.eager = fusion == "none"
    # explicit groups are generated code (Inductor): a kernel writes a tensor only where something
    # reads it outside the kernel, so one kept only for backward goes unwritten once recomputed
    ctx.compiled = not isinstance(fusion, str)
    by_block: dict[int | None, list[Op]] = {}
    for op in graph.ops:
        by_block.setdefault(op.block, []).append(op)
    blocks = sorted(b for b in by_block if b is not None)
    templates: dict[tuple[object, ...], list[int]] = {}
    for b in blocks:
        templates.setdefault(_signature(graph, by_block[b]), []).append(b)
    parts = []
    for members in templates.values():
        ops = by_block[members[0]]
        parts.append(ctx.part(f"block[{members[0]}]", tuple(members), ops, group_of))
    head = by_block.get(None, [])
    pre_ops, post_ops = ctx.split_head(head, by_block, blocks)
    pre = ctx.part("embedding", (), pre_ops, group_of)
    post = ctx.part("head", (), post_ops, group_of)
    attn = next((op for op in graph.ops if op.kind is OpKind.ATTENTION and op.phase is Phase.FORWARD), None)
    heads = (
        graph.tensors[attn.inputs[0]].shape[1]
        if attn is not None and graph.tensors[attn.inputs[0]].shape
        else 1
    )
    # a tied embedding: the output projection reads the embedding's own tensor, which a stage
    # holding both ends keeps once (``GraphProfile.shared_params``)
    ends = ctx.param_shards(pre_ops), ctx.param_shards(post_ops)
    shared = [0.0, 0.0]
    both = ends[0].keys() & ends[1].keys()
    for tid in both:
        shared[ends[0][tid]] += graph.tensors[tid].numel
    shared_modules = {_module_of(graph, tid) for tid in both}
    per_layer = {b: t for t in parts for b in t.blocks}
    flops = pre.model_flops + post.model_flops + sum(per_layer[b].model_flops for b in blocks)
    return GraphProfile(
        graph=graph,
        fusion=fusion,
        templates=tuple(parts),
        pre=pre,
        post=post,
        n_layers=len(blocks),
        batch=graph.meta.batch,
        seq=graph.meta.seq,
        vocab=ctx.vocab,
        hidden=ctx.hidden,
        heads=int(heads),
        model_flops=float(flops),
        shared_params=(shared[0], shared[1]),
        shared_tensors=(len(both), len(shared_modules)),
    )


def tensor_vec(graph: Graph) -> Callable[[Tensor], Vec]:
    """The element/byte vector of each tensor of ``graph`` as a step stores it, under the
    training dtype (what ``liveness`` counts): ``vdot`` with ``Scale.weights`` gives its bytes."""
    return _Ctx(graph).vec


def _module_of(graph: Graph, tid: int) -> str:
    """The module owning parameter ``tid``: its attribute path less the attribute
    ("h.0.attn.c_attn"), or the tensor itself where the graph names no path."""
    return graph.tensors[tid].param_name.rpartition(".")[0] or str(tid)


def _signature(graph: Graph, ops: Sequence[Op]) -> tuple[object, ...]:
    return tuple((op.target, op.phase, tuple(graph.tensors[t].shape for t in op.outputs)) for op in ops)


class _Ctx(GraphLookups):
    """Per-graph lookups shared by all parts, and the kernels, parts and saved sets built on them."""

    # --- head split ----------------------------------------------------------------------------

    def param_shards(self, ops: Sequence[Op]) -> dict[int, int]:
        """The parameters ``ops``' forward reads (storage ids), each with the shard class of the
        first op reading it."""
        g = self.g
        out: dict[int, int] = {}
        for op in ops:
            if op.phase is not Phase.FORWARD:
                continue
            for tid in op.inputs:
                t = g.tensors[g.tensors[tid].storage_id]
                if t.role is TensorRole.PARAMETER and t.producer is None and t.id not in out:
                    out[t.id] = self._shard[op.id]
        return out

    def split_head(
        self, head: Sequence[Op], by_block: dict[int | None, list[Op]], blocks: Sequence[int]
    ) -> tuple[list[Op], list[Op]]:
        if not blocks:
            return list(head), []
        block_ops = [op for b in blocks for op in by_block[b]]
        first_fwd = min(op.id for op in block_ops if op.phase is Phase.FORWARD)
        last_bwd = max((op.id for op in block_ops if op.phase is Phase.BACKWARD), default=len(self.g.ops))
        pre_modules: set[str] = set()
        pre: list[Op] = []
        post: list[Op] = []
        for op in head:
            if op.phase is Phase.FORWARD:
                is_pre = op.id < first_fwd
            elif op.phase is Phase.BACKWARD:
                # a backward op follows its forward op; unlinked ones (gradient accumulation of the
                # embedding) sit after the last block's backward on the embedding side
                is_pre = op.forward_op < first_fwd if op.forward_op is not None else op.id > last_bwd
            else:
                is_pre = op.module_path in pre_modules
            if is_pre and op.module_path:
                pre_modules.add(op.module_path)
            (pre if is_pre else post).append(op)
        return pre, post

    # --- parts ---------------------------------------------------------------------------------

    def part(
        self, name: str, blocks: tuple[int, ...], ops: Sequence[Op], group_of: dict[int, tuple[int, ...]]
    ) -> Part:
        g = self.g
        ids = {op.id for op in ops}
        fwd: list[Kernel] = []
        bwd: list[Kernel] = []
        opt: list[Kernel] = []
        done: set[tuple[int, ...]] = set()
        for op in ops:
            grp = tuple(i for i in group_of.get(op.id, (op.id,)) if i in ids)
            if grp in done:
                continue
            done.add(grp)
            k = self.kernel(grp)
            into = {Phase.FORWARD: fwd, Phase.BACKWARD: bwd, Phase.OPTIMIZER: opt}[k.phase]
            into.append(k)
            if self.eager and len(grp) == 1:
                into.extend(extra_passes(g, g.ops[grp[0]], self.vec, self._shard[grp[0]]))
        for k in self.cast_kernels(ops):
            (fwd if k.phase is Phase.FORWARD else bwd).append(k)
        variants: tuple[tuple[str, tuple[Kernel, ...], tuple[Kernel, ...], Vec, tuple[Vec, ...]], ...] = ()
        if self.megatron_loss and not blocks:
            variants = self.loss_variants(ops, ids, fwd, bwd, {impl: impl for impl in LOSS_FUSIONS})
        elif self.fused_loss and not blocks:
            variants = self.loss_variants(ops, ids, fwd, bwd, {FUSED_LOSS: FUSED_LOSS_AS})
        eager_act = (
            eager_variant(g, ops, fwd, bwd, self.kernel, self.vec, lambda op: self._shard[op.id])
            if blocks and not self.eager
            else ()
        )
        params = [0.0, 0.0]
        owned = self.param_shards(ops)
        for tid, shard in owned.items():
            params[shard] += g.tensors[tid].numel
        sizes: dict[str, list[float]] = {}  # per module, in the order the forward reads them
        for tid, shard in owned.items():
            sizes.setdefault(_module_of(g, tid), [0.0, 0.0])[shard] += g.tensors[tid].numel
        saved_none = self.saved_vec(ops, ids, mode="none")
        exits, entries, entry_ids = tp_boundaries(self.g, self._shard, ops)
        boundary = pipeline_boundary(self.g, ops, ids)
        scores = scores_dropout = 0.0
        for op in ops:
            if op.kind is OpKind.ATTENTION and op.phase is Phase.FORWARD:
                bh, sq, sk, _ = attn_geometry(self.g, op)
                scores += float(bh * sq * sk)
                if attention_dropout(op):
                    scores_dropout += float(bh * sq * sk)
        return Part(
            name=name,
            blocks=blocks,
            forward=tuple(fwd),
            backward=tuple(bwd),
            optimizer=tuple(opt),
            params=(params[0], params[1]),
            param_tensors=len(owned),
            param_modules=len(sizes),
            param_module_sizes=tuple((a, b) for a, b in sizes.values()),
            saved={
                "none": saved_none,
                "selective": self.saved_vec(ops, ids, mode="selective"),
                "full": self.saved_vec(ops, ids, mode="full") if blocks else saved_none,
            },
            transient=liveness(self.g, self.vec, self._act_vec, ops, ids, freed=self._loss_copies(ops)),
            transient_scheduled=(
                partial(self.scheduled_transient, tuple(ops), frozenset(ids), group_of)
                if self.compiled
                else None
            ),
            transient_cast=(
                partial(self.cast_transient, tuple(ops), frozenset(ids), group_of) if self.compiled else None
            ),
            tp_exits=exits,
            tp_entries=entries,
            tp_entry_ids=entry_ids,
            boundary=boundary,
            scores=scores,
            scores_dropout=scores_dropout,
            model_flops=model_flops(ops),
            op_ids=tuple(op.id for op in ops),
            saved_items=(items := self.saved_items(ops)),
            unwritten=unwritten_items(self.g, items, self.vec) if blocks and self.compiled else (),
            fp8_saved=fp8_saved_delta(self.g, items) if blocks else ZERO,
            fp8_gemms=quant_gemms(self.g, fwd, self.tensor_shard) if blocks else (),
            flash_saved=self.flash_saved(ops),
            loss_variants=variants,
            eager_activation=eager_act,
        )

    def scheduled_transient(
        self, ops: Sequence[Op], ids: set[int] | frozenset[int], group_of: dict[int, tuple[int, ...]]
    ) -> tuple[Vec, ...]:
        """The part's temporaries where a compiler scheduled the whole step under these explicit
        groups (``liveness.fused_temporaries``); a fusion mode's groups (a stack's own kernels, or
        ``compiled`` stacks priced by Inductor's rules over them) are not the kernels a scheduler
        made, and get none (``Part.transient_scheduled``)."""
        unwritten, narrowed = fused_temporaries(self.g, ops, group_of, self._f32_ops)
        return liveness(self.g, self.vec, self._act_vec, ops, ids, unwritten=unwritten, narrowed=narrowed)

    def cast_transient(
        self, ops: Sequence[Op], ids: set[int] | frozenset[int], group_of: dict[int, tuple[int, ...]]
    ) -> tuple[Vec, ...]:
        """The part's temporaries where the explicit groups' kernels write what they compute, but
        an fp32 loss-path output read only at the training dtype already cast (the narrowed
        storages of ``liveness.fused_temporaries`` alone: ``TrainingConfig.fused_output_casts``)."""
        _, narrowed = fused_temporaries(self.g, ops, group_of, self._f32_ops)
        return liveness(
            self.g, self.vec, self._act_vec, ops, ids, narrowed=narrowed, freed=self._loss_copies(ops)
        )

    def loss_variants(
        self,
        ops: Sequence[Op],
        ids: set[int],
        fwd: Sequence[Kernel],
        bwd: Sequence[Kernel],
        named: Mapping[str, str],
    ) -> tuple[tuple[str, tuple[Kernel, ...], tuple[Kernel, ...], Vec, tuple[Vec, ...]], ...]:
        """The part's kernels with its loss run as each of the cross-entropy kernels of ``loss.py``
        that ``named`` gives (variant name -> its implementation), and the part's temporaries then.
        Megatron's kernels work in place on the fp32 copy of the logits they keep (the softmax, then
        the gradient: ``loss.py``), so what they add to the rest of the head's temporaries is the
        16-bit logits before the copy and the 16-bit gradient after the cast back, which a walk over
        the head without the IR's loss ops counts (the logits until their last reader, the gradient
        as it enters the output layer's backward); the IR's own formulation instead holds fp32
        log-probabilities' gradients (two fp32 logit-sized tensors). Inductor's kernels, which a
        fused cross-entropy of eager PyTorch runs as (``parts.FUSED_LOSS``), keep the 16-bit logits
        and write a new 16-bit gradient: the same walk."""
        mine = loss_ops(self.g, ops, self._f32_ops)
        if not mine:
            return ()
        keep_f = tuple(k for k in fwd if not mine.intersection(k.ops))
        keep_b = tuple(k for k in bwd if not mine.intersection(k.ops))
        loss = [op for op in ops if op.id in mine]
        transient = liveness(self.g, self.vec, self._act_vec, ops, ids, skip=mine)
        # Transformer Engine's kernel writes the gradient into the logits buffer it keeps (counted
        # in the saved vector): the logits are not a temporary, and nothing new enters the output
        # layer's backward
        reads = [t for op in loss if op.phase is Phase.FORWARD for t in op.inputs]
        logits = max(reads, key=lambda t: self.g.tensors[t].numel, default=None)
        kept = frozenset() if logits is None else frozenset({self.g.tensors[logits].storage_id})
        in_place = liveness(
            self.g, self.vec, self._act_vec, ops, ids, skip=mine, skip_returns=False, kept=kept
        )
        out = []
        for name, impl in named.items():
            lf, lb, saved = megatron_loss(self.g, loss, impl)
            points = in_place if impl == "te" else transient
            out.append((name, keep_f + tuple(lf), tuple(lb) + keep_b, saved, points))
        return tuple(out)

    def flash_saved(self, ops: Sequence[Op]) -> Vec:
        """Storages a fused attention kernel keeps for its own backward only; an unfused attention
        keeps the softmax probabilities instead."""
        g = self.g
        total: Vec = ZERO
        for op in ops:
            if op.kind is not OpKind.ATTENTION or op.phase is not Phase.FORWARD:
                continue
            for tid in op.outputs:
                t = g.tensors[tid]
                if not t.saved_for_backward:
                    continue
                bwd = {c for c in readers(g, tid) if g.ops[c].phase is Phase.BACKWARD}
                if bwd and all(g.ops[c].kind is OpKind.ATTENTION for c in bwd):
                    total = vadd(total, self.vec(t))
        return total

    def saved_items(self, ops: Sequence[Op]) -> tuple[tuple[int, str, Vec], ...]:
        g = self.g
        ids = {op.id for op in ops}
        out: dict[int, tuple[int, str, Vec]] = {}
        for op in ops:
            if op.phase is not Phase.FORWARD:
                continue
            for tid in (*op.inputs, *op.outputs):
                t = g.tensors[tid]
                base = g.tensors[t.storage_id]
                if t.saved_for_backward and base.role is TensorRole.ACTIVATION and base.producer in ids:
                    out.setdefault(base.id, (base.id, base.name, self.saved_copy(base)))
        return tuple(out.values())

    def kernel(self, grp: tuple[int, ...]) -> Kernel:
        g = self.g
        ops = [g.ops[i] for i in grp]
        real = [op for op in ops if op.kind is not OpKind.VIEW]
        phase = ops[0].phase
        if not real or (phase is Phase.OPTIMIZER and self._scalar_only(real)):
            # views; and the step-counter math of a capturable optimizer (0-d tensors: bias
            # corrections), which the default eager optimizer does on host floats, launching nothing
            return Kernel(phase, "free", REPL, 0.0, 0.0, ZERO, ops=grp)
        inside = set(grp)
        produced = {t for op in real for t in op.outputs}
        recomputes = self.fused_backward
        b = list(self._extra_write.get(tuple(grp), [0.0] * NV))
        seen: set[int] = set()
        for op in real:
            need = (
                self.needed_dtype(op) if self._casts and op.kind in (OpKind.MATMUL, OpKind.ATTENTION) else ""
            )
            for tid in op.inputs:
                if tid in produced or tid in seen:
                    continue
                seen.add(tid)
                t = g.tensors[tid]
                base = g.tensors[t.storage_id]
                if recomputes and phase is Phase.BACKWARD and fused_recomputed(g, base):
                    # Megatron's fused backward kernel rebuilds it from its producer's kept inputs
                    assert base.producer is not None  # fused_recomputed holds only for produced ones
                    for pid in g.ops[base.producer].inputs:
                        if pid not in produced and pid not in seen:
                            seen.add(pid)
                            v = self.vec(g.tensors[pid])
                            for i in range(NV):
                                b[i] += v[i]
                    continue
                # a library kernel reads the cast copy when its input had to be converted
                v = self.as_dtype(t, need) if need and (base.id, need) in self._casts else self.vec(t)
                for i in range(NV):
                    b[i] += v[i]
        fresh: list[Vec] = []
        for tid in produced:
            t = g.tensors[tid]
            direct = set(t.consumers)
            if (
                recomputes
                and tid not in g.outputs
                and all(g.ops[c].phase is Phase.BACKWARD for c in direct - inside)
                and fused_recomputed(g, g.tensors[t.storage_id])
            ):
                continue  # read only by backward kernels, which recompute it: never written
            kept = t.saved_for_backward or tid in g.outputs
            producer = t.producer if t.producer is not None else -1
            if producer in self.duplicated:
                # every reader's kernel computes its own copy: only what is kept is written, once
                written = kept and self.group_of[producer] == tuple(grp)
            else:
                # a duplicated reader's copies sit in other kernels too, which read it from memory
                copied = bool(self.duplicated) and any(c in self.duplicated for c in direct)
                written = kept or not direct <= inside or not direct or copied
            if written:
                v = self.vec(t)
                for i in range(NV):
                    b[i] += v[i]
                if t.alias_of is None and t.shape:
                    fresh.append(v)
        bv: Vec = (b[0], b[1], b[2], b[3], b[4], b[5])
        split = self.vec_split(real)
        mm = next((op for op in real if op.kind is OpKind.MATMUL), None)
        at = next((op for op in real if op.kind is OpKind.ATTENTION), None)
        anchor = at or mm
        if anchor is not None:
            dtype = self.op_dtype(anchor)
        else:
            dts = {self.op_dtype(op) for op in real}
            dtype = dts.pop() if len(dts) == 1 else ""
        shard = self._shard[(anchor or real[0]).id]
        # one launched kernel: an attention or GEMM kernel (a generated template where a GEMM
        # carries other ops), or generated vector code; only the anchor's geometry differs
        attn, dims, sdim = (0, 0, 0, 0), (0, 0, 0), -1
        drop, tn, looped, share, template, diagonal = 0.0, False, ZERO, CAUSAL_FRACTION, False, 1.0
        if at is not None:
            fwd_op = g.ops[at.forward_op] if at.phase is Phase.BACKWARD and at.forward_op is not None else at
            kind, attn, core = "attention", attn_geometry(g, fwd_op), True
            drop = attention_dropout(fwd_op)
            share = attention_share(fwd_op)
            cp = attention_cp(fwd_op)
            if cp > 1:  # the rank's queries meet every rank's keys (``attention_share``)
                attn = (attn[0], attn[1], attn[2] * cp, attn[3])
                if attention_causal(fwd_op):
                    # the ring's diagonal step is the rank's one causal call (``Kernel.diagonal``)
                    diagonal = 1.0 / cp
        elif mm is not None:
            kind, core = "matmul", False
            dims, sdim = mm_dims(g, mm, shard, self.tokens)
            tn = transposed_lhs(g, mm)
            # generated code around a GEMM (a plan's group): Inductor runs it as a GEMM template
            # with the group's other ops in its epilogue; a library GEMM's bias stays in its op
            template = self.compiled and any(op is not mm for op in real)
        else:
            kind = "vector"
            core = any(op.kind is OpKind.SOFTMAX and op.block is not None for op in real)
            if self.compiled:
                looped = loop_reads(g, grp, self.vec)
        return Kernel(
            phase,
            kind,
            shard,
            float(sum(op.flops for op in real)),
            float(sum(op.vector_flops for op in real)),
            bv,
            dims=dims,
            shard_dim=sdim,
            attn=attn,
            ops=grp,
            attn_core=core,
            vec_split=split,
            fresh=tuple(fresh),
            dtype=dtype,
            dropout=drop,
            share=share,
            diagonal=diagonal,
            tn=tn,
            loop_reads=looped,
            template=template,
        )

    def _scalar_only(self, ops: Sequence[Op]) -> bool:
        ts = self.g.tensors
        return all(not ts[t].shape for op in ops for t in (*op.inputs, *op.outputs))

    def vec_split(self, ops: Sequence[Op]) -> tuple[float, ...]:
        """Vector FLOPs of ``ops`` by family (``VECTOR_FAMILIES`` order)."""
        out = [0.0] * len(VECTOR_FAMILIES)
        for op in ops:
            if op.vector_flops:
                out[VECTOR_FAMILIES.index(vector_family(op))] += float(op.vector_flops)
        return tuple(out)

    # --- memory --------------------------------------------------------------------------------

    def saved_vec(self, ops: Sequence[Op], ids: set[int], *, mode: str) -> Vec:
        """Activation storages of this part kept for backward under a recompute mode."""
        g = self.g
        keep: dict[int, Tensor] = {}
        if mode == "full":
            # only the part's inputs coming from outside (the residual stream into the block)
            for op in ops:
                if op.phase is not Phase.FORWARD:
                    continue
                for tid in op.inputs:
                    t = g.tensors[g.tensors[tid].storage_id]
                    if t.role is TensorRole.ACTIVATION and (t.producer is None or t.producer not in ids):
                        keep[t.id] = t
        else:
            for op in ops:
                if op.phase is not Phase.FORWARD:
                    continue
                for tid in (*op.inputs, *op.outputs):
                    t = g.tensors[tid]
                    if not t.saved_for_backward:
                        continue
                    base = g.tensors[t.storage_id]
                    # a tensor is counted by the part producing it (a block's input is the
                    # previous block's output, already counted there)
                    if base.role is not TensorRole.ACTIVATION or base.producer not in ids:
                        continue
                    if mode == "selective" and self._is_core_output(base, ids):
                        continue
                    if self.fused_backward and fused_recomputed(g, base):
                        continue
                    keep[base.id] = base
        total: Vec = ZERO
        for t in keep.values():
            total = vadd(total, self.saved_copy(t) if mode != "full" else self.vec(t))
        return total

    def _is_core_output(self, t: Tensor, ids: set[int]) -> bool:
        """Whether ``t`` is produced inside the attention core (what selective recompute drops)."""
        if t.producer is None or t.producer not in ids:
            return False
        op = self.g.ops[t.producer]
        core = (OpKind.ATTENTION, OpKind.SOFTMAX)
        read_by = [self.g.ops[c] for c in readers(self.g, t.id)]
        if any(r.phase is Phase.BACKWARD and r.kind not in core for r in read_by):
            return False  # also an input of a later op (the output projection keeps the context)
        return op.kind in core or (
            op.block is not None
            and "attn" in op.module_path
            and op.kind is OpKind.ELEMENTWISE
            and any(self.g.ops[c].kind is OpKind.ATTENTION for c in t.consumers)
        )
