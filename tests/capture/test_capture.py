"""Capture of real PyTorch training steps into the IR, checked against PyTorch's own accounting."""

from __future__ import annotations

import pytest
import torch
from autograd_saved import saved_storages
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

from coplan.capture.api import capture_hf, capture_module, capture_spec
from coplan.capture.synthetic import build_graph
from coplan.errors import CaptureError, SpecError
from coplan.ir.checker import check
from coplan.ir.fingerprint import fingerprint
from coplan.ir.types import OpKind, Phase, TensorRole
from coplan.models.hf import hf_model
from coplan.models.spec import PRESETS
from coplan.models.transformer import Transformer, example_batch

pytestmark = pytest.mark.capture
TINY = ["gpt-tiny", "llama-tiny", "moe-tiny", "encoder-tiny"]


@pytest.fixture(scope="module", params=TINY)
def captured(request: pytest.FixtureRequest):
    spec = PRESETS[request.param]
    return spec, capture_spec(spec, batch=2, seq=32)


def _flop_counter_total(make_model, call) -> int:
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = make_model()
        with FlopCounterMode(display=False) as fc:
            call(model).backward()
    return fc.get_total_flops()


def test_captured_graph_is_valid(captured) -> None:
    _, g = captured
    assert check(g) == []


def test_param_count_matches_spec_and_module(captured) -> None:
    spec, g = captured
    with FakeTensorMode():
        n = sum(p.numel() for p in Transformer(spec).parameters())
    assert g.param_count == spec.param_count() == n


def test_flops_agree_with_flop_counter_mode(captured) -> None:
    spec, g = captured

    def call(m):
        idx, tgt = example_batch(spec, 2, 32)
        return m(idx, tgt)

    assert g.flops == _flop_counter_total(lambda: Transformer(spec), call)
    # attention is counted (the CPU flash kernel has a registered formula)
    assert sum(op.flops for op in g.ops if op.kind is OpKind.ATTENTION) > 0


def test_phases_blocks_and_links(captured) -> None:
    spec, g = captured
    assert len(g.blocks) == spec.n_layers
    phases = {op.phase for op in g.ops}
    assert phases == {Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER}
    for op in g.ops_in(Phase.BACKWARD):
        assert g.ops[op.forward_op].phase is Phase.FORWARD
    paths = {op.module_path for op in g.ops}
    assert "h.1.mlp.c_proj" in paths or "h.1.mlp" in paths
    assert "h.0.attn.c_attn" in paths
    # every parameter has exactly one gradient, of its shape
    grads = [t for t in g.tensors if t.grad_of is not None]
    assert sorted(t.grad_of for t in grads) == sorted(p.id for p in g.parameters)
    # AdamW keeps two moments and a step per parameter
    assert sum(
        1 for t in g.tensors if t.role is TensorRole.OPTIMIZER_STATE and t.producer is None
    ) == 3 * len(g.parameters)


def test_matmul_backward_flops_are_twice_forward(captured) -> None:
    _, g = captured
    by_phase = g.flops_by_phase()
    attn_f = sum(op.flops for op in g.ops if op.kind is OpKind.ATTENTION and op.phase is Phase.FORWARD)
    attn_b = sum(op.flops for op in g.ops if op.kind is OpKind.ATTENTION and op.phase is Phase.BACKWARD)
    assert by_phase[Phase.BACKWARD] - attn_b == 2 * (by_phase[Phase.FORWARD] - attn_f)
    assert by_phase[Phase.OPTIMIZER] == 0


def test_gpt_forward_flops_exact() -> None:
    """Analytic count for the tiny GPT: 2*N*(params in matmuls) + attention + LM head."""
    spec = PRESETS["gpt-tiny"]
    b, t = 2, 32
    n = b * t
    d, f, v, h = spec.d_model, spec.ffn, spec.vocab_size, spec.n_heads
    per_layer = 2 * n * (d * 3 * d + d * d + 2 * d * f)
    attn = 4 * b * h * t * t * (d // h)  # QK^T and PV, no causal discount (FlopCounterMode's convention)
    expect = spec.n_layers * (per_layer + attn) + 2 * n * d * v
    g = capture_spec(spec, batch=b, seq=t)
    assert g.flops_by_phase()[Phase.FORWARD] == expect


def _autograd_saved_bytes(spec) -> int:
    """Bytes of the distinct activation storages eager autograd packs for one forward pass."""
    torch.manual_seed(0)
    model = Transformer(spec)
    idx, tgt = example_batch(spec, 2, 32)
    skip = {p.untyped_storage().data_ptr() for p in [*model.parameters(), *model.buffers(), idx, tgt]}
    with saved_storages(skip) as storages:
        model(idx, tgt)
    return sum(storages.values())


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny", "encoder-tiny"])
def test_saved_activation_bytes_match_autograd(name: str) -> None:
    """For dense models the captured saved set is what eager autograd packs (saved_tensors_hooks)."""
    spec = PRESETS[name]
    measured = _autograd_saved_bytes(spec)
    g = capture_spec(spec, batch=2, seq=32)
    # within 8 bytes: the loss's scalar total_weight is counted by the graph, not by the hook
    assert abs(g.activation_bytes - measured) <= 8, (name, g.activation_bytes, measured)


@pytest.mark.parametrize("name", TINY)
def test_synthetic_agrees_with_capture(name: str) -> None:
    spec = PRESETS[name]
    cap = capture_spec(spec, batch=2, seq=32)
    syn = build_graph(spec, batch=2, seq=32)
    assert check(syn) == []
    assert syn.flops == cap.flops
    assert syn.param_count == cap.param_count
    assert syn.activation_bytes == cap.activation_bytes
    assert {p.param_name: p.shape for p in syn.parameters} == {p.param_name: p.shape for p in cap.parameters}
    assert len(syn.blocks) == len(cap.blocks)


def test_encoder_attention_is_bidirectional_in_capture_and_synthetic() -> None:
    """An encoder's attention, forward and backward, is priced whole (no causal mask) whether the
    graph is captured or built from the spec, and the two agree on the step's model FLOPs; the
    decoder of the same sizes computes the score matrix's causal half."""
    from dataclasses import replace

    from coplan.cost.parts import CAUSAL_FRACTION, attention_share, model_flops

    enc = PRESETS["encoder-tiny"]
    dec = replace(enc, causal=True, name="decoder-tiny")
    graphs = {
        "captured": capture_spec(enc, batch=2, seq=32),
        "synthetic": build_graph(enc, batch=2, seq=32),
    }
    for how, g in graphs.items():
        attn = [op for op in g.ops if op.kind is OpKind.ATTENTION]
        assert {op.phase for op in attn} == {Phase.FORWARD, Phase.BACKWARD}, how
        assert all(attention_share(op) == 1.0 for op in attn), how
    cap, syn = (model_flops(g.ops) for g in graphs.values())
    assert cap == syn
    d = build_graph(dec, batch=2, seq=32)
    attn_flops = sum(op.flops for op in d.ops if op.kind is OpKind.ATTENTION)
    assert syn - model_flops(d.ops) == pytest.approx(attn_flops * (1 - CAUSAL_FRACTION))


def test_fingerprint_stable_and_sensitive() -> None:
    spec = PRESETS["gpt-tiny"]
    a = capture_spec(spec, batch=2, seq=32)
    b = capture_spec(spec, batch=2, seq=32)
    assert fingerprint(a) == fingerprint(b)
    assert fingerprint(capture_spec(spec, batch=2, seq=16)) != fingerprint(a)
    assert fingerprint(capture_spec(PRESETS["llama-tiny"], batch=2, seq=32)) != fingerprint(a)


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
def test_hugging_face_models(name: str) -> None:
    pytest.importorskip("transformers")
    spec = PRESETS[name]
    g = capture_hf(spec, batch=2, seq=32)
    assert check(g) == []
    assert g.param_count == spec.param_count()
    assert len(g.blocks) == spec.n_layers
    assert g.meta.block_container in ("transformer.h", "model.layers")

    def call(m):
        idx, tgt = example_batch(spec, 2, 32)
        return m(input_ids=idx, labels=tgt).loss

    assert g.flops == _flop_counter_total(lambda: hf_model(spec), call)


def test_hugging_face_bert_is_the_encoder_plus_what_bert_adds() -> None:
    """An encoder spec captures as ``BertForMaskedLM``: bidirectional attention both ways, and
    exactly what BERT has beyond coplan's encoder: token-type embeddings (2 x d), the head's dense
    layer (d x d + d) and norm (2d), the output bias (vocab); the dense layer's FLOPs, 6 n d^2."""
    pytest.importorskip("transformers")
    from coplan.cost.parts import attention_share

    spec = PRESETS["encoder-tiny"]
    d, n = spec.d_model, 2 * 32
    g, own = capture_hf(spec, batch=2, seq=32), capture_spec(spec, batch=2, seq=32)
    assert check(g) == []
    assert len(g.blocks) == spec.n_layers
    attn = [op for op in g.ops if op.kind is OpKind.ATTENTION]
    assert len(attn) == 2 * spec.n_layers and all(attention_share(op) == 1.0 for op in attn)
    assert g.param_count - own.param_count == 2 * d + d * d + d + 2 * d + spec.vocab_size
    assert g.flops - own.flops == 6 * n * d * d


def test_user_module_and_optimizer() -> None:
    """Any module + inputs + loss + optimizer: here a plain MLP trained with SGD and momentum."""
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    x = torch.randn(8, 16)
    g = capture_module(
        model,
        (x,),
        loss_fn=lambda out: out.pow(2).mean(),
        optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    )
    assert check(g) == []
    assert g.param_count == 16 * 32 + 32 + 32 * 4 + 4
    assert g.meta.optimizer == "SGD"
    assert g.flops == 3 * 2 * 8 * (16 * 32 + 32 * 4) - 2 * 8 * 16 * 32  # no gradient for the input x


def test_bad_loss_is_a_clear_error() -> None:
    model = torch.nn.Linear(4, 4)
    with pytest.raises(CaptureError, match="not a scalar"):
        capture_module(model, (torch.randn(2, 4),))


def test_sequence_longer_than_model_is_refused() -> None:
    with pytest.raises(SpecError, match="exceeds"):
        capture_spec(PRESETS["gpt-tiny"], batch=1, seq=128)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("base", ["gpt-tiny", "llama-tiny", "moe-tiny", "gelu-moe", "relu2", "relu2-moe"])
def test_synthetic_agrees_with_capture_across_variants(base: str, bias: bool) -> None:
    """Bias on and off (LayerNorm without bias, expert biases), a GELU mixture of experts, and
    squared ReLU (Nemotron-4's activation) dense and in experts."""
    from dataclasses import replace

    spec = PRESETS[base] if base in PRESETS else PRESETS["gpt-tiny"]
    if base.startswith("relu2"):
        spec = replace(spec, activation="relu2")
    if base.endswith("-moe"):
        spec = replace(spec, n_experts=4, top_k=2)
    spec = replace(spec, bias=bias, name=f"{base}-{bias}")
    cap, syn = capture_spec(spec, batch=2, seq=32), build_graph(spec, batch=2, seq=32)
    assert cap.param_count == syn.param_count == spec.param_count()
    assert cap.flops == syn.flops
    assert cap.activation_bytes == syn.activation_bytes
