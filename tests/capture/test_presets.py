"""GPT-2 124M's parameter count captured and built, every preset built synthetically, and large
captures against their synthetic graphs."""

from __future__ import annotations

import pytest

from coplan.capture.api import capture_spec
from coplan.capture.synthetic import build_graph
from coplan.ir.checker import check
from coplan.models.spec import PRESETS


@pytest.mark.capture
def test_gpt2_124m_has_124_4m_params_captured_and_synthetic() -> None:
    spec = PRESETS["gpt2-124m"]
    cap = capture_spec(spec, batch=1, seq=256)
    syn = build_graph(spec, batch=1, seq=256)
    assert cap.param_count == syn.param_count == 124_439_808  # 124.4M with tied embeddings
    assert cap.flops == syn.flops
    assert cap.activation_bytes == syn.activation_bytes
    assert len(cap.blocks) == len(syn.blocks) == 12


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_builds_synthetically(name: str) -> None:
    spec = PRESETS[name]
    g = build_graph(spec, batch=1, seq=min(spec.seq_len, 2048))
    assert g.param_count == spec.param_count()
    assert len(g.blocks) == spec.n_layers
    if spec.n_layers <= 48:  # the checker is linear but the 1T model is a benchmark, not a unit test
        assert check(g) == []


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama2-7b", "gpt2-1.5b", "llama3-8b"])
def test_large_capture_agrees_with_synthetic(name: str) -> None:
    spec = PRESETS[name]
    cap = capture_spec(spec, batch=1, seq=512)
    syn = build_graph(spec, batch=1, seq=512)
    assert check(cap) == []
    assert cap.param_count == syn.param_count == spec.param_count()
    assert cap.flops == syn.flops
    assert cap.activation_bytes == syn.activation_bytes
