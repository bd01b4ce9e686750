"""How the AdamW update runs, priced: fused, PyTorch's multi-tensor form and its per-parameter loop."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from coplan.cost import ConfigError, CostModel, TrainingConfig
from coplan.cost.optimizer import (
    ADAMW_OPS,
    FOR_LOOP_OP_S,
    MTA_TENSORS,
    UNFUSED_TRAFFIC,
    optimizer_seconds,
)
from coplan.cost.parts import ZERO, Kernel
from coplan.hardware import load_cluster
from coplan.ir.types import Phase
from coplan.models.spec import PRESETS

LAUNCH = 4e-6


def _kernels(n: int, ops_each: int = 1) -> list[Kernel]:
    return [
        Kernel(Phase.OPTIMIZER, "vector", 0, 0.0, 0.0, ZERO, ops=tuple(range(ops_each))) for _ in range(n)
    ]


def test_the_plans_kernels_price_the_fused_form() -> None:
    ks, times = _kernels(3), [10e-6, 20e-6, 30e-6]
    for form in ("", "fused"):
        assert optimizer_seconds(ks, times, [0.0] * 3, LAUNCH, form) == (pytest.approx(60e-6), 3)


def test_the_for_loop_is_the_longer_of_host_and_device() -> None:
    # small updates: eight host-issued ops each outlast their traffic
    ks, times = _kernels(148), [LAUNCH + 2e-6] * 148
    secs, launched = optimizer_seconds(ks, times, [0.0] * 148, LAUNCH, "for-loop")
    assert launched == 148 * ADAMW_OPS
    assert secs == pytest.approx(148 * ADAMW_OPS * FOR_LOOP_OP_S)
    # one huge update: its three-fold traffic outlasts the host
    secs, _ = optimizer_seconds(_kernels(1), [LAUNCH + 0.1], [0.0], LAUNCH, "for-loop")
    assert secs == pytest.approx(UNFUSED_TRAFFIC * 0.1 + ADAMW_OPS * LAUNCH)


def test_foreach_moves_three_times_the_bytes_in_few_launches() -> None:
    # one kernel per block of 12 updates, 148 tensors in all: at most 36 tensors a launch
    n, per = 12, 12
    ks, traffic = _kernels(n, per), 1e-3
    secs, launched = optimizer_seconds(ks, [traffic + LAUNCH] * n, [1e6] * n, LAUNCH, "foreach")
    per_op = math.ceil(n * per / MTA_TENSORS)
    assert launched == ADAMW_OPS * per_op
    assert secs == pytest.approx(UNFUSED_TRAFFIC * n * traffic + launched * LAUNCH)


def test_free_kernels_launch_nothing() -> None:
    free = replace(_kernels(1)[0], kind="free")
    assert optimizer_seconds([free], [0.0], [0.0], LAUNCH, "for-loop") == (0.0, 0)


def test_config_names_the_form() -> None:
    with pytest.raises(ConfigError, match="optimizer"):
        TrainingConfig(optimizer="adam")
    assert "optimizer" not in TrainingConfig().to_dict()
    assert TrainingConfig(optimizer="foreach").to_dict()["optimizer"] == "foreach"


def test_gpt2_on_a_gpu_orders_the_forms() -> None:
    """GPT-2 124M on one H100: the loop of 148 tensors x 8 ops costs the host 1,184 ops; the
    multi-tensor form three times the fused update's traffic."""
    model, cluster = CostModel(spec=PRESETS["gpt2-124m"]), load_cluster("dgx-h100", 1)
    base = TrainingConfig(microbatch=8, global_batch=8, seq=1024, fusion="none")
    opt = {
        f: model.estimate(cluster, base.with_(optimizer=f)).breakdown_s["optimizer"]
        for f in ("", "foreach", "for-loop")
    }
    whole = model.profile(base.microbatch, 1024, "none").graph  # every layer's parameters
    tensors = sum(1 for op in whole.ops if op.phase is Phase.OPTIMIZER)
    assert tensors == 148
    # the host's ops, but the embedding's 38.6M-element update outlasts its own 8 ops on the GPU
    host = tensors * ADAMW_OPS * FOR_LOOP_OP_S
    assert host < opt["for-loop"] < host + UNFUSED_TRAFFIC * opt[""]
    assert opt[""] < opt["foreach"] < opt["for-loop"]
    # per-tensor kernels less their launches, times three, plus multi-tensor launches: eight ops
    # per model part (each part is priced apart), under a millisecond here
    traffic = UNFUSED_TRAFFIC * (opt[""] - tensors * 4e-6)
    assert traffic < opt["foreach"] < traffic + 1e-3
