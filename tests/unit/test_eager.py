"""Eager PyTorch's saved tensors for a torchtitan-style Llama block, measured on this CPU against
what the ``torchtitan`` stack prices (``coplan.cost.eager``): with grouped-query attention too,
where ``repeat_kv`` copies the key/value heads before SDPA, which saves the copies."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from coplan.cost import CostModel, TrainingConfig, load_stack
from coplan.cost.eager import gqa_repeat, repeat_kv_saved
from coplan.hardware import load_cluster
from coplan.models.spec import ModelSpec

SEQ, MB = 128, 2


def _spec(layers: int, kv: int) -> ModelSpec:
    return ModelSpec(name="tt", n_layers=layers, d_model=256, n_heads=8, n_kv_heads=kv, ffn_hidden=704,
                     vocab_size=1024, seq_len=SEQ, activation="swiglu", norm="rmsnorm", position="rope",
                     tied_embeddings=False, bias=False)  # fmt: skip


class _Norm(nn.Module):  # torchtitan's RMSNorm: in fp32, then cast back and scaled
    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).type_as(x) * self.weight


def _rope(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * table.view(1, x.shape[1], 1, -1)).flatten(3).type_as(x)


class _Block(nn.Module):
    def __init__(self, s: ModelSpec) -> None:
        super().__init__()
        self.h, self.kv, self.hd = s.n_heads, s.kv_heads, s.head_dim
        self.n1, self.n2 = _Norm(s.d_model), _Norm(s.d_model)
        self.wq = nn.Linear(s.d_model, s.d_model, bias=False)
        self.wk = nn.Linear(s.d_model, self.kv * self.hd, bias=False)
        self.wv = nn.Linear(s.d_model, self.kv * self.hd, bias=False)
        self.wo = nn.Linear(s.d_model, s.d_model, bias=False)
        self.w1, self.w3 = nn.Linear(s.d_model, s.ffn, bias=False), nn.Linear(s.d_model, s.ffn, bias=False)
        self.w2 = nn.Linear(s.ffn, s.d_model, bias=False)

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.n1(x)
        q = _rope(self.wq(h).view(b, t, self.h, self.hd), table)
        k = _rope(self.wk(h).view(b, t, self.kv, self.hd), table)
        v = self.wv(h).view(b, t, self.kv, self.hd)
        rep = self.h // self.kv  # torchtitan's repeat_kv: expand, then a copy by reshape
        k = k[:, :, :, None, :].expand(b, t, self.kv, rep, self.hd).reshape(b, t, self.h, self.hd)
        v = v[:, :, :, None, :].expand(b, t, self.kv, rep, self.hd).reshape(b, t, self.h, self.hd)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.wo(y.transpose(1, 2).reshape(b, t, -1))
        h = self.n2(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


def _measured_per_block(s: ModelSpec) -> float:
    """Bytes one block saves for backward (two blocks less one), bf16, parameters excluded."""
    freqs = 1.0 / (10000.0 ** (torch.arange(0, s.head_dim, 2).float() / s.head_dim))
    table = torch.polar(torch.ones(SEQ, s.head_dim // 2), torch.outer(torch.arange(SEQ).float(), freqs))

    def saved(n: int) -> int:
        torch.manual_seed(0)
        blocks = [_Block(s).to(torch.bfloat16) for _ in range(n)]
        params = {p.untyped_storage().data_ptr() for b in blocks for p in b.parameters()}
        params.add(table.untyped_storage().data_ptr())
        x = torch.randn(MB, SEQ, s.d_model, dtype=torch.bfloat16, requires_grad=True)
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            st = t.untyped_storage()
            if st.data_ptr() not in params and st.data_ptr() != x.untyped_storage().data_ptr():
                seen[st.data_ptr()] = st.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            for b in blocks:
                x = b(x, table)
        return sum(seen.values())

    return float(saved(2) - saved(1))


def _priced_per_block(kv: int) -> float:
    config = load_stack("torchtitan").configure(TrainingConfig(microbatch=MB, global_batch=MB, seq=SEQ))
    cluster = load_cluster("dgx-h100", 1)

    def act(layers: int) -> float:
        return CostModel(spec=_spec(layers, kv)).estimate(cluster, config).memory.activations_bytes

    return act(2) - act(1)


@pytest.mark.capture
@pytest.mark.parametrize("kv", [8, 2])
def test_eager_block_saves_what_the_torchtitan_stack_prices(kv):
    measured = _measured_per_block(_spec(1, kv))
    assert measured == _measured_per_block(_spec(1, 8))  # repeated K/V: as many as the query heads
    # within 0.1%: the IR prices the two blocks' shared storage (the RoPE table) as measured here
    assert _priced_per_block(kv) == pytest.approx(measured, rel=1e-3)


def test_repeat_kv_is_priced_only_for_grouped_query_attention():
    from coplan.capture.synthetic import build_graph

    for kv, expect in ((8, 0.0), (2, 3 * (8 - 2) * 32 * SEQ * MB)):
        g = build_graph(_spec(1, kv), MB, SEQ)
        attn = [op for op in g.ops if op.kind.name == "ATTENTION" and op.forward_op is None]
        assert (gqa_repeat(g, attn[0]) is None) == (kv == 8)
        assert sum(repeat_kv_saved(g, [op.id for op in g.ops])) == expect
