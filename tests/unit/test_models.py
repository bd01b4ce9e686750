"""The built-in transformers start where real GPT training starts: GPT-2's initialisation."""

from __future__ import annotations

import math

import pytest
import torch

from coplan.models.spec import PRESETS
from coplan.models.transformer import Transformer, example_batch


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny", "moe-tiny"])
def test_untrained_loss_is_near_uniform_prediction(name: str) -> None:
    # with N(0, 0.02) weights the logits are near zero, so the loss is ~ln(vocab); PyTorch's module
    # defaults (N(0, 1) embeddings, tied to the LM head in gpt-tiny) start gpt-tiny at a loss of ~44,
    # and the untied presets 0.15-0.23 above ln(vocab)
    spec = PRESETS[name]
    torch.manual_seed(0)
    model = Transformer(spec)
    with torch.no_grad():
        loss = model(*example_batch(spec, 4, 64)).item()
    assert abs(loss - math.log(spec.vocab_size)) < 0.1, loss


def test_weights_follow_gpt2_initialisation() -> None:
    spec = PRESETS["gpt-tiny"]
    torch.manual_seed(0)
    model = Transformer(spec)
    residual = 0.02 / math.sqrt(2 * spec.n_layers)
    for name, p in model.named_parameters():
        if "ln" in name:  # norms keep their ones and zeros
            expected = 0.0 if name.endswith("bias") else 1.0
            assert torch.all(p == expected), name
        elif name.endswith("bias"):
            assert torch.all(p == 0), name
        else:
            std = residual if "c_proj" in name else 0.02
            # thousands of draws per tensor: the sample std is within a few percent of the true one
            assert p.std().item() == pytest.approx(std, rel=0.1), name
            assert abs(p.mean().item()) < 0.2 * std, name


def test_moe_experts_follow_gpt2_initialisation() -> None:
    spec = PRESETS["moe-tiny"]
    torch.manual_seed(0)
    moe = Transformer(spec).h[0].mlp
    assert moe.w_fc.std().item() == pytest.approx(0.02, rel=0.1)
    assert moe.w_proj.std().item() == pytest.approx(0.02 / math.sqrt(2 * spec.n_layers), rel=0.1)


@pytest.mark.parametrize(
    ("name", "published"),
    [
        # Meta, "The Llama 3 Herd of Models" (405B); NVIDIA, Nemotron-4 340B technical report (340B)
        # and Nemotron-4 15B (arXiv 2402.16819: 3.2B embedding + 12.5B other parameters); the
        # nominal GPT-3 5B / 20B sizes of NeMo's recipes, and GPT-3 175B (Brown et al. 2020)
        ("llama3-405b", 405e9),
        ("llama3.1-405b", 405e9),
        ("nemotron4-340b", 340e9),
        ("nemotron4-15b", 15.7e9),
        ("gpt3-5b", 5e9),
        ("gpt3-20b", 20e9),
        ("gpt3-175b", 175e9),
    ],
)
def test_published_model_presets_have_their_published_size(name: str, published: float) -> None:
    assert abs(PRESETS[name].param_count() / published - 1) < 0.015


def test_repeated_kv_heads_compute_what_grouped_query_attention_does() -> None:
    import torch.nn.functional as F

    from coplan.models.transformer import kv_heads_for

    torch.manual_seed(0)
    q = torch.randn(2, 8, 16, 4, dtype=torch.float64)
    k, v = torch.randn(2, 2, 16, 4, dtype=torch.float64), torch.randn(2, 2, 16, 4, dtype=torch.float64)
    grouped = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    k2, v2, gqa = kv_heads_for(q, k, v, expand=True)
    assert not gqa and k2.shape == q.shape == v2.shape
    torch.testing.assert_close(F.scaled_dot_product_attention(q, k2, v2, is_causal=True), grouped)
    assert kv_heads_for(q, k, v, expand=False)[2] is True
    assert kv_heads_for(q, q, q, expand=True) == (q, q, False)
