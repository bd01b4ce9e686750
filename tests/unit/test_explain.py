"""The kernel listing adds up to the estimate it explains."""

from __future__ import annotations

import json

import pytest

from coplan.cost import CostModel, TrainingConfig
from coplan.cost.explain import kernel_costs
from coplan.hardware import load_cluster
from coplan.models.spec import PRESETS, ModelSpec

GPT = ModelSpec(name="gpt-test", n_layers=4, d_model=1024, n_heads=16, vocab_size=8192, seq_len=1024)
RELU2 = ModelSpec(
    name="relu2-test", n_layers=2, d_model=512, n_heads=8, vocab_size=1024, seq_len=256, activation="relu2"
)


@pytest.mark.parametrize(
    ("spec", "config"),
    [
        (GPT, TrainingConfig(tp=2, dp=2, microbatch=2, global_batch=8, sequence_parallel=True)),
        (GPT, TrainingConfig(tp=2, pp=2, microbatch=1, global_batch=4, dtype="fp8", sequence_parallel=True)),
        (GPT, TrainingConfig(dp=4, zero=1, microbatch=2, global_batch=16, dtype="fp8", fp8_params=True)),
        # ZeRO-3: the weights' casts at every use, not a share of once per step
        (GPT, TrainingConfig(dp=4, zero=3, microbatch=2, global_batch=16, dtype="fp8")),
        (PRESETS["llama-tiny"], TrainingConfig(tp=2, dp=2, global_batch=2, loss_fusion="native")),
        (GPT, TrainingConfig(dp=4, microbatch=2, global_batch=8, fusion="none", dtype="fp32")),
        # NeMo 2.x's eager squared ReLU: the kernels listed are the eager ones the estimate prices
        (RELU2, TrainingConfig(microbatch=2, global_batch=2, activation_fusion=False)),
        # torch.compile on the blocks, the loss side eager (torchtitan-compile before 2025-04)
        (
            PRESETS["llama-tiny"],
            TrainingConfig(
                microbatch=2, global_batch=2, kernels="inductor", eager_loss=True, flash_attention=True
            ),
        ),
        (PRESETS["llama-tiny"], TrainingConfig(microbatch=2, global_batch=2, kernels="eager", fusion="none")),
    ],
)
def test_kernels_add_up_to_each_stages_compute(spec, config):
    cluster = load_cluster("dgx-h100", config.gpus)
    cm = CostModel(spec=spec)
    est = cm.estimate(cluster, config)
    profile = cm.profile_for(config)
    for st in est.stages:
        rows = kernel_costs(profile, cluster, config, st.index)
        assert sum(r.total_s for r in rows) == pytest.approx(st.forward_s + st.backward_s, rel=1e-9)
        assert [r.total_s for r in rows] == sorted((r.total_s for r in rows), reverse=True)
        assert {r.phase for r in rows} == {"forward", "backward"}
    with pytest.raises(ValueError, match="stage"):
        kernel_costs(profile, cluster, config, config.pp)


def test_what_bounds_each_kernel():
    cluster = load_cluster("dgx-h100", 1)
    big = TrainingConfig(microbatch=8, global_batch=8)
    cm = CostModel(spec=GPT)
    rows = kernel_costs(cm.profile(8, 1024), cluster, big)
    gemm = next(r for r in rows if r.kind == "matmul" and "mlp.c_fc" in r.name and r.phase == "forward")
    assert gemm.bound == "compute" and gemm.dims == "8192 x 4096 x 1024"
    norm = next(r for r in rows if "ln_1" in r.name and r.phase == "forward")
    assert norm.bound == "memory"
    tiny = CostModel(spec=PRESETS["gpt-tiny"])
    rows = kernel_costs(tiny.profile(1, 16), cluster, TrainingConfig(seq=16))
    assert any(r.bound == "launch" for r in rows)


def test_estimate_lists_kernels(cli):
    base = ["estimate", "--model", "gpt-tiny", "--tp", "2", "--gpus", "2", "--sequence-parallel"]
    code, out, _ = cli(*base, "--kernels", "5", "--json")
    assert code == 0
    listed = json.loads(out)["kernels"]
    assert listed["stage"] == 0 and len(listed["rows"]) == 5
    totals = [r["total_s"] for r in listed["rows"]]
    assert totals == sorted(totals, reverse=True)
    code, out, _ = cli(*base, "--kernels", "3")
    assert code == 0 and "most expensive kernels" in out
    code, out, err = cli(*base, "--kernels", "-1")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and "--kernels" in err
