"""PyTorch's CUDA caching allocator as ``coplan.cost.caching`` replays it: exact segment sizes,
best fit, splitting, merging, streams, expandable segments and release on a full device."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coplan.cost.caching import (
    LARGE_BUFFER,
    MIN_BLOCK,
    SMALL_BUFFER,
    CachingAllocator,
    OutOfMemory,
    replay,
    round_size,
    segment_size,
)

MiB = 1 << 20


def test_sizes_round_as_pytorch_does() -> None:
    assert round_size(1) == MIN_BLOCK == 512
    assert round_size(513) == 1024
    assert segment_size(100) == SMALL_BUFFER == 2 * MiB  # small requests pack into 2 MiB
    assert segment_size(MiB + 512) == LARGE_BUFFER == 20 * MiB  # 1-10 MiB share a 20 MiB segment
    assert segment_size(10 * MiB) == 10 * MiB  # from 10 MiB: its own, rounded to 2 MiB
    assert segment_size(31 * MiB) == 32 * MiB


def test_small_requests_share_a_segment() -> None:
    a = CachingAllocator()
    for _ in range(4):
        a.malloc(1000)
    assert a.reserved == 2 * MiB
    assert a.allocated == 4 * 1024


def test_mid_sized_requests_split_a_20_mib_segment() -> None:
    a = CachingAllocator()
    a.malloc(3 * MiB)
    a.malloc(3 * MiB)
    assert a.reserved == 20 * MiB
    assert a.allocated == 6 * MiB


def test_best_fit_takes_the_smallest_block_that_holds_the_request() -> None:
    a = CachingAllocator()
    big, small = a.malloc(60 * MiB), a.malloc(40 * MiB)
    a.free(big)
    a.free(small)
    a.malloc(35 * MiB)  # from the 40 MiB block, leaving its 5 MiB free
    a.malloc(58 * MiB)  # the 60 MiB block still holds this
    assert a.reserved == 100 * MiB


def test_a_remainder_of_at_most_1_mib_is_not_split_off() -> None:
    a = CachingAllocator()
    a.free(a.malloc(21 * MiB))
    # the 21 MiB request's segment is 22 MiB (rounded up to 2 MiB); a request leaving 0.5 MiB of
    # it takes the whole block, one leaving 1.5 MiB splits it
    b = a.malloc(21 * MiB + 512 * 1024)
    assert b.size == a.allocated == 22 * MiB
    a.free(b)
    assert a.malloc(20 * MiB + 512 * 1024).size == 20 * MiB + 512 * 1024


def test_freed_neighbours_merge() -> None:
    a = CachingAllocator()
    a.free(a.malloc(40 * MiB))
    x, y = a.malloc(20 * MiB), a.malloc(20 * MiB)  # both from the one 40 MiB segment
    a.free(x)
    a.free(y)
    a.malloc(40 * MiB)  # the two halves merged back
    assert a.reserved == 40 * MiB


def test_a_block_freed_by_one_stream_is_never_given_to_another() -> None:
    a = CachingAllocator()
    a.free(a.malloc(40 * MiB, stream=1))
    a.malloc(40 * MiB, stream=0)
    assert a.reserved == 80 * MiB
    assert a.allocated == 40 * MiB


def test_expandable_segments_map_only_the_pages_a_request_lacks() -> None:
    a = CachingAllocator(expandable=True)
    a.malloc(30 * MiB)  # two 20 MiB pages, 10 MiB of them left free at the end
    assert a.reserved == 40 * MiB
    a.malloc(30 * MiB)  # the free end grows by one page
    assert a.reserved == 60 * MiB
    c = CachingAllocator()
    c.malloc(30 * MiB)
    c.malloc(30 * MiB)
    assert c.reserved == 60 * MiB


def test_a_full_device_releases_cached_segments_then_runs_out() -> None:
    a = CachingAllocator(capacity=100 * MiB)
    a.free(a.malloc(60 * MiB))
    a.malloc(80 * MiB)  # needs the cached 60 MiB segment given back
    assert a.reserved == 80 * MiB
    with pytest.raises(OutOfMemory):
        a.malloc(40 * MiB)
    got = replay([(0, 80 * MiB, 0), (1, 40 * MiB, 0)], capacity=100 * MiB)
    assert got.oom


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 64 * MiB), st.integers(0, 2), st.booleans()), min_size=1, max_size=60),
    st.booleans(),
)
def test_replay_invariants(ops: list[tuple[int, int, bool]], expandable: bool) -> None:
    """Reserved never falls below allocated, every byte allocated is accounted for, and freeing
    everything leaves nothing allocated."""
    a = CachingAllocator(expandable=expandable)
    live = []
    for size, stream, free_one in ops:
        live.append(a.malloc(size, stream))
        assert a.reserved >= a.allocated == sum(b.size for b in live)
        assert all(b.size >= round_size(1) for b in live)
        if free_one and live:
            a.free(live.pop(0))
    for b in live:
        a.free(b)
    assert a.allocated == 0
    assert a.peak_reserved >= a.peak_allocated
