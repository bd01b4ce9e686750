"""Grouped-query attention's FLOPs on every PyTorch the project supports: PyTorch 2.11's formulas
assert equal query and key/value heads, so coplan hands them the broadcast shape."""

from __future__ import annotations

from typing import Any

import pytest
from torch.utils import flop_counter

from coplan.capture import synthetic
from coplan.capture.flops import query_heads
from coplan.ir.types import OpKind, Phase
from coplan.models.spec import PRESETS


def _strict(fn: Any) -> Any:
    """``fn`` as PyTorch 2.11 had it: key/value with other head counts than the query are refused."""

    def wrapped(*shapes: Any) -> int:
        heads = {s[1] for s in shapes}
        assert len(heads) == 1, f"heads differ: {shapes}"
        return int(fn(*shapes))

    return wrapped


def test_query_heads_broadcasts_key_heads() -> None:
    assert query_heads((2, 32, 2048, 64), (2, 8, 2048, 64)) == (2, 32, 2048, 64)


@pytest.mark.parametrize("strict", [False, True])
def test_gqa_graph_counts_every_query_head(monkeypatch: pytest.MonkeyPatch, strict: bool) -> None:
    if strict:
        monkeypatch.setattr(synthetic, "sdpa_flop_count", _strict(flop_counter.sdpa_flop_count))
        monkeypatch.setattr(
            synthetic, "sdpa_backward_flop_count", _strict(flop_counter.sdpa_backward_flop_count)
        )
    spec = PRESETS["llama-tiny"]
    assert spec.kv_heads < spec.n_heads
    b, t = 2, 64
    g = synthetic.build_graph(spec, batch=b, seq=t)
    attn = [op for op in g.ops if op.kind is OpKind.ATTENTION]
    fwd = [op.flops for op in attn if op.phase is Phase.FORWARD]
    bwd = [op.flops for op in attn if op.phase is Phase.BACKWARD]
    # QK^T and PV: 2 GEMMs of 2*t*t*head_dim FLOPs per query head; backward recomputes QK^T and
    # runs four more (dV, dP, dQ, dK): 2.5x the forward
    per_layer = 2 * (2 * b * spec.n_heads * t * t * spec.head_dim)
    assert fwd == [per_layer] * spec.n_layers
    assert bwd == [per_layer * 5 // 2] * spec.n_layers
