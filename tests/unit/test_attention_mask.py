"""Causal and bidirectional attention: what a captured SDPA's mask makes the cost model price."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from coplan.capture.api import capture_module
from coplan.cost.parts import CAUSAL_FRACTION, attention_share, model_flops
from coplan.ir.oprules import IS_CAUSAL_AT, attention_causal
from coplan.ir.types import OpKind, Phase


@pytest.mark.parametrize("name", sorted(IS_CAUSAL_AT))
def test_is_causal_positions_match_pytorchs_schemas(name):
    packet = getattr(torch.ops.aten, name, None)
    if packet is None:
        pytest.skip(f"this PyTorch has no aten.{name}")
    args = [a.name for a in packet.default._schema.arguments if not a.kwarg_only]
    assert args.index("is_causal") == IS_CAUSAL_AT[name]


class _Attend(nn.Module):
    def __init__(self, causal: bool) -> None:
        super().__init__()
        self.qkv = nn.Linear(64, 192)
        self.causal = causal

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 4, 16).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal).sum()


def _attention_ops(causal: bool):
    with FakeTensorMode(allow_non_fake_inputs=True):
        m = _Attend(causal)
        x = torch.randn(2, 32, 64)
    g = capture_module(m, (x,), batch=2, seq=32)
    return [op for op in g.ops if op.kind is OpKind.ATTENTION]


@pytest.mark.parametrize("causal", [True, False])
def test_a_captured_sdpa_says_whether_it_is_causal(causal):
    ops = _attention_ops(causal)
    assert {op.phase for op in ops} == {Phase.FORWARD, Phase.BACKWARD}
    assert all(attention_causal(op) is causal for op in ops)
    share = CAUSAL_FRACTION if causal else 1.0
    assert all(attention_share(op) == share for op in ops)
    # model FLOPs count a bidirectional attention whole, a causal one at its computed half
    assert model_flops(ops) == pytest.approx(share * sum(op.flops for op in ops))


def test_a_bidirectional_attention_kernel_costs_twice_the_causal_one():
    import dataclasses

    from coplan.cost.config import TrainingConfig
    from coplan.cost.kernels import Rates, Scale, kernel_time
    from coplan.cost.parts import ZERO, Kernel
    from coplan.hardware import load_cluster

    dev = load_cluster("dgx-h100", 1).groups[0].device
    causal = Kernel(
        Phase.FORWARD, "attention", 0, 4.0 * 32 * 4096 * 4096 * 128, 0.0, ZERO, attn=(32, 4096, 4096, 128)
    )
    full = dataclasses.replace(causal, share=1.0)
    r = Rates.of(dev, "bf16")
    s = Scale.of(TrainingConfig())
    launch = r.launch_s
    assert kernel_time(full, r, s) - launch == pytest.approx(2 * (kernel_time(causal, r, s) - launch))
