"""FSDP under a pipeline (``TrainingConfig.fsdp_pipeline``, ``coplan.cost.zero.pipelined_fsdp``):
torchtitan keeps a stage's FSDP units gathered through the step and reduce-scatters its gradients
once, after the stage's last backward, where FSDP's hooks alone gather and reduce every
microbatch."""

from __future__ import annotations

import json

import pytest

from coplan.cost import CostModel, TrainingConfig, load_stack
from coplan.cost.config import ConfigError
from coplan.cost.optimizer import accumulation_s
from coplan.cost.zero import pipelined_fsdp
from coplan.hardware import load_cluster
from coplan.models.spec import PRESETS

LLAMA = PRESETS["llama-tiny"]


def test_gathers_once_and_reduces_after_the_last_backward() -> None:
    # three units of 10 s forward each: only the first gather (after the root's) shows; the
    # reduce-scatters follow one another with nothing to hide behind
    first, reduce = pipelined_fsdp(3, 1.0, 2.0, 0.0, (0.5, 0.25, 0.0), 30.0, 0.0)
    assert first == pytest.approx(0.5 + 1.0)
    assert reduce == pytest.approx(3 * 2.0 + 0.25)
    # no compute to hide behind (no overlap): every gather shows
    first, _ = pipelined_fsdp(3, 1.0, 2.0, 0.0, (0.5, 0.25, 0.0), 0.0, 0.0)
    assert first == pytest.approx(0.5 + 3 * 1.0)
    # HYBRID_SHARD: each shard's all-reduce across the replicas after its reduce-scatter, on a
    # stream of its own; the longer all-reduces set the pace
    _, reduce = pipelined_fsdp(3, 1.0, 2.0, 3.0, (0.5, 0.25, 1.0), 30.0, 0.0)
    assert reduce == pytest.approx(2.0 + 3 * 3.0 + 1.0)


def _config(microbatches: int = 4, pp: int = 2) -> TrainingConfig:
    dp = 8 // pp
    base = TrainingConfig(pp=pp, dp=dp, global_batch=dp * microbatches, microbatch=1, seq=64, zero=3)
    return load_stack("torchtitan").configure(base)


def test_torchtitan_keeps_its_units_gathered_through_a_pipeline_step() -> None:
    config = _config()
    assert config.fsdp_pipeline == "step" and config.fsdp_per_step
    assert config.to_dict()["fsdp_pipeline"] == "step"
    plain = TrainingConfig(pp=2, dp=4, global_batch=16, zero=3)
    for name in ("coplan", "deepspeed", "megatron"):
        assert load_stack(name).configure(plain).fsdp_pipeline == "microbatch"
    assert "fsdp_pipeline" not in config.with_(fsdp_pipeline="microbatch").to_dict()
    # no pipeline, or nothing sharded: nothing to keep gathered
    assert not _config(pp=1).fsdp_per_step
    assert not config.with_(zero=0).fsdp_per_step
    with pytest.raises(ConfigError, match="fsdp_pipeline"):
        TrainingConfig(fsdp_pipeline="sometimes")


def test_no_collectives_per_microbatch_and_the_gathered_stage_in_memory() -> None:
    cluster = load_cluster("dgx-h100", 8)
    model = CostModel(spec=LLAMA)
    step = _config()
    each = step.with_(fsdp_pipeline="microbatch")
    on, off = model.estimate(cluster, step), model.estimate(cluster, each)
    device = cluster.groups[0].device
    rate = device.memory_bandwidth * device.efficiency_of("memory")
    d = step.shard_ranks
    for a, b in zip(on.stages, off.stages, strict=True):
        assert a.zero_comm_s == 0.0 < b.zero_comm_s
        # FSDP2's fp32 shard counted as the parameters (4 bytes each over the shard ranks): the
        # stage's local parameters, gathered in 16 bits and their gradients accumulated in fp32
        local = b.memory.params_bytes * d / 4
        assert a.memory.params_bytes - b.memory.params_bytes == pytest.approx(2 * local, rel=1e-12)
        assert a.memory.grads_bytes - b.memory.grads_bytes == pytest.approx(4 * local, rel=1e-12)
        assert a.memory.optimizer_bytes == b.memory.optimizer_bytes
        # each microbatch's gradient cast (the first) or added (the later ones) into fp32
        added = accumulation_s("fsdp-unsharded", local, step.num_microbatches, rate)
        assert a.backward_s - b.backward_s == pytest.approx(added, rel=1e-9)
        assert a.forward_s == b.forward_s
    # the first stage ends its backward last: its whole reduction shows
    assert on.stages[0].dp_comm_s > 0.0 and on.stages[0].param_gather_s > 0.0
    assert on.breakdown_s["zero_comm"] < off.breakdown_s["zero_comm"]


def test_the_step_gathers_and_reduces_once_whatever_the_microbatches() -> None:
    cluster = load_cluster("dgx-h100", 8)
    model = CostModel(spec=LLAMA)
    got = {}
    for mode in ("step", "microbatch"):
        for m in (4, 8):
            est = model.estimate(cluster, _config(m).with_(fsdp_pipeline=mode))
            got[mode, m] = est.breakdown_s["zero_comm"] + est.breakdown_s["dp_comm"]
    assert got["step", 8] == pytest.approx(got["step", 4], rel=1e-12)
    assert got["microbatch", 8] == pytest.approx(2 * got["microbatch", 4], rel=0.05)


def test_without_a_pipeline_the_setting_prices_nothing() -> None:
    cluster = load_cluster("dgx-h100", 8)
    model = CostModel(spec=LLAMA)
    config = _config(pp=1)
    a = model.estimate(cluster, config)
    b = model.estimate(cluster, config.with_(fsdp_pipeline="microbatch"))
    assert a.step_time_s == b.step_time_s and a.memory.peak_bytes == b.memory.peak_bytes


def test_cli_prices_fsdp_under_a_pipeline_as_named(cli) -> None:  # type: ignore[no-untyped-def]
    args = ("estimate", "--model", "llama-tiny", "--gpus", "8", "--pp", "2", "--zero", "3")
    args += ("--stack", "torchtitan", "--global-batch", "16", "--json")
    peak = {}
    for mode in ("step", "microbatch"):
        code, out, err = cli(*args, "--fsdp-pipeline", mode)
        assert code == 0, err
        data = json.loads(out)
        assert data["config"].get("fsdp_pipeline", "microbatch") == mode
        peak[mode] = data["memory"]["peak_bytes"]
    assert peak["step"] > peak["microbatch"]
    code, _, err = cli(*args, "--fsdp-pipeline", "sometimes")
    assert code == 2 and len(err.strip().splitlines()) == 1
