"""``coplan inspect`` on the two models the benchmark times (slow tier: about a minute each on two
CPU cores; ``benchmarks/bench_inspect.py`` reports the times)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.compile]


@pytest.mark.parametrize("model", ["gpt2-124m", str(ROOT / "benchmarks/data/llama-style-124m.json")])
def test_a_real_model_step(cli, model: str) -> None:
    code, out, err = cli("inspect", "--model", model, "--no-record", "--steps", "1", "--json")
    assert code == 0, err
    rec = json.loads(out)
    assert [g["name"] for g in rec["graphs"]] == ["forward", "backward"]
    assert rec["recompiles"] == 0 and rec["graph_breaks"] == []
    assert rec["kernels"] == len(rec["kernel_table"]) > 12  # at least a kernel per block
    # on a CPU the only kernels Inductor does not generate are the flash-attention calls, one per
    # block each way
    assert {f["op"].split(".")[1] for f in rec["fallbacks"]} == {
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention_for_cpu_backward",
    }
    assert all(f["count"] == 12 for f in rec["fallbacks"])
    assert all(u["predicted_saving_s"] > 0 and u["reason"] for u in rec["unfused"])
    assert rec["measured"]["step_s"] > 0 and rec["predicted_step_s"] > 0
