"""fp8 quantisation reads the same linear layers from a captured step as from the synthetic build."""

from __future__ import annotations

import pytest

from coplan.capture.api import capture_spec
from coplan.cost import CostModel
from coplan.models.spec import PRESETS


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
def test_captured_and_synthetic_blocks_quantise_alike(name):
    # a capture's linear layers are addmm/mm on views, its RMSNorm elementwise ops in the norm
    # module: the same GEMMs, shards and norm-fed inputs must come out as from the synthetic IR
    spec = PRESETS[name]
    captured = CostModel(graph=capture_spec(spec, 2, 32)).profile(2, 32).templates[0].fp8_gemms
    synthetic = CostModel(spec=spec).profile(2, 32).templates[0].fp8_gemms

    def shape(gemms):
        return [(g.input_elems, g.output_elems, g.weight_elems, g.row_parallel, g.from_norm) for g in gemms]

    assert shape(captured) == shape(synthetic)
    assert len({g.input_key for g in captured}) == len({g.input_key for g in synthetic})
