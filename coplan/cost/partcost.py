"""Prices of one model part (a block template, the embedding, the head) under one stage's rates,
scale and configuration: its kernels forward, backward and in the optimizer, what it saves for
backward, what a recompute mode re-runs, and its tensor-parallel collectives. ``estimate`` sums
these over each stage's parts; a search's estimates share them through the part's cache.
"""

from __future__ import annotations

from dataclasses import replace

from coplan.cost.comm import Group
from coplan.cost.config import TrainingConfig
from coplan.cost.eager import parallel_loss_temporary, stack_kernels
from coplan.cost.fp8 import fp8_cost, runs_fp8
from coplan.cost.fusion import readers
from coplan.cost.kernels import (
    Rates,
    Scale,
    kernel_time,
    launches,
    vector_compute,
)
from coplan.cost.optimizer import optimizer_seconds
from coplan.cost.parts import (
    NV,
    GraphProfile,
    Kernel,
    Part,
    Vec,
    loss_variant,
    run_kernels,
    vadd,
    vdot,
)
from coplan.cost.tp_overlap import (
    ASYNC_TP_REDUCE_PEAK,
    async_tp_reduce_bytes,
    async_tp_slots,
    block_overlap,
    ub_slots,
    with_rows,
)
from coplan.hardware.device import DeviceSpec
from coplan.ir.types import Phase


class PartCost:
    """Prices parts for one stage's device and the configuration; memoises per part."""

    def __init__(
        self,
        rates: Rates,
        scale: Scale,
        config: TrainingConfig,
        tp_group: Group,
        profile: GraphProfile,
        device: DeviceSpec,
    ) -> None:
        self.r, self.s, self.c, self.tp, self.profile = rates, scale, config, tp_group, profile
        self.device = device
        self._memo: dict[int, _Priced] = {}
        self._rates: dict[str, Rates] = {}
        self.ub_slots = ub_slots(config.tp_overlap_cfg)

    def rates(self, k: Kernel) -> Rates:
        """The rates of kernel ``k``: its own precision's when overridden, else the stage's."""
        if not k.dtype:
            return self.r
        got = self._rates.get(k.dtype)
        if got is None:
            got = self._rates[k.dtype] = Rates.of(self.device, k.dtype, self.c.attention_kernel)
        return got

    def time(self, k: Kernel) -> float:
        return kernel_time(k, self.rates(k), self.s)

    def of(self, part: Part) -> _Priced:
        key = id(part)
        got = self._memo.get(key)
        if got is None:
            got = _Priced(self, part)
            self._memo[key] = got
        return got


#: ``_base_prices``' answer
_Base = tuple[
    Vec, tuple[Vec, ...], tuple[Kernel, ...], tuple[float, ...], float, float, float, int, float, float
]


def _base_prices(cost: PartCost, part: Part, fp8: bool) -> _Base:
    """What ``_Priced`` reads of ``part`` under ``cost``'s rates, scale and kernels: saved vector,
    transient points, forward kernels and their times, forward, backward and optimizer seconds,
    launches, and the fp8 weights' cast seconds and cache bytes."""
    c, s = cost.c, cost.s
    saved: Vec = part.saved["none"]
    if c.kernel_local_buffers:
        points = part.scheduled_transient()
    elif c.fused_output_casts:
        points = part.cast_transient()
    else:
        points = part.transient
    want = loss_variant(part, c.loss_fusion, c.eager_loss_cast)
    for name, _, _, delta, pts in part.loss_variants:
        if name == want:  # Megatron's own loss kernels, or a fused cross-entropy's memory
            saved, points = vadd(saved, delta), pts
    post = part is cost.profile.post
    if post and c.eager_loss_cast == "parallel" and (c.kernels == "eager" or c.eager_loss):
        # DTensor's loss-parallel handlers hold one fp32 logits tensor more than ATen's loss at
        # the loss's peak, which is the part's (``eager.parallel_loss_temporary``)
        extra = parallel_loss_temporary(cost.profile.graph, part.op_ids)
        points = tuple(vadd(p, extra) for p in points)
    fwd, bwd = run_kernels(part, c.loss_fusion, c.activation_fusion)
    # the kernels the stack launches for them (``eager.stack_kernels``), kept on the part
    key = (
        "stack",
        c.kernels,
        c.eager_loss and post,
        c.loss_fusion,
        c.activation_fusion,
        c.fused_rmsnorm,
        c.attention_unpad,
        c.eager_rope,
        c.eager_loss_cast,
    )
    fwd, bwd = part.memo(key, lambda: stack_kernels(cost.profile.graph, fwd, bwd, c, post))
    fwd_times = tuple(cost.time(k) for k in fwd)
    forward = sum(fwd_times)
    backward = sum(cost.time(k) for k in bwd)
    # optimizer kernels: everything scales with the local (TP-sharded) parameters
    # run as the configuration says PyTorch runs the update (``optimizer.py``)
    optimizer, opt_kernels = optimizer_seconds(
        part.optimizer,
        [cost.time(k) for k in part.optimizer],
        [vdot(k.bytes, s.weights) for k in part.optimizer],
        cost.r.launch_s,
        c.optimizer,
    )
    kernels = sum(launches(k, s) for k in (*fwd, *bwd)) + opt_kernels
    weight_cast = weight_cache = 0.0
    if fp8:
        # Transformer Engine's casts and transposes around the block's fp8 GEMMs (``fp8.py``):
        # memory-bound kernels, in the forward time so full recompute re-runs them too
        f8 = fp8_cost(part.fp8_gemms, c, cost.r.bandwidth, cost.r.launch_s)
        forward += f8.forward_s
        backward += f8.backward_s
        kernels += f8.forward_kernels + f8.backward_kernels
        weight_cast, weight_cache = f8.weight_cast_s, f8.weight_cache_bytes
    return (
        saved,
        points,
        tuple(fwd),
        fwd_times,
        forward,
        backward,
        optimizer,
        kernels,
        weight_cast,
        weight_cache,
    )


class _Priced:
    __slots__ = (
        "attn_memo",
        "backward",
        "cost",
        "forward",
        "fwd_kernels",
        "fwd_times",
        "kernels",
        "optimizer",
        "points",
        "saved",
        "skip_memo",
        "tp_memo",
        "weight_cache",
        "weight_cast",
    )
    saved: Vec
    points: tuple[Vec, ...]
    fwd_kernels: tuple[Kernel, ...]
    fwd_times: tuple[float, ...]
    forward: float
    backward: float
    optimizer: float
    kernels: int
    weight_cast: float
    weight_cache: float

    def __init__(self, cost: PartCost, part: Part) -> None:
        c = cost.c
        fp8 = runs_fp8(c.dtype, cost.device) and bool(part.fp8_gemms)
        # what the part's kernel times depend on: kept on the part, so the thousands of estimates
        # of a search that share a stage's rates and scale price its kernels once
        key = (
            "priced",
            cost.r,
            cost.s,
            cost.device,
            c.attention_kernel,
            c.loss_fusion,
            c.activation_fusion,
            c.kernels,
            c.fused_rmsnorm,
            c.attention_unpad,
            c.kernel_local_buffers,
            c.fused_output_casts,
            c.eager_rope,
            c.eager_loss_cast,
            c.optimizer,
            c.eager_loss and part is cost.profile.post,
            (c.tp, c.sequence_parallel, c.fp8_params, c.fp8_scaling, c.gathers_per_unit, c.num_microbatches)
            if fp8
            else None,
        )
        got = part.memo(key, lambda: _base_prices(cost, part, fp8))
        (
            self.saved,
            self.points,
            self.fwd_kernels,
            self.fwd_times,
            self.forward,
            self.backward,
            self.optimizer,
            self.kernels,
            self.weight_cast,  # seconds per microbatch of casting the part's fp8 weights
            self.weight_cache,  # bytes of the fp8 weight copies kept through the step
        ) = got
        self.cost = cost
        self.tp_memo: dict[str | frozenset[str], float] = {}
        self.skip_memo: dict[frozenset[str], float] = {}
        self.attn_memo: tuple[float, float] | None = None

    def recompute(self, part: Part, mode: str | frozenset[str]) -> float:
        if mode == "none":
            return 0.0
        if mode == "full":
            return self.forward
        if mode == "selective":
            return sum(t for k, t in zip(self.fwd_kernels, self.fwd_times, strict=True) if k.attn_core)
        assert isinstance(mode, frozenset)
        prof = self.cost.profile
        ops, _ = _recompute_closure(prof, part, mode)
        fused = _fused_ids(prof, part, self.cost.c.recompute_fused) & ops
        total = 0.0
        for k, t in zip(self.fwd_kernels, self.fwd_times, strict=True):
            rerun = ops.intersection(k.ops)
            if not rerun:
                continue
            if rerun <= fused:
                # re-run inside the backward kernels that read the values: arithmetic only, once
                # per reading kernel, no launch and no memory traffic
                if k.vec_flops:
                    share = _fused_flops(prof, part, rerun) / k.vec_flops
                    total += vector_compute(k, self.cost.rates(k), self.cost.s) * share
            else:
                total += t
        return total

    def attention_s(self, part: Part) -> tuple[float, float]:
        """Seconds of the part's attention kernels, forward and backward (context parallelism's
        ring hides its transfers behind them, ``coplan.cost.context``)."""
        if self.attn_memo is None:
            c = self.cost.c
            fwd = sum(
                t for k, t in zip(self.fwd_kernels, self.fwd_times, strict=True) if k.kind == "attention"
            )
            _, bwd_kernels = run_kernels(part, c.loss_fusion, c.activation_fusion)
            bwd = sum(self.cost.time(k) for k in bwd_kernels if k.kind == "attention")
            self.attn_memo = (fwd, bwd)
        return self.attn_memo

    def unwritten(self, part: Part, mode: str | frozenset[str]) -> float:
        """Forward seconds saved by the writes a recompute set drops: a saved tensor whose
        generated forward kernel holds every forward reader is not written once recomputed
        (``Part.unwritten``). Each such kernel is re-priced with its traffic less those tensors,
        so a compute-bound kernel saves nothing."""
        if not isinstance(mode, frozenset) or not mode or not part.unwritten:
            return 0.0
        got = self.skip_memo.get(mode)
        if got is not None:
            return got
        # a duplicated producer is in several kernels: its first (its home) writes what is kept,
        # and every reader holding a copy of it reads no stored value
        holds: dict[int, list[int]] = {}
        for m, k in enumerate(self.fwd_kernels):
            for i in k.ops:
                holds.setdefault(i, []).append(m)
        less: dict[int, list[float]] = {}
        for name, producer, fwd_readers, vec in part.unwritten:
            if name not in mode or producer not in holds:
                continue
            n = holds[producer][0]
            copies = [self.fwd_kernels[m].ops for m in holds[producer]]
            if all(any(c in ops for ops in copies) for c in fwd_readers):
                acc = less.setdefault(n, [0.0] * NV)
                for i, x in enumerate(vec):
                    acc[i] += x
        got = 0.0
        for n, vec in less.items():  # type: ignore[assignment]
            k = self.fwd_kernels[n]
            rest = tuple(max(0.0, a - b) for a, b in zip(k.bytes, vec, strict=True))
            got += self.fwd_times[n] - self.cost.time(replace(k, bytes=rest))  # type: ignore[arg-type]
        self.skip_memo[mode] = got
        return got

    def tp_comm(self, part: Part, mode: str | frozenset[str]) -> float:
        got = self.tp_memo.get(mode)
        if got is None:
            got = self.tp_memo[mode] = self._tp_comm(part, mode)
        return got

    def _tp_comm(self, part: Part, mode: str | frozenset[str]) -> float:
        c, g = self.cost.c, self.cost.tp
        if c.tp == 1:
            return 0.0
        ab = c.act_bytes
        # fp8 with sequence parallelism: Transformer Engine quantises a GEMM input before gathering
        # it (the fused norm writes fp8, the output gradient is cast before its all-gather), so the
        # block's all-gathers move 1-byte elements; reductions stay in 16 bits, and the embedding
        # and LM head run in 16 bits anyway. Rowwise scaling gathers in 16 bits and casts after
        # (torchtitan's ``Float8ColwiseParallel`` serves tensorwise scaling only)
        fp8_gather = runs_fp8(c.dtype, self.cost.device) and c.fp8_scaling == "tensorwise"
        ag = 1 if fp8_gather and part.blocks else ab
        overlapped = c.tp_comm_overlap or c.async_tp
        if overlapped and c.sequence_parallel and part.blocks:
            # Transformer Engine's userbuffers, or PyTorch's async TP: each collective beside the
            # GEMM it feeds or drains, at the cost of its overlap method (``tp_overlap.py``); kept
            # on the part for every estimate that prices it alike (a search prices thousands)
            cost = self.cost
            # (the kernels priced depend on the activation's fusion where the part has a variant)
            eager = not c.activation_fusion and bool(part.eager_activation)
            key = (
                "userbuffers",
                cost.device,
                c.dtype,
                cost.s,
                g,
                c.tp_overlap_cfg,
                eager,
                c.kernels,
                c.fp8_scaling,
                c.async_tp,
            )

            def overlap() -> tuple[float, float] | None:
                # (async TP fuses no all-gather under rowwise fp8: a cast sits between it and the GEMM)
                rowwise = runs_fp8(c.dtype, cost.device) and c.fp8_scaling == "rowwise"
                slots = async_tp_slots(not rowwise) if c.async_tp else None
                return block_overlap(
                    self.fwd_kernels,
                    self.fwd_times,
                    part.tp_entries,
                    part.tp_exits,
                    lambda n: g.all_gather(n * ag),
                    lambda n: g.reduce_scatter(n * ab),
                    c.tp,
                    cost.device.compute_units,
                    slots or cost.ub_slots,
                    lambda k, rows: cost.time(with_rows(k, rows)),
                    # the collectives async TP leaves unfused re-lay DTensor's sequence out
                    # (``_tp_comm`` below)
                    (lambda n, gathered: self._relayout(n * (ag if gathered else ab), cost.r))
                    if c.async_tp and c.kernels in ("eager", "inductor")
                    else None,
                )

            got = part.memo(key, overlap)
            if got is not None:
                fwd, bwd = got
                if c.async_tp:
                    # the fused reduce-scatters' partial sums, reduced by a kernel of their own
                    rate = cost.device.memory_bandwidth * ASYNC_TP_REDUCE_PEAK
                    fwd += async_tp_reduce_bytes(part.tp_exits, c.tp, ab) / rate
                return fwd + bwd + (fwd if mode == "full" else 0.0) + self._regather(part, mode, ag)
        # each collective's own time: without userbuffers, or where they do not apply
        fwd = bwd = 0.0
        for n in part.tp_exits:
            if c.sequence_parallel:
                fwd += g.reduce_scatter(n * ab)
                bwd += g.all_gather(n * ag)
            else:
                fwd += g.all_reduce(n * ab)
        for n in part.tp_entries:
            if c.sequence_parallel:
                fwd += g.all_gather(n * ag)
                # (the saved input shard is re-gathered for the weight gradient too; Megatron
                # overlaps that all-gather with the input-gradient GEMM, so this exposed tally
                # leaves it out, and with userbuffers ``tp_overlap.py`` prices it as a bulk overlap)
                bwd += g.reduce_scatter(n * ab)
            else:
                bwd += g.all_reduce(n * ab)
        if c.sequence_parallel and c.kernels in ("eager", "inductor"):
            # DTensor's sequence parallelism shards dim 1 ([batch, seq, hidden]) and NCCL gathers
            # and scatters dim 0: each all-gather's output is re-laid out by a copy after it and
            # each reduce-scatter's input by one before it, on the compute stream
            # (torch/distributed/_functional_collectives.py ``all_gather_tensor``: ``torch.cat(
            # torch.chunk(res, group_size, dim=0), dim=gather_dim)``; ``reduce_scatter_tensor``:
            # the same for ``scatter_dim != 0``; torchtitan's TP plan: ``Shard(1)`` around every
            # block, its parallelize.py noting that folding batch and sequence would avoid it)
            r = self.cost.r
            fwd += sum(self._relayout(n * ab, r) for n in part.tp_exits)
            fwd += sum(self._relayout(n * ag, r) for n in part.tp_entries)
            bwd += sum(self._relayout(n * ag, r) for n in part.tp_exits)
            bwd += sum(self._relayout(n * ab, r) for n in part.tp_entries)
        total = fwd + bwd + (fwd if mode == "full" else 0.0) + self._regather(part, mode, ag)
        if c.tp_comm_overlap:
            # the embedding and head, or a block of another shape: what the part's GEMMs' time can
            # cover is hidden
            gemm = sum(t for k, t in zip(self.fwd_kernels, self.fwd_times, strict=True) if k.kind == "matmul")
            total = max(0.0, total - 2 * gemm)
        return total

    def _regather(self, part: Part, mode: str | frozenset[str], elem_bytes: int) -> float:
        """The all-gathers a per-op recompute set re-runs in backward on a PyTorch stack: DTensor's
        column-parallel linear saves the gathered input for its weight gradient, and a checkpoint
        policy that recomputes that input (torchtitan's per-op policy: an all-gather is not among
        the ops it saves, ``torchtitan/models/llama3/infra/parallelize.py`` ``_save_list``)
        gathers it again, before the GEMM that needs it. Megatron's sequence parallelism keeps only
        the shard either way and overlaps the re-gather with the input-gradient GEMM (the exposed
        tally above leaves it out), so its kernels pay nothing here."""
        c = self.cost.c
        if isinstance(mode, str) or not c.sequence_parallel or c.kernels not in ("eager", "inductor"):
            return 0.0
        dropped = {tid for tid, name, _ in part.saved_items if name in mode}
        if not dropped:
            return 0.0
        g, r = self.cost.tp, self.cost.r
        return sum(
            # (with DTensor's copy re-laying the gathered sequence out, ``_tp_comm``)
            g.all_gather(n * elem_bytes) + self._relayout(n * elem_bytes, r)
            for sid, n in zip(part.tp_entry_ids, part.tp_entries, strict=True)
            if sid in dropped
        )

    @staticmethod
    def _relayout(nbytes: float, r: Rates) -> float:
        """One copy of a gathered tensor of ``nbytes``: read and written once, one launch."""
        return 2 * nbytes / r.bandwidth + r.launch_s

    def transient(self, part: Part) -> float:
        w = self.cost.s.weights
        return max(vdot(pt, w) for pt in self.points)


def saved_under(profile: GraphProfile, part: Part, mode: str | frozenset[str], per_op: bool = False) -> Vec:
    """What ``part`` keeps for backward under ``mode``. A recompute set drops its tensors from the
    saved set; ``per_op`` (a PyTorch stack: eager autograd, or Inductor) starts from the tensors
    each op saves (``saved_items``), since a per-op checkpoint policy keeps exactly the tensors it
    tags and Inductor's partitioner honours the tags (torch/_functorch/partitioners.py at v2.13.0
    cf30153c4c: ``MUST_SAVE`` nodes are saved, ``must_recompute`` ones never), where a fused
    graph's own saved set would merge them."""
    if isinstance(mode, str):
        return part.saved[mode]
    _, dropped = _recompute_closure(profile, part, mode)
    base = _item_total(part) if per_op else part.saved["none"]
    return tuple(a - b for a, b in zip(base, dropped, strict=True))  # type: ignore[return-value]


def _item_total(part: Part) -> Vec:
    """The sum of the tensors ``part``'s ops save for backward, one by one."""

    def total() -> Vec:
        vec = [0.0] * NV
        for _, _, v in part.saved_items:
            for i, x in enumerate(v):
                vec[i] += x
        return tuple(vec)  # type: ignore[return-value]

    return part.memo("item_total", total)


def _fused_ids(profile: GraphProfile, part: Part, names: frozenset[str]) -> frozenset[int]:
    """Op ids of ``part``'s reference block named in ``names`` (ops recomputed in backward kernels)."""
    if not names:
        return frozenset()
    ops = profile.graph.ops
    return part.memo(("fused", names), lambda: frozenset(i for i in part.op_ids if ops[i].name in names))


def _fused_flops(profile: GraphProfile, part: Part, rerun: frozenset[int]) -> float:
    """Vector FLOPs of the ops ``rerun`` repeated inside every backward kernel reading their outputs
    (graph-only, so memoised on the part: a search prices the same sets again and again)."""

    def flops() -> float:
        g = profile.graph
        total = 0.0
        for i in rerun:
            op = g.ops[i]
            bwd = {c for t in op.outputs for c in readers(g, t) if g.ops[c].phase is Phase.BACKWARD}
            total += op.vector_flops * max(1, len(bwd))
        return total

    return part.memo(("fused_flops", rerun), flops)


def rematerialised(profile: GraphProfile, part: Part, names: frozenset[str], fused: frozenset[str]) -> Vec:
    """Saved elements a recompute set brings back into memory during the block's backward: the
    dropped tensors, less those recomputed inside backward kernels (never stored)."""
    _, dropped = _recompute_closure(profile, part, names)
    fids = _fused_ids(profile, part, fused)
    if not fids:
        return dropped

    def kept() -> Vec:
        g = profile.graph
        out = list(dropped)
        for tid, name, vec in part.saved_items:
            if name in names and g.tensors[tid].producer in fids:
                for i, x in enumerate(vec):
                    out[i] -= x
        return tuple(out)  # type: ignore[return-value]

    return part.memo(("rematerialised", names, fused), kept)


def _recompute_closure(
    profile: GraphProfile, part: Part, names: frozenset[str]
) -> tuple[frozenset[int], Vec]:
    """(op ids of the part's reference block to re-run, saved elements no longer kept) for
    recomputing the named tensors; memoised on the part, as a search asks for the same set often."""
    from coplan.cost.remat import recompute_closure

    return part.memo(("recompute", names), lambda: recompute_closure(profile.graph, part, names))


__all__ = ["PartCost", "rematerialised", "saved_under"]
