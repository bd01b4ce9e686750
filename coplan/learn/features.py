"""What the learned planner sees of a job, and the per-op decisions it learns, as tensors.

A job is one graph: the ops of the fusion regions (each block template's reference block and the
ops outside blocks, ``search.opspace.regions``: no views, no optimizer updates), in the reference
graph (microbatch 1 at the job's sequence length). Two kinds of edge link them: a *data* edge
producer -> consumer inside one phase (the fusion decisions: fuse with that consumer or not), and
a *saved* edge from a forward op to each backward op that reads what it saved (what recomputation
trades against). The device, the cluster's links, the job and the model are one vector of
global features, so the same network plans for hardware it has not seen by its description.

Features are scaled logs (sizes span ten orders of magnitude); every number is documented where
it is built. Labels are read off a plan by name, as the plan format names ops and tensors of the
reference blocks: ``fuse`` per data edge (both ends in one kernel), ``recompute`` per op with a
saved output (one of its outputs recomputed), ``dtype`` per op (the override class), and the
layout (``layout_features`` of the plan's parallel layout and compute precision).

A layout's features are its degrees and, beside them, what a roofline makes of it on this job
(``layout_matrix``): the parameter gathers, gradient reduction and tensor-parallel traffic each as a
share of the device's compute time, the pipeline's bubble, the model states' and the activations'
share of the memory budget, and the GEMM shapes a microbatch gives. These are ratios the network
meets at every scale: a short-sequence encoder whose ZeRO-3 gathers outweigh its compute shows the
same ratio a decoder does on a slow link, where its sequence length alone is outside what it saw.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from coplan.ir.types import OpKind, Phase
from coplan.plan.checker import SENSITIVE
from coplan.plan.types import ParallelPlan, Plan, PrecisionPlan

__all__ = [
    "DTYPE_CLASSES",
    "EDGE_DIM",
    "GLOBAL_DIM",
    "LAYOUT_DIM",
    "NODE_DIM",
    "PHYS_FEATURES",
    "PLAN_DIM",
    "JobGraph",
    "job_graph",
    "layout_candidates",
    "layout_features",
    "layout_matrix",
    "plan_labels",
    "plan_node_features",
]

_KINDS = tuple(OpKind)
#: an op's dtype decision: no override, or the dtype it is given
DTYPE_CLASSES = ("", "fp32", "bf16", "fp16", "fp8")
_COMPUTE = ("fp32", "tf32", "bf16", "fp16", "fp8")
NODE_DIM = len(_KINDS) + 10
EDGE_DIM = 4
GLOBAL_DIM = 29
#: the roofline features ``layout_matrix`` adds to a layout's degrees, in order
PHYS_FEATURES = (
    "gathers",  # ZeRO-3 weight gathers / compute
    "reduction",  # gradient reduction and ZeRO's weight gather after the step / compute
    "tensor_parallel",  # tensor-parallel activation all-reduces / compute
    "bubble",  # the pipeline's idle share
    "states",  # weights, gradients and optimizer states / budget
    "activations",  # activations in flight / budget
    "over_budget",  # 1 where the two exceed the budget
    "tokens",  # a microbatch's tokens per context-parallel rank
    "shard_width",  # the model's width per tensor-parallel rank
    "microbatches",  # a step's microbatches
    "cp",  # context-parallel ranks
    "compute_ms",  # a device's compute at its peak, milliseconds
)
PHYS_DIM = len(PHYS_FEATURES)
LAYOUT_DIM = 12 + len(_COMPUTE) + PHYS_DIM


def _lg(x: float, scale: float = 1.0) -> float:
    """log2(1 + x) / scale: sizes as bits, scaled to about [0, 1]."""
    return math.log2(1.0 + max(0.0, float(x))) / scale


@dataclass(frozen=True, slots=True)
class JobGraph:
    """One job's graph as tensors. ``ops`` are op ids in node order; ``edge_index`` is (2, E) with
    the data edges first (``n_data`` of them), then the saved edges; ``saved`` marks nodes with an
    output saved for backward that a recompute set may name (the ops a recompute decision applies
    to), with ``saved_names`` those tensors' names."""

    x: torch.Tensor  # (N, NODE_DIM)
    edge_index: torch.Tensor  # (2, E) long
    edge_attr: torch.Tensor  # (E, EDGE_DIM)
    u: torch.Tensor  # (GLOBAL_DIM,)
    ops: tuple[int, ...]
    names: tuple[str, ...]
    n_data: int
    saved: torch.Tensor  # (N,) bool
    saved_names: tuple[tuple[str, ...], ...]
    weight: torch.Tensor  # (N,) blocks a node's decision applies to (a template's block count)


def _global(ctx: Any) -> list[float]:
    from coplan.plan.context import PlanContext

    assert isinstance(ctx, PlanContext)
    dev = min(ctx.cluster.devices, key=lambda d: d.memory_bytes)
    spec = ctx.model.spec
    group = ctx.cluster.groups[0]
    inter = ctx.cluster.inter_node
    kind = getattr(dev, "kind", "gpu")
    fp8 = dev.peak("fp8") if dev.supports("fp8") else 0.0
    layers = spec.n_layers if spec is not None else 0
    width = spec.d_model if spec is not None else 0
    return [
        # device: peaks (FLOP/s ~2^50), vector rate, bandwidth (B/s ~2^42), capacity, cache, launch
        _lg(dev.peak("bf16") if dev.supports("bf16") else dev.peak("fp32"), 52),
        _lg(fp8, 52),
        _lg(dev.vector_flops, 48),
        _lg(dev.memory_bandwidth, 44),
        _lg(dev.memory_bytes, 40),
        _lg(dev.sram_bytes, 30),
        dev.kernel_launch_s * 1e5,
        float(kind == "gpu"),
        float(kind == "cpu"),
        float(kind == "accelerator"),
        # links: inside a node, between nodes (bytes/s per device), devices per node
        _lg(group.intra_node.bandwidth, 42),
        _lg(inter.bandwidth if inter is not None else group.intra_node.bandwidth, 42),
        _lg(group.devices_per_node, 6),
        # the job: devices, batch, sequence, the budget and its share of the capacity
        _lg(ctx.cluster.num_devices, 12),
        _lg(ctx.global_batch, 14),
        _lg(ctx.seq, 16),
        _lg(ctx.budget, 40),
        ctx.budget / dev.memory_bytes,
        # the model
        _lg(layers, 8),
        _lg(width, 16),
        _lg(spec.vocab_size if spec is not None else 0, 18),
        _lg(spec.n_heads if spec is not None else 0, 8),
        ((spec.n_kv_heads or spec.n_heads) / spec.n_heads) if spec is not None else 1.0,
        _lg(spec.n_experts if spec is not None else 0, 6),
        float(spec is not None and spec.norm == "rmsnorm"),
        float(spec is not None and spec.activation == "swiglu"),
        # the stack: what it can run (per-op kernels, GEMM epilogues, the whole parallel space)
        float("greedy" in ctx.stack.fusion),
        float("epilogue" in ctx.stack.fusion),
        float(ctx.stack.name == "megatron"),
    ]


def job_graph(ctx: Any, *, anchors: bool = True) -> JobGraph:
    """The graph of ``ctx``'s job (a ``PlanContext``), memoised on it."""
    from coplan.passes.remat import saved_names as recomputable
    from coplan.search.opspace import regions

    key = ("learn.job_graph", anchors)
    got = ctx.memo.get(key)
    if got is not None:
        return got
    graph = ctx.index.graph
    regs = regions(ctx, anchors=anchors)
    allowed = set(recomputable(ctx))  # what a recompute set may name
    ops: list[int] = []
    weight: list[float] = []
    for r in regs:
        ops.extend(r.ops)
        weight.extend([float(r.blocks)] * len(r.ops))
    pos = {o: i for i, o in enumerate(ops)}
    block_len: dict[int | None, int] = {}
    for o in ops:
        b = graph.ops[o].block
        block_len[b] = block_len.get(b, 0) + 1
    seen_in_block: dict[int | None, int] = {}
    rows = []
    saved = []
    saved_names: list[tuple[str, ...]] = []
    for o in ops:
        op = graph.ops[o]
        kind = [float(op.kind is k) for k in _KINDS]
        outs = [graph.tensors[t] for t in op.outputs]
        ins = [graph.tensors[t] for t in op.inputs]
        kept = tuple(t.name for t in outs if t.name in allowed)
        saved.append(bool(kept))
        saved_names.append(kept)
        i = seen_in_block.get(op.block, 0)
        seen_in_block[op.block] = i + 1
        width = ins[0].shape[-1] if ins and ins[0].shape else 0
        rows.append(
            [
                *kind,
                float(op.phase is Phase.FORWARD),
                float(op.block is not None),
                i / max(1, block_len[op.block] - 1),  # position in its block (or outside)
                _lg(op.flops, 48),
                _lg(op.vector_flops, 40),
                _lg(sum(t.numel for t in ins), 36),
                _lg(sum(t.numel for t in outs), 36),
                float(bool(kept)),
                float(op.kind in SENSITIVE),
                _lg(width, 18),
            ]
        )
    data_edges = [(pos[a], pos[b]) for r in regs for a, b in r.edges if a in pos and b in pos]
    saved_edges: list[tuple[int, int]] = []
    for o in ops:
        op = graph.ops[o]
        if op.phase is not Phase.FORWARD:
            continue
        readers = {
            c
            for t in op.outputs
            if graph.tensors[t].saved_for_backward
            for c in graph.tensors[t].consumers
            if c in pos and graph.ops[c].phase is Phase.BACKWARD
        }
        saved_edges.extend((pos[o], pos[c]) for c in sorted(readers))
    edges = data_edges + saved_edges

    def attr(a: int, b: int, is_saved: bool) -> list[float]:
        src = graph.ops[ops[a]]
        numel = sum(graph.tensors[t].numel for t in src.outputs)
        return [
            float(not is_saved),
            float(is_saved),
            _lg(numel, 36),
            float(graph.ops[ops[b]].kind in SENSITIVE),
        ]

    edge_attr = [attr(a, b, False) for a, b in data_edges] + [attr(a, b, True) for a, b in saved_edges]
    got = JobGraph(
        x=torch.tensor(rows, dtype=torch.float32),
        edge_index=torch.tensor(edges, dtype=torch.long).reshape(-1, 2).t().contiguous(),
        edge_attr=torch.tensor(edge_attr, dtype=torch.float32).reshape(-1, EDGE_DIM),
        u=torch.tensor(_global(ctx), dtype=torch.float32),
        ops=tuple(ops),
        names=tuple(graph.ops[o].name for o in ops),
        n_data=len(data_edges),
        saved=torch.tensor(saved, dtype=torch.bool),
        saved_names=tuple(saved_names),
        weight=torch.tensor(weight, dtype=torch.float32),
    )
    ctx.memo[key] = got
    return got


def layout_features(ctx: Any, par: ParallelPlan, prec: PrecisionPlan) -> list[float]:
    """A parallel layout and compute precision of ``ctx``'s job as numbers (what the layout head
    scores): one row of ``layout_matrix``."""
    return layout_matrix(ctx, [(par, prec)])[0].tolist()


@dataclass(frozen=True, slots=True)
class _Job:
    """What the roofline features read of a job (``_job``)."""

    params: float  # trainable parameters
    flops_token: float  # training FLOPs a token costs at the job's sequence (6 x active + attention)
    layers: int
    width: int
    seq: int
    batch: int  # sequences a step
    budget: float
    peaks: dict[str, float]  # dense matrix FLOP/s by compute dtype
    intra: float  # bytes/s per device inside a node
    inter: float  # bytes/s per device between nodes
    per_node: int


def _job(ctx: Any) -> _Job:
    got = ctx.memo.get("learn.roofline")
    if got is not None:
        return got
    dev = min(ctx.cluster.devices, key=lambda d: d.memory_bytes)
    spec = ctx.model.spec
    seq = ctx.seq
    if spec is not None:
        params, active = float(spec.param_count()), float(spec.active_param_count())
        layers, width = spec.n_layers, spec.d_model
        # Narayanan et al. 2021 eq. 3 per token: 6 FLOPs a parameter, 12 L s h for the attention
        # scores and values (half of it where attention is causal, as flash kernels skip it)
        attn = 12.0 * layers * seq * width * (0.5 if spec.causal else 1.0)
        flops = 6.0 * active + attn
    else:  # a captured graph: its own FLOPs per token, one block as wide as its parameters say
        graph = ctx.model.graph
        params = float(graph.param_count)
        tokens = max(1, graph.meta.batch * graph.meta.seq)
        flops = graph.flops / tokens
        layers, width = 1, max(1, int(math.sqrt(params / 12.0)))
    group = ctx.cluster.groups[0]
    inter = ctx.cluster.inter_node
    peaks = {c: dev.peak(c) for c in _COMPUTE if dev.supports(c)}
    got = _Job(
        params=params,
        flops_token=flops,
        layers=layers,
        width=width,
        seq=seq,
        batch=ctx.global_batch,
        budget=float(ctx.budget),
        peaks=peaks,
        intra=group.intra_node.bandwidth,
        inter=inter.bandwidth if inter is not None else group.intra_node.bandwidth,
        per_node=group.devices_per_node,
    )
    ctx.memo["learn.roofline"] = got
    return got


def _lgt(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``_lg`` of each element of ``x``."""
    return torch.log2(1.0 + x.clamp(min=0.0)) / scale


def _ratio(x: torch.Tensor) -> torch.Tensor:
    """A share, as log2(1 + x) / 4: 0 at none, 0.25 at parity, 1 at fifteen times."""
    return _lgt(x, 4.0)


def layout_matrix(ctx: Any, cands: list[tuple[ParallelPlan, PrecisionPlan]]) -> torch.Tensor:
    """(L, LAYOUT_DIM) float32: each layout of ``cands`` on ``ctx``'s job, its degrees and precision
    (one-hot and scaled logs), then its roofline features. The roofline is a first-order account,
    not the cost model's price: per device a step computes ``flops_token`` x tokens / devices at the
    compute dtype's peak; ZeRO-3 gathers the stage's weights twice a microbatch (forward and
    backward, as FSDP and DeepSpeed reshard after forward); gradients are all-reduced (ZeRO 0-1) or
    reduce-scattered and the weights gathered again (ZeRO 2-3) once a step; tensor parallelism
    all-reduces a microbatch's activations four times a block (Megatron's f and g, forward and
    backward); a ring moves (n - 1) / n of a buffer per device, inside a node where its group
    fits in one (tensor innermost, then context, then data, as Megatron orders ranks), else over
    the slower link. Memory: weights, gradients and Adam's fp32 states sharded by the ZeRO stage,
    and 34 bytes of activations per token and width a block (Korthikanti et al. 2022, no
    recomputation) for the microbatches a first pipeline stage keeps in flight."""
    j = _job(ctx)
    rows = [
        (
            p.tp,
            p.pp,
            p.dp,
            p.vpp,
            p.microbatch,
            float(p.sequence_parallel),
            p.zero,
            p.cp,
            float(q.fp8_params),
            _COMPUTE.index(q.compute) if q.compute in _COMPUTE else 2,
        )
        for p, q in cands
    ]
    a = torch.tensor(rows, dtype=torch.float64).reshape(-1, 10)
    tp, pp, dp, vpp, mb, sp, zero, cp, fp8, comp = a.unbind(1)

    base = [
        _lgt(tp, 6),
        _lgt(pp, 7),
        _lgt(dp, 12),
        _lgt(vpp, 6),
        _lgt(mb, 10),
        sp,
        *((zero == z).double() for z in (0, 1, 2, 3)),
        _lgt(tp * pp, 10),
        fp8,
        *((comp == i).double() for i in range(len(_COMPUTE))),
    ]
    bf16 = j.peaks.get("bf16") or j.peaks.get("fp32") or max(j.peaks.values(), default=1.0)
    peak = torch.tensor([j.peaks.get(c, bf16) for c in _COMPUTE], dtype=torch.float64)[comp.long()]
    used = tp * pp * dp * cp
    compute_s = j.flops_token * j.batch * j.seq / used / peak
    micro = (j.batch / (dp * mb)).clamp(min=1.0)  # microbatches a step
    shard = j.params / (tp * pp)  # a data-parallel rank's parameters
    wbytes = torch.where(fp8 > 0, 1.0, torch.where(comp == 0, 4.0, 2.0))

    def link(span: torch.Tensor) -> torch.Tensor:
        return torch.where(span <= j.per_node, j.intra, j.inter)

    ring = (dp - 1.0) / dp
    dp_bw = link(tp * cp * dp)
    gathers = torch.where(zero >= 3, 2.0 * micro * shard * wbytes * ring / dp_bw, 0.0)
    reduce = torch.where(zero >= 2, 1.0, 2.0) * shard * 4.0 * ring / dp_bw  # fp32 gradients
    regather = torch.where(zero >= 1, shard * wbytes * ring / dp_bw, 0.0)
    blocks = j.layers / pp
    act = mb * (j.seq / cp) * j.width * 2.0  # a microbatch's activations, 16-bit
    tp_s = 4.0 * blocks * micro * 2.0 * (tp - 1.0) / tp * act / link(tp)
    bubble = (pp - 1.0) / (vpp * micro + pp - 1.0)
    states = shard * (
        wbytes * torch.where(zero >= 3, 1.0 / dp, 1.0)  # weights
        + torch.where(zero >= 2, 4.0 / dp, 4.0)  # fp32 gradients
        + torch.where(zero >= 1, 12.0 / dp, 12.0)  # fp32 master weights and Adam's two moments
    )
    in_flight = torch.minimum(pp, micro)
    acts = 34.0 * blocks * act / 2.0 * in_flight / torch.where(sp > 0, tp, 1.0)
    phys = [
        _ratio(gathers / compute_s),
        _ratio((reduce + regather) / compute_s),
        _ratio(tp_s / compute_s),
        bubble,
        _ratio(states / j.budget),
        _ratio(acts / j.budget),
        ((states + acts) > j.budget).double(),
        _lgt(mb * j.seq / cp, 18),  # a microbatch's tokens: the GEMMs' rows
        _lgt(torch.full_like(tp, float(j.width)) / tp, 16),  # a tensor-parallel shard's width
        _lgt(micro, 12),
        _lgt(cp, 5),
        _lgt(compute_s * 1e3, 16),  # the device's compute, in milliseconds
    ]
    out = torch.stack([*base, *phys], dim=1).float()
    assert out.shape[1] == LAYOUT_DIM
    return out


@dataclass(frozen=True, slots=True)
class Labels:
    fuse: torch.Tensor  # (n_data,) float 0/1
    recompute: torch.Tensor  # (N,) float 0/1 (meaningful where ``saved``)
    dtype: torch.Tensor  # (N,) long, index into DTYPE_CLASSES


def plan_labels(jg: JobGraph, plan: Plan) -> Labels:
    """``plan``'s per-op decisions on ``jg``'s nodes (by name)."""
    group_of = {n: i for i, g in enumerate(plan.fusion.groups) for n in g}
    src, dst = jg.edge_index[:, : jg.n_data]
    fuse = [
        float(jg.names[a] in group_of and group_of.get(jg.names[a]) == group_of.get(jg.names[b]))
        for a, b in zip(src.tolist(), dst.tolist(), strict=True)
    ]
    dropped = plan.remat.all_names
    recompute = [float(any(n in dropped for n in names)) for names in jg.saved_names]
    over = dict(plan.precision.ops)
    dtype = [
        DTYPE_CLASSES.index(over.get(n, "")) if over.get(n, "") in DTYPE_CLASSES else 0 for n in jg.names
    ]
    return Labels(
        fuse=torch.tensor(fuse, dtype=torch.float32),
        recompute=torch.tensor(recompute, dtype=torch.float32),
        dtype=torch.tensor(dtype, dtype=torch.long),
    )


def _layout_key(par: ParallelPlan, prec: PrecisionPlan) -> tuple[object, ...]:
    return (
        par.tp,
        par.pp,
        par.dp,
        par.cp,
        par.vpp,
        par.sequence_parallel,
        par.zero,
        par.microbatch,
        prec.compute,
        prec.fp8_params,
    )


def layout_candidates(ctx: Any) -> list[tuple[ParallelPlan, PrecisionPlan]]:
    """Every parallel layout x compute precision of the job's search space, memoised on ``ctx``
    (the per-op precision overrides are left to the dtype head)."""
    from coplan.search.space import SearchSpace

    key = "learn.layouts"
    got = ctx.memo.get(key)
    if got is not None:
        return got
    space = SearchSpace()
    seen: dict[tuple[object, ...], tuple[ParallelPlan, PrecisionPlan]] = {}
    precs = {
        (p.compute, p.fp8_params): PrecisionPlan(
            compute=p.compute, loss_scaling=p.loss_scaling, fp8_params=p.fp8_params
        )
        for p in space.precisions(ctx)
    }
    for par in space.parallel(ctx):
        for prec in precs.values():
            seen.setdefault(_layout_key(par, prec), (par, prec))
    out = list(seen.values())
    ctx.memo[key] = out
    return out


#: per-op features of a plan's decisions (``plan_node_features``)
PLAN_DIM = 3 + len(DTYPE_CLASSES)


def plan_node_features(jg: JobGraph, plan: Plan) -> torch.Tensor:
    """(N, PLAN_DIM): per op, whether it shares a kernel, log2 of that kernel's size over 3, whether
    an output is recomputed, and its dtype class (one-hot)."""
    size = {n: len(g) for g in plan.fusion.groups for n in g}
    dropped = plan.remat.all_names
    over = dict(plan.precision.ops)
    rows = []
    for name, saved in zip(jg.names, jg.saved_names, strict=True):
        k = size.get(name, 1)
        d = over.get(name, "")
        rows.append(
            [
                float(k > 1),
                math.log2(k) / 3,
                float(any(t in dropped for t in saved)),
                *(float(d == c) for c in DTYPE_CLASSES),
            ]
        )
    return torch.tensor(rows, dtype=torch.float32)
