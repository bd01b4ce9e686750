"""Full recomputation of only some blocks of each model chunk (``TrainingConfig.recompute_layers``:
Megatron-LM's ``--recompute-method block --recompute-num-layers N``), and the per-layer policies of
torchtitan and fms-fsdp counted by their own rules (``cost.checkpoint.checkpointed_blocks``)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from coplan.cost import CostModel, TrainingConfig
from coplan.cost.config import ConfigError
from coplan.hardware import load_cluster
from coplan.models.spec import PRESETS

# eight blocks: chunks of several blocks under pp 2 x vpp 2
LLAMA = replace(PRESETS["llama-tiny"], n_layers=8)
GPT = replace(PRESETS["gpt-tiny"], n_layers=8)


def _est(spec, gpus: int = 1, **kw):  # type: ignore[no-untyped-def]
    base = TrainingConfig(microbatch=2, global_batch=8 * kw.get("dp", 1), seq=64, **kw)
    return CostModel(spec=spec).estimate(load_cluster("dgx-h100", gpus), base)


@pytest.mark.parametrize("spec", [LLAMA, GPT], ids=["llama", "gpt"])
def test_every_block_of_each_chunk_is_full_recomputation(spec) -> None:  # type: ignore[no-untyped-def]
    for pp, vpp in ((1, 1), (2, 1), (2, 2)):
        layers = spec.n_layers // (pp * vpp)
        full = _est(spec, pp, pp=pp, vpp=vpp, recompute="full")
        same = _est(spec, pp, pp=pp, vpp=vpp, recompute="full", recompute_layers=layers)
        assert same.step_time_s == full.step_time_s
        assert same.memory.peak_bytes == full.memory.peak_bytes
        assert same.memory.activations_bytes == full.memory.activations_bytes
        # more than a chunk holds is every block of it
        more = _est(spec, pp, pp=pp, vpp=vpp, recompute="full", recompute_layers=layers + 3)
        assert more.memory.activations_bytes == full.memory.activations_bytes


@pytest.mark.parametrize("spec", [LLAMA, GPT], ids=["llama", "gpt"])
def test_saved_bytes_and_time_are_linear_in_the_recomputed_blocks(spec) -> None:  # type: ignore[no-untyped-def]
    """Each recomputed block trades its saved set for its input: the stored activations of N of L
    blocks recomputed lie exactly on the line from no recomputation to full (the boundary where
    the recomputed blocks end holds one block input that neither side counts, and the embedding
    output one that both count), and so does the step's time on one GPU."""
    n = spec.n_layers
    none = _est(spec, recompute="none")
    full = _est(spec, recompute="full")
    for k in range(1, n + 1):
        got = _est(spec, recompute="full", recompute_layers=k)
        share = k / n
        want = none.memory.activations_bytes + share * (
            full.memory.activations_bytes - none.memory.activations_bytes
        )
        assert got.memory.activations_bytes == pytest.approx(want, rel=1e-12)
        assert got.step_time_s == pytest.approx(
            none.step_time_s + share * (full.step_time_s - none.step_time_s), rel=1e-12
        )
        assert got.breakdown_s["recompute"] == pytest.approx(share * full.breakdown_s["recompute"], rel=1e-12)


def test_a_pipeline_stage_recomputes_its_first_blocks_per_chunk() -> None:
    spec = LLAMA
    none = _est(spec, 2, pp=2, vpp=2, recompute="none")
    full = _est(spec, 2, pp=2, vpp=2, recompute="full")
    one = _est(spec, 2, pp=2, vpp=2, recompute="full", recompute_layers=1)
    assert full.memory.activations_bytes < one.memory.activations_bytes < none.memory.activations_bytes
    assert none.breakdown_s["recompute"] == 0 < one.breakdown_s["recompute"] < full.breakdown_s["recompute"]


def test_refused_without_full_recomputation_or_a_positive_count() -> None:
    with pytest.raises(ConfigError, match=r"recompute_layers.*needs recompute 'full'"):
        TrainingConfig(recompute="selective", recompute_layers=2)
    with pytest.raises(ConfigError, match=r"recompute_layers.*positive"):
        TrainingConfig(recompute="full", recompute_layers=0)
    with pytest.raises(ConfigError, match=r"recompute_layers.*integer"):
        TrainingConfig(recompute="full", recompute_layers=True)  # type: ignore[arg-type]
    # one stage fully recomputing is enough: the count applies to the stages that do
    TrainingConfig(pp=2, recompute_per_stage=("full", "none"), recompute_layers=2)


def test_written_only_when_set() -> None:
    assert "recompute_layers" not in TrainingConfig(recompute="full").to_dict()
    assert TrainingConfig(recompute="full", recompute_layers=3).to_dict()["recompute_layers"] == 3


def test_estimate_flag(cli) -> None:  # type: ignore[no-untyped-def]
    args = ("estimate", "--model", "llama-tiny", "--cluster", "dgx-h100", "--gpus", "1", "--seq", "64")
    code, out, _ = cli(*args, "--recompute", "full", "--recompute-layers", "1", "--json")
    assert code == 0
    got = json.loads(out)
    assert got["config"]["recompute_layers"] == 1
    code, out, _ = cli(*args, "--recompute", "full", "--json")
    assert got["breakdown_s"]["recompute"] < json.loads(out)["breakdown_s"]["recompute"]
    code, _, err = cli(*args, "--recompute-layers", "1")
    assert code == 2
    assert err.strip().count("\n") == 0 and "recompute_layers" in err
