"""Bucketed data-parallel collectives: the queue's closed form, the stacks' bucketing rules, and
what the step-time estimate does with them."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coplan.cost import ConfigError, CostModel, TrainingConfig
from coplan.cost.buckets import (
    ChunkBuckets,
    StageBuckets,
    default_bucket_params,
    queued_exposure,
    serial_time,
)
from coplan.hardware import load_cluster
from coplan.models.spec import ModelSpec


def _simulate(early: list[float], gap: float, n: int, c: float, window: float) -> float:
    """Event by event: early chunk k (1-based) is ready ``k * gap`` before the window ends; bucket
    i of the last chunk at ``i * window / n``; one stream runs them in the order they are ready.
    Seconds past the window's end."""
    t = -math.inf
    for k in range(len(early), 0, -1):
        t = max(t, window - k * gap) + early[k - 1]
    for i in range(1, n + 1):
        t = max(t, i * window / n) + c
    return max(0.0, t - window)


@settings(max_examples=300, deadline=None)
@given(
    n=st.integers(1, 60),
    c=st.floats(1e-6, 1.0),
    window=st.floats(0.0, 5.0),
    early=st.lists(st.floats(0.0, 1.0), max_size=4),
    gap=st.floats(0.0, 3.0),
)
def test_queued_exposure_matches_an_event_simulation(n, c, window, early, gap):
    # collectives of a fixed cost: c per bucket of the last chunk, early[k] for early chunk k
    costs = {1.0: c, **{float(k + 2): e for k, e in enumerate(early)}}
    buckets = StageBuckets(
        last=ChunkBuckets(n, 1.0), early=tuple(ChunkBuckets(1, float(k + 2)) for k in range(len(early)))
    )
    got = queued_exposure(buckets, lambda b: costs[b], 1.0, window, gap)
    assert got == pytest.approx(_simulate(early, gap, n, c, window), rel=1e-9, abs=1e-12)


def test_one_bucket_cannot_overlap_and_many_hide_all_but_the_last():
    collective = lambda b: b / 1e9  # noqa: E731  (one second per GB, no latency)
    whole = StageBuckets(ChunkBuckets.of(1e9, None), ())
    # one bucket is ready only when the backward ends: all of it shows
    assert queued_exposure(whole, collective, 1.0, window=5.0, gap=0.0) == pytest.approx(1.0)
    # ten buckets under a backward five times longer than their reduction: only the last shows
    ten = StageBuckets(ChunkBuckets.of(1e9, 1e8), ())
    assert ten.last.count == 10
    assert queued_exposure(ten, collective, 1.0, window=5.0, gap=0.0) == pytest.approx(0.1)
    # with no overlap, every collective runs after the backward
    assert serial_time(ten, collective, 1.0) == pytest.approx(1.0)


def test_megatron_core_buckets_only_the_first_chunk_of_the_first_stage():
    # core_v0.8.0 distributed_data_parallel.py: bucket_size = None on pp_rank > 0, for chunks
    # after the first, and without overlap_grad_reduce
    bucket = default_bucket_params(64)
    assert bucket == 64_000_000 and default_bucket_params(8) == 40_000_000
    first = StageBuckets.of(0, 3, (4, 0.0), (3, 0.0), 1e8, bucket, "megatron-core", overlap=True)
    assert first.last.count == math.ceil(4e8 / bucket) and [c.count for c in first.early] == [1, 1]
    later = StageBuckets.of(2, 3, (4, 0.0), (3, 0.0), 1e8, bucket, "megatron-core", overlap=True)
    assert later.collectives == 3
    alone = StageBuckets.of(0, 1, (4, 0.0), (0, 0.0), 1e8, bucket, "megatron-core", overlap=False)
    assert alone.collectives == 1
    # overlap_param_gather_with_optimizer_step: one bucket per chunk everywhere
    assert StageBuckets.of(0, 3, (4, 0.0), (3, 0.0), 1e8, bucket, "none", overlap=True).collectives == 3
    # PyTorch DDP buckets every stage and chunk
    every = StageBuckets.of(2, 3, (4, 0.0), (3, 0.0), 1e8, bucket, "all", overlap=True)
    assert every.collectives == 7 + 5 + 5


def test_apex_buckets_are_padded_per_layer():
    # a layer of 1.25 buckets opens two, the last padded: 4 layers move 8 buckets, not 5
    chunk = ChunkBuckets.padded(4, 1.25e8, 0.0, 1e8)
    assert (chunk.count, chunk.params) == (8, 1e8)
    # the parameters outside the layers are a group of their own
    assert ChunkBuckets.padded(4, 1.25e8, 3e7, 1e8).count == 9
    stage = StageBuckets.of(1, 2, (4, 0.0), (4, 3e7), 1.25e8, 1e8, "padded", overlap=False)
    assert [stage.last.count, stage.early[0].count] == [8, 9]


SPEC = ModelSpec(name="bk", n_layers=8, d_model=2048, n_heads=16, vocab_size=32000, seq_len=1024)


def _dp_comm(**kw) -> float:
    config = TrainingConfig(tp=1, pp=1, dp=64, microbatch=1, global_batch=64, seq=1024, zero=1, **kw)
    est = CostModel(spec=SPEC).estimate(load_cluster("dgx-h100", 64), config)
    return est.stages[0].dp_comm_s + est.stages[0].param_gather_s


def test_smaller_buckets_pay_more_ring_latency():
    # ~0.5B parameters over 8 nodes: each extra bucket adds a ring's n - 1 hop latencies to the
    # reduce-scatter and to the all-gather, which the short backward cannot hide
    no_overlap = {"overlap_grad_reduce": False, "overlap_param_gather": False}
    coarse = _dp_comm(dp_bucket_params=10**9, **no_overlap)
    fine = _dp_comm(dp_bucket_params=10**6, dp_bucket_scope="all", **no_overlap)
    group_latency = 56 * load_cluster("dgx-h100", 64).groups[0].intra_node.latency_s
    assert fine - coarse > 2 * 400 * group_latency


def test_bucket_settings_are_validated():
    with pytest.raises(ConfigError, match="dp_bucket_params"):
        TrainingConfig(dp_bucket_params=0)
    with pytest.raises(ConfigError, match="dp_bucket_scope"):
        TrainingConfig(dp_bucket_scope="deepspeed")
    assert TrainingConfig(dp=100, global_batch=100).bucket_params == 100_000_000
