"""FSDP2's copies around its collectives on the compute stream (``TrainingConfig.gather_copies``,
``coplan.cost.zero.fsdp_copies``): the gathered buffer copied into the parameters after each
all-gather, the gradients copied (cast) into the reduce-scatter buffer before each reduce-scatter."""

from __future__ import annotations

import pytest

from coplan.cost import CostModel, TrainingConfig, load_stack
from coplan.cost.config import ConfigError
from coplan.cost.zero import fsdp_copies
from coplan.hardware import load_cluster
from coplan.models.spec import PRESETS

LLAMA = PRESETS["llama-tiny"]


def test_bytes_and_launches_of_one_microbatch() -> None:
    blocks, root, units, bw, launch = 8e9, 1e9, 32, 2e12, 4e-6
    # ZeRO-3: blocks gathered twice (forward, backward), the root once, 16-bit each way; every
    # gradient read in 16 bits and written in fp32
    moved = 2 * (2 * blocks + root) * 2 + (blocks + root) * (2 + 4)
    launches = 3 * units + 2
    assert fsdp_copies(blocks, root, units, 2, 2, 2, 4, bw, launch) == pytest.approx(
        moved / bw + launches * launch
    )
    # gathered once (FSDP2 without resharding after forward), gradients reduced in 16 bits
    moved = 2 * (blocks + root) * 2 + (blocks + root) * (2 + 2)
    assert fsdp_copies(blocks, root, units, 1, 2, 2, 2, bw, launch) == pytest.approx(
        moved / bw + (2 * units + 2) * launch
    )


def test_fsdp2_stacks_copy_and_fsdp1_stacks_do_not() -> None:
    config = TrainingConfig(dp=8, global_batch=8, zero=3)
    assert load_stack("torchtitan").configure(config).gather_copies
    assert load_stack("coplan").configure(config).gather_copies
    for name in ("fsdp", "megatron", "deepspeed"):
        assert not load_stack(name).configure(config).gather_copies
    with pytest.raises(ConfigError, match="gather_copies"):
        TrainingConfig(gather_copies=1)  # type: ignore[arg-type]


def test_copies_add_to_the_units_exposed_time() -> None:
    cluster = load_cluster("dgx-h100", 8)
    model = CostModel(spec=LLAMA)
    base = load_stack("torchtitan").configure(TrainingConfig(dp=8, global_batch=16, microbatch=1, zero=3))
    off = model.estimate(cluster, base.with_(gather_copies=False))
    on = model.estimate(cluster, base)
    # the copies sit on the compute stream: the compute does not move
    assert on.breakdown_s["compute"] == off.breakdown_s["compute"]
    # without them the units are FSDP1's flat parameters, one more held (``zero.fsdp_transient``)
    assert off.memory.peak_bytes - on.memory.peak_bytes == pytest.approx(LLAMA.block_params() * 2)
    stage = on.stages[0]
    blocks = float(LLAMA.n_layers * LLAMA.block_params())
    root = float(LLAMA.param_count()) - blocks  # no tensor parallelism: each rank gathers it all
    device = cluster.groups[0].device
    rate = device.memory_bandwidth * device.efficiency_of("memory")
    copies = fsdp_copies(blocks, root, LLAMA.n_layers, 2, 2, 2, 4, rate, device.kernel_launch_s)
    assert stage.zero_comm_s - off.stages[0].zero_comm_s == pytest.approx(copies, rel=1e-9)
    assert on.step_time_s > off.step_time_s
