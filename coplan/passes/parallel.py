"""The parallelism pass: search tensor, pipeline and data degrees, interleaving, sequence
parallelism, ZeRO stage and microbatch with the other decisions fixed (as Megatron users and
auto-parallel tools such as Alpa's outer loop do).

Candidates respect the model (TP divides the heads and stays inside a node, PP x VPP divides the
layers, any VPP up to one layer per chunk) and the job (TP x CP x PP x DP = GPUs, microbatch x DP
divides the global batch). Context parallelism (CP) is searched where the stack runs it, the
sequence splits into ``2 x CP`` equal chunks and each rank keeps at least ``MIN_CP_TOKENS`` of
it. Where the stack's FSDP units shard within groups (``StackSpec.hybrid_shard``) and the ZeRO-2/3
ranks span nodes, the layout is also priced sharded within each node and replicated across them
(HSDP), as FSDP's ``HYBRID_SHARD`` groups them.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from coplan.ir.types import Graph
from coplan.passes.base import choose, register
from coplan.plan.capabilities import layout_problem
from coplan.plan.context import PlanContext
from coplan.plan.types import ParallelPlan, Plan, RematPlan

MAX_MICROBATCH = 64
#: context parallelism is searched where each rank keeps at least this many tokens of a sequence:
#: below it a rank's GEMMs and attention steps shrink while the ring's transfers stay, and every
#: degree is another set of layouts to price (a pruning rule of the search, not of the cost model)
MIN_CP_TOKENS = 4096


def _divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending, found in O(sqrt n): GPU counts and per-rank batches reach
    ``coplan.limits``' bounds (2^18, 2^20), where trying every number below ``n`` would not do."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def _model_shape(ctx: PlanContext) -> tuple[int, int, int | None]:
    spec = ctx.model.spec
    if spec is not None:
        return spec.n_heads, spec.n_layers, spec.kv_heads
    prof = ctx.reference_profile
    return prof.heads, prof.n_layers, None


def candidates(ctx: PlanContext, *, zero: tuple[int, ...] = (0, 1, 2, 3)) -> Iterator[ParallelPlan]:
    """Every parallel layout worth pricing for ``ctx`` that its stack can run."""
    for par in _layouts(ctx, zero):
        if layout_problem(ctx.stack, par) is None:
            yield par


def _layouts(ctx: PlanContext, zero: tuple[int, ...]) -> Iterator[ParallelPlan]:
    n = ctx.gpus
    heads, layers, kv = _model_shape(ctx)
    per_node = ctx.cluster.groups[0].devices_per_node
    captured = ctx.model.spec is None
    for tp in _divisors(n):
        if tp > per_node or heads % tp or (kv is not None and kv % tp and tp % kv):
            continue
        for cp in _cp_degrees(ctx, n // tp, captured):
            yield from _with_cp(ctx, n, tp, cp, layers, zero, captured)


def _cp_degrees(ctx: PlanContext, rest: int, captured: bool) -> list[int]:
    """Context-parallel degrees worth pricing with ``rest`` GPUs left beside the tensor-parallel
    ones (1 only where the graph was captured whole; a stack that runs none refuses the others in
    ``layout_problem``)."""
    if captured:
        return [1]
    seq = ctx.seq
    return [c for c in _divisors(rest) if c == 1 or (seq % (2 * c) == 0 and seq // c >= MIN_CP_TOKENS)]


def _with_cp(
    ctx: PlanContext, n: int, tp: int, cp: int, layers: int, zero: tuple[int, ...], captured: bool
) -> Iterator[ParallelPlan]:
    g = ctx.global_batch
    for pp in _divisors(n // (tp * cp)):
        # stages that do not divide the blocks: as the stack splits them, where it does
        split = ctx.stack.stage_split(layers, pp)
        if layers % pp and split is None:
            continue
        dp = n // (tp * cp * pp)
        if g % dp:
            continue
        per_rank = g // dp
        mbs = [m for m in range(1, min(per_rank, MAX_MICROBATCH) + 1) if per_rank % m == 0]
        if captured:  # a captured graph is priced only at the microbatch it was captured with
            mbs = [m for m in mbs if m == ctx.model.graph.meta.batch]  # type: ignore[union-attr]
        # interleaving: any number of model chunks per stage that divides its layers, up to one
        # layer a chunk (Megatron-LM's --num-layers-per-virtual-pipeline-stage; NVIDIA's
        # published recipes run 5-20 chunks, e.g. 20 for LLaMA-2 70B at PP 4)
        for vpp in _divisors(layers // pp) if pp > 1 and split is None else [1]:
            for mb in mbs:
                if vpp > 1 and (per_rank // mb) % pp:
                    continue
                for sp in (False, True) if tp > 1 else (False,):
                    # ZeRO shards over the ranks holding the same parameters: dp x cp
                    for z in zero if dp * cp > 1 else (0,):
                        for shard in _shard_groups(ctx, tp, dp, cp, z):
                            yield ParallelPlan(
                                tp=tp, pp=pp, dp=dp, cp=cp, vpp=vpp, sequence_parallel=sp, zero=z,
                                microbatch=mb, stage_layers=split, fsdp_shard=shard,
                            )  # fmt: skip


def _shard_groups(ctx: PlanContext, tp: int, dp: int, cp: int, zero: int) -> list[int | None]:
    """The FSDP sharding groups worth pricing: every ZeRO rank (None), and, where the stack runs
    HSDP and those ranks span nodes, the ranks of one node (its GPUs over the TP ranks, which sit
    innermost, as the cost model's groups place them): their all-gathers and reduce-scatters stay
    on NVLink, the replicas all-reduce across nodes."""
    ranks = dp * cp
    if zero < 2 or not ctx.stack.hybrid_shard:
        return [None]
    per_node = ctx.cluster.groups[0].devices_per_node
    if per_node % tp:
        return [None]
    group = per_node // tp
    if ranks % group or group >= ranks:
        return [None]
    return [None, group]


@register("parallel")
def parallel_pass(graph: Graph, plan: Plan, ctx: PlanContext) -> Plan:
    best = choose((plan.with_(parallel=c, remat=_fit_stages(plan, c)) for c in candidates(ctx)), ctx)
    return best if best is not None else plan


def _fit_stages(plan: Plan, par: ParallelPlan) -> RematPlan:
    """Per-stage remat sets only carry over when the stage count is unchanged."""
    r = plan.remat
    if r.per_stage is not None and len(r.per_stage) != par.pp:
        return RematPlan(recompute=r.recompute)
    return r
