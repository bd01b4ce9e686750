"""PyTorch's CUDA caching allocator, replayed over a training step's allocations.

A GPU runs out of memory at what the allocator has *reserved* from the driver, not at what live
tensors occupy: ``torch.cuda.max_memory_reserved`` exceeds ``max_memory_allocated`` by the
segments the allocator keeps cached, which it cannot hand to a request that does not fit in one
of their free blocks or that comes from another stream. torchtitan logs the reserved peak, so
that is what its published memory figures are. This module replays an allocation trace
(``coplan.cost.steptrace``) through the allocator's own rules, at PyTorch v2.13.0:

- sizes round up to 512 bytes; requests of at most 1 MiB come from the small pool, packed into
  2 MiB segments; larger ones from the large pool, where a request under 10 MiB that finds no
  free block maps a 20 MiB segment and a larger one a segment of its size rounded up to 2 MiB
  (``kMinBlockSize``, ``kSmallSize``, ``kSmallBuffer``, ``kMinLargeAlloc``, ``kRoundLarge``:
  c10/core/AllocatorConfig.h; ``kLargeBuffer``; ``get_allocation_size`` in
  c10/cuda/CUDACachingAllocator.cpp);
- a request takes the smallest cached free block of its stream and pool that holds it (best
  fit, ``get_free_block``), split where the rest is worth keeping (``should_split``: at least
  512 bytes in the small pool, more than 1 MiB in the large one); a freed block merges with its
  free neighbours in the same segment (``free_block``); a block freed by one stream is never
  given to another;
- where a new segment would exceed the device, every cached segment with no live block is
  released and the request retried (``release_cached_blocks``); if it still does not fit, the
  step runs out of memory;
- with ``expandable_segments:True`` (``PYTORCH_CUDA_ALLOC_CONF``) each stream's pool is one
  virtual range mapped in pages of 2 MiB (small pool) or 20 MiB (large) as its end grows
  (``SegmentRange``, ``try_allocate_expandable_segment``), so a request past the last free block
  maps only what it lacks, and freed pages stay mapped until released.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable
from dataclasses import dataclass

MIN_BLOCK = 512
SMALL_SIZE = 1 << 20
SMALL_BUFFER = 2 << 20
LARGE_BUFFER = 20 << 20
MIN_LARGE_ALLOC = 10 << 20
ROUND_LARGE = 2 << 20


def round_size(n: int) -> int:
    """The bytes a request of ``n`` takes (``round_size``, without power-of-two divisions)."""
    return MIN_BLOCK if n < MIN_BLOCK else MIN_BLOCK * -(-n // MIN_BLOCK)


def segment_size(n: int) -> int:
    """The segment a rounded request of ``n`` bytes maps when no cached block holds it."""
    if n <= SMALL_SIZE:
        return SMALL_BUFFER
    if n < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return ROUND_LARGE * -(-n // ROUND_LARGE)


class OutOfMemory(Exception):
    """A request the device cannot hold, even with every cached segment released."""


class _Block:
    __slots__ = ("free", "next", "pool", "prev", "size", "uid")

    def __init__(self, size: int, pool: tuple[int, bool], uid: int) -> None:
        self.size = size
        self.free = True
        self.prev: _Block | None = None
        self.next: _Block | None = None
        self.pool = pool  # (stream, small)
        self.uid = uid


class CachingAllocator:
    """The allocator of one device: ``malloc`` returns a block, ``free`` takes it back."""

    def __init__(self, capacity: float = float("inf"), expandable: bool = False) -> None:
        self.capacity = capacity
        self.expandable = expandable
        self.allocated = 0
        self.reserved = 0
        self.peak_allocated = 0
        self.peak_reserved = 0
        self._uids = itertools.count()
        # per (stream, small): free blocks as (size, uid, block), sorted: best fit by bisection
        self._free: dict[tuple[int, bool], list[tuple[int, int, _Block]]] = {}
        self._tail: dict[tuple[int, bool], _Block] = {}  # expandable: the block ending each range

    def _insert(self, b: _Block) -> None:
        bisect.insort(self._free.setdefault(b.pool, []), (b.size, b.uid, b))

    def _remove(self, b: _Block) -> None:
        blocks = self._free[b.pool]
        i = bisect.bisect_left(blocks, (b.size, b.uid))
        del blocks[i]

    def malloc(self, nbytes: int, stream: int = 0) -> _Block:
        n = round_size(nbytes)
        pool = (stream, n <= SMALL_SIZE)
        blocks = self._free.setdefault(pool, [])
        i = bisect.bisect_left(blocks, (n,))
        if i < len(blocks):
            b = blocks.pop(i)[2]
        else:
            b = self._grow(pool, n) if self.expandable else self._segment(pool, n)
        rest = b.size - n
        if rest >= MIN_BLOCK if pool[1] else rest > SMALL_SIZE:
            r = _Block(rest, pool, next(self._uids))
            r.prev, r.next = b, b.next
            if b.next is not None:
                b.next.prev = r
            b.next, b.size = r, n
            self._insert(r)
            if self._tail.get(pool) is b:
                self._tail[pool] = r
        b.free = False
        self.allocated += b.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return b

    def _map(self, nbytes: int) -> None:
        if self.reserved + nbytes > self.capacity:
            self.release()
            if self.reserved + nbytes > self.capacity:
                raise OutOfMemory(nbytes)
        self.reserved += nbytes
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def _segment(self, pool: tuple[int, bool], n: int) -> _Block:
        size = segment_size(n)
        self._map(size)
        return _Block(size, pool, next(self._uids))

    def _grow(self, pool: tuple[int, bool], n: int) -> _Block:
        page = SMALL_BUFFER if pool[1] else LARGE_BUFFER
        tail = self._tail.get(pool)
        if tail is not None and tail.free:
            # the free block ending the range grows by the pages it lacks
            add = page * -(-(n - tail.size) // page)
            self._map(add)
            self._remove(tail)
            tail.size += add
            return tail
        add = page * -(-n // page)
        self._map(add)
        b = _Block(add, pool, next(self._uids))
        b.prev = tail
        if tail is not None:
            tail.next = b
        self._tail[pool] = b
        return b

    def free(self, b: _Block) -> None:
        self.allocated -= b.size
        b.free = True
        for other in (b.next, b.prev):
            if other is None or not other.free:
                continue
            self._remove(other)
            first, second = (b, other) if other is b.next else (other, b)
            first.size += second.size
            first.next = second.next
            if second.next is not None:
                second.next.prev = first
            if self._tail.get(b.pool) is second:
                self._tail[b.pool] = first
            b = first
        self._insert(b)

    def release(self) -> None:
        """Give back every cached segment with no live block (the free end of an expandable
        range)."""
        for pool, blocks in self._free.items():
            keep = []
            for entry in blocks:
                b = entry[2]
                whole = b.prev is None and b.next is None
                if whole or (self.expandable and b.next is None):
                    self.reserved -= b.size
                    if self._tail.get(pool) is b:
                        if b.prev is None:
                            del self._tail[pool]
                        else:
                            b.prev.next = None
                            self._tail[pool] = b.prev
                else:
                    keep.append(entry)
            self._free[pool] = keep


#: one event of a trace: (handle, bytes, stream) allocates, (handle, -1, 0) frees that handle
Event = tuple[int, int, int]


@dataclass(frozen=True, slots=True)
class AllocatorPeak:
    """What a replayed trace peaked at: live bytes and reserved bytes (``oom``: it ran out)."""

    allocated_bytes: float
    reserved_bytes: float
    oom: bool = False

    @property
    def overhead_bytes(self) -> float:
        """Reserved beyond allocated at their peaks: what the allocator holds and cannot use."""
        return max(0.0, self.reserved_bytes - self.allocated_bytes)


def replay(
    events: Iterable[Event], *, expandable: bool = False, capacity: float = float("inf")
) -> AllocatorPeak:
    """Run ``events`` through one device's caching allocator."""
    alloc = CachingAllocator(capacity, expandable)
    live: dict[int, _Block] = {}
    try:
        for handle, nbytes, stream in events:
            if nbytes < 0:
                alloc.free(live.pop(handle))
            else:
                live[handle] = alloc.malloc(nbytes, stream)
    except OutOfMemory:
        return AllocatorPeak(float(alloc.peak_allocated), float(alloc.capacity), oom=True)
    return AllocatorPeak(float(alloc.peak_allocated), float(alloc.peak_reserved))
