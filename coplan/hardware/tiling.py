"""How a device's fused (flash) attention kernel tiles its work, and what each tile costs beyond its
FLOPs: data for kernels whose time is not a smooth function of the problem's shape.

PyTorch's CPU flash attention (aten/src/ATen/native/cpu/FlashAttentionKernel.cpp,
``flash_attention_kernel_impl`` and ``flash_attention_backward_kernel_impl``) walks each
(batch, head) in tiles of ``q_block`` query rows by up to 512 keys, where ``q_block`` is 32 below a
query length of 192, 64 below 768 and 256 from there, and a causal kernel skips the tiles above the
diagonal. Every tile runs a handful of small GEMM calls plus per-row softmax work; with 32-row
tiles the fixed cost of those calls, not the arithmetic, sets the time (the bf16 backward at
sequence 64 runs at a tenth of its rate at 512). A measured ``tile_s`` per phase and dtype prices
that: ``FLOPs / rate + tiles * tile_s`` (``coplan.cost.kernels``), fitted by ``coplan calibrate``.

GPU presets carry no tiling: their attention is priced by the shape-derated roofline alone.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from coplan.hardware._fields import DTYPES, FrozenMap, Reader, anchored, check_int, check_number, fail, kind

#: The phases a tile cost is given for (``tile_s`` keys are ``<phase>.<dtype>``).
PHASES = ("forward", "backward")


@dataclass(frozen=True, slots=True)
class AttentionTiling:
    """``query_blocks``: (minimum query length, query rows per tile), ascending from length 0;
    ``kv_block``: keys per tile; ``tile_s``: seconds per tile beyond its FLOPs, by
    ``"<phase>.<dtype>"`` (a missing key: no per-tile cost for that kernel)."""

    query_blocks: tuple[tuple[int, int], ...]
    kv_block: int
    tile_s: Mapping[str, float] = field(default_factory=FrozenMap)

    def __post_init__(self) -> None:
        src = "attention tiling"
        put = object.__setattr__
        blocks = tuple(
            (
                check_int(src, f"query_blocks[{i}][0]", lo, minimum=0),
                check_int(src, f"query_blocks[{i}][1]", rows),
            )
            for i, (lo, rows) in enumerate(_pairs(src, self.query_blocks))
        )
        if not blocks or blocks[0][0] != 0:
            fail(src, "query_blocks", "must start at query length 0")
        if any(b[0] <= a[0] for a, b in itertools.pairwise(blocks)):
            fail(src, "query_blocks", "minimum query lengths must increase")
        put(self, "query_blocks", blocks)
        put(self, "kv_block", check_int(src, "kv_block", self.kv_block))
        if not isinstance(self.tile_s, Mapping):
            fail(src, "tile_s", f"expected an object of <phase>.<dtype> -> seconds, got {kind(self.tile_s)}")
        costs: dict[str, float] = {}
        for key, value in self.tile_s.items():
            phase, _, dtype = str(key).partition(".")
            if phase not in PHASES or dtype not in DTYPES:
                fail(src, f"tile_s.{key}", f"expected <{'|'.join(PHASES)}>.<{'|'.join(DTYPES)}>")
            costs[key] = check_number(src, f"tile_s.{key}", value, strict=False)
        put(self, "tile_s", FrozenMap(costs))

    def q_block(self, q_len: int) -> int:
        rows = self.query_blocks[0][1]
        for lo, r in self.query_blocks:
            if q_len >= lo:
                rows = r
        return max(1, min(rows, q_len))

    def tiles(self, q_len: int, kv_len: int, causal: bool = True) -> int:
        """Tiles one (batch, head) computes: per query tile, the key tiles up to its last row (all
        of them without a causal mask)."""
        if q_len <= 0 or kv_len <= 0:
            return 0
        qb, kvb = self.q_block(q_len), max(1, min(self.kv_block, kv_len))
        if not causal:
            return math.ceil(q_len / qb) * math.ceil(kv_len / kvb)
        total = 0
        for start in range(0, q_len, qb):
            keys = min(start + min(qb, q_len - start), kv_len)
            total += math.ceil(keys / kvb)
        return total

    def cost(self, phase: str, dtype: str) -> float:
        return self.tile_s.get(f"{phase}.{dtype}", 0.0)

    def with_costs(self, tile_s: Mapping[str, float]) -> AttentionTiling:
        return AttentionTiling(self.query_blocks, self.kv_block, tile_s)

    def to_dict(self) -> dict[str, Any]:
        return {
            "query_blocks": [list(b) for b in self.query_blocks],
            "kv_block": self.kv_block,
            "tile_s": dict(self.tile_s),
        }

    @classmethod
    def read(cls, r: Reader) -> AttentionTiling:
        """From the ``attention_tiles`` object a device reader ``r`` points at."""
        r.check_keys(("query_blocks", "kv_block"), ("tile_s",))
        costs = r.numbers("tile_s") if "tile_s" in r.data else {}
        kv = r.integer("kv_block")
        with anchored(r.source, r.path):
            return cls(r.data["query_blocks"], kv, costs)


def _pairs(src: str, value: object) -> Sequence[tuple[Any, Any]]:
    if not isinstance(value, Sequence) or isinstance(value, str):
        fail(src, "query_blocks", f"expected a list of [min query length, rows] pairs, got {kind(value)}")
    for i, item in enumerate(value):
        if not isinstance(item, Sequence) or isinstance(item, str) or len(item) != 2:
            fail(src, f"query_blocks[{i}]", "expected a [min query length, rows] pair")
    return value


#: PyTorch's CPU flash attention tiling (see the module docstring), forward and backward alike.
TORCH_CPU_FLASH = AttentionTiling(query_blocks=((0, 32), (192, 64), (768, 256)), kv_block=512)
