"""Data-parallel gradient reduction and parameter all-gather, issued bucket by bucket.

Stacks do not reduce a stage's gradients in one collective: they cut the gradient buffer into
buckets and launch one reduce-scatter (all-reduce without the distributed optimizer) per bucket
as soon as the backward has produced all of its gradients, so the reduction of early buckets runs
under the backward of later layers (PyTorch DDP, Li et al. 2020, arXiv 2006.15704, Sec. 3.2.3;
Megatron-Core ``DistributedDataParallel``; Apex ``DistributedFusedAdam``). Two consequences a
one-collective price misses:

- every bucket is a collective of its own and pays its ring latency (``n - 1`` steps, ``comm.Group``),
  so at large data-parallel degree small buckets turn latency-bound;
- the last bucket becomes ready only when the backward ends, so at least its reduction shows.

Bucket ``i`` of ``n`` is ready at ``i w`` (``w`` = the window / ``n``: the gradients arrive evenly over
the backward that produces them) and the collectives run one after another on one stream, so the
last one finishes at ``max_i (i w + (n - i + 1) c)`` for ``c`` seconds per bucket: the exposed time is
``max(c, n c - (n - 1) w)`` past the window. The parameter all-gather after a distributed optimizer's
update is the mirror image (bucket ``i`` must arrive before the forward reaches its layers).

Which buffers are bucketed is the stack's choice (``TrainingConfig.dp_bucket_scope``):

- ``"megatron-core"``: Megatron-Core buckets only pipeline stage 0's first model chunk, whose
  backward ends the step; later stages and chunks reduce each chunk in one collective, since their
  backward ends earlier and their reduction runs while stage 0 finishes; without overlap nothing
  is bucketed (``megatron/core/distributed/distributed_data_parallel.py`` at core_v0.8.0, lines 51-74:
  ``bucket_size = None`` for ``pp_rank > 0``, ``disable_bucketing`` for chunks after the first, and
  when ``overlap_grad_reduce`` is off). Its default size is ``max(4e7, 1e6 * dp)`` parameters, so
  the buckets grow with the data-parallel degree and the latency per step stays bounded
  ("larger DP sizes need larger buckets to ensure collectives do not become latency-bound",
  ``DistributedDataParallelConfig.bucket_size``).
- ``"all"``: every stage and chunk is bucketed (PyTorch DDP's buckets, NeMo 1.x's chunked
  all-reduce, Apex ``DistributedFusedAdam`` filled with the whole stage as NeMo 1.11 did).
- ``"padded"``: Apex ``DistributedFusedAdam`` as NeMo 1.2x and 2.0-rc drive it: every layer opens
  new buckets of exactly the bucket size, the last one padded and reduced whole, so a layer of
  1.1 buckets moves 2 buckets' bytes (apex ``distributed_fused_adam.py`` ``init_params_bucket``).
- ``"none"``: one collective per chunk on every stage (2021 Megatron-LM's local DDP, Megatron-Core
  with ``overlap_param_gather_with_optimizer_step``, which NeMo 2 and Megatron-Bridge turn on for
  interleaved pipelines and which disables bucketing on every chunk).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

#: Megatron-Core's default bucket: ``max(40000000, 1000000 * dp)`` parameters.
MCORE_MIN_BUCKET = 40_000_000
MCORE_BUCKET_PER_DP = 1_000_000
BUCKET_SCOPES: tuple[str, ...] = ("megatron-core", "all", "padded", "none")


def default_bucket_params(dp: int) -> int:
    """Megatron-Core's default bucket size in parameters for ``dp`` data-parallel ranks."""
    return max(MCORE_MIN_BUCKET, MCORE_BUCKET_PER_DP * dp)


@dataclass(frozen=True, slots=True)
class ChunkBuckets:
    """One model chunk's gradient buffer cut into ``count`` buckets of ``params`` parameters each."""

    count: int
    params: float

    @classmethod
    def of(cls, params: float, bucket: float | None) -> ChunkBuckets:
        """``params`` parameters in buckets of at most ``bucket`` (``None``: one bucket)."""
        if params <= 0:
            return cls(0, 0.0)
        if bucket is None or bucket <= 0 or bucket >= params:
            return cls(1, params)
        n = math.ceil(params / bucket)
        return cls(n, params / n)

    @classmethod
    def padded(cls, layers: float, layer_params: float, extra: float, bucket: float) -> ChunkBuckets:
        """Apex's buckets as NeMo fills them: each of ``layers`` layers of ``layer_params`` (and the
        ``extra`` parameters outside the layers, as a group of their own) starts new buckets of
        exactly ``bucket`` parameters, the last one padded and sent whole."""
        n = layers * math.ceil(layer_params / bucket) if layer_params > 0 else 0.0
        n += math.ceil(extra / bucket) if extra > 0 else 0
        count = math.ceil(n)
        return cls(count, float(bucket)) if count else cls(0, 0.0)

    def time(self, collective: Callable[[float], float], bytes_per_param: float) -> float:
        """Seconds of the chunk's collectives run back to back."""
        return self.count * collective(self.params * bytes_per_param) if self.count else 0.0


@dataclass(frozen=True, slots=True)
class StageBuckets:
    """A pipeline stage's gradient buffers: ``last`` is the chunk whose backward ends the stage's
    step (chunk 0 under the interleaved schedule), ``early`` the others (whose last backward runs
    earlier), whose reductions are queued ahead of ``last``'s."""

    last: ChunkBuckets
    early: tuple[ChunkBuckets, ...]

    @classmethod
    def of(
        cls,
        stage: int,
        vpp: int,
        first: tuple[float, float],
        other: tuple[float, float],
        layer_params: float,
        bucket: float,
        scope: str,
        overlap: bool,
    ) -> StageBuckets:
        """The stage's chunk 0 holds ``first = (layers, extra parameters)``, each of its ``vpp - 1``
        other chunks ``other``, at ``layer_params`` per layer; bucketed as ``scope`` does (module
        docstring)."""

        def chunk(layers: float, extra: float, cut: float | None) -> ChunkBuckets:
            if scope == "padded" and cut is not None:
                return ChunkBuckets.padded(layers, layer_params, extra, cut)
            return ChunkBuckets.of(layers * layer_params + extra, cut)

        if scope == "megatron-core":
            head: float | None = bucket if overlap and stage == 0 else None
            rest: float | None = None
        elif scope == "none":
            head = rest = None
        else:
            head = rest = bucket
        early = tuple(chunk(*other, rest) for _ in range(vpp - 1))
        return cls(chunk(*first, head), early)

    @property
    def collectives(self) -> int:
        return self.last.count + sum(c.count for c in self.early)


def queued_exposure(
    buckets: StageBuckets,
    collective: Callable[[float], float],
    bytes_per_param: float,
    window: float,
    gap: float,
) -> float:
    """Seconds the stage's bucketed collectives run past the compute they overlap.

    ``last``'s buckets become ready evenly over ``window`` seconds (the backward of the chunk's last
    microbatch, or for the all-gather the forward of its first). Early chunk ``k`` (``early[k-1]``)
    is ready ``k * gap`` before the window ends: Megatron's interleaved schedule runs the backward
    in groups of ``p`` microbatches per chunk, so chunk ``k``'s last backward is followed by ``k p``
    chunk backwards (``gap = p x`` one). They run in the order they become ready, ahead of
    ``last``'s buckets."""
    # the early chunks, latest-ready (chunk 1) last: the queue drains at the latest of
    # (ready time of chunk k + the collectives of chunks k .. 1), relative to the window's start
    backlog = 0.0
    queued = 0.0
    for k, chunk in enumerate(buckets.early, start=1):
        queued += chunk.time(collective, bytes_per_param)
        backlog = max(backlog, window - k * gap + queued)
    last = buckets.last
    if not last.count:
        return max(0.0, backlog - window)
    c = collective(last.params * bytes_per_param)
    n = last.count
    w = window / n
    finish = max(max(backlog, w) + n * c, n * w + c)
    return max(0.0, finish - window)


def serial_time(buckets: StageBuckets, collective: Callable[[float], float], bytes_per_param: float) -> float:
    """Seconds of all the stage's collectives run one after another, overlapping nothing."""
    chunks = (buckets.last, *buckets.early)
    return sum(c.time(collective, bytes_per_param) for c in chunks)
