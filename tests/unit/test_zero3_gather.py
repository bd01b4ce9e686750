"""ZeRO-3's collectives as a stack issues them: per layer, per module owning parameters, or per
parameter tensor with a tensor per rank (``TrainingConfig.zero3_gather``, ``coplan.cost.zero``)."""

from __future__ import annotations

import json

import pytest

from coplan.cost import CostModel, TrainingConfig, load_stack
from coplan.cost.comm import Group
from coplan.cost.config import ConfigError
from coplan.cost.zero import zero3_exposed
from coplan.hardware import load_cluster
from coplan.models.spec import PRESETS

GPT = PRESETS["gpt-tiny"]  # learned positions, biases, a tied embedding
LLAMA = PRESETS["llama-tiny"]  # no biases


def test_each_collective_pays_its_copies() -> None:
    cluster = load_cluster("dgx-a100-80gb", 64)
    g = Group.of(cluster, 64, 1, 1.0)
    p, calls, copy = 1e9, 24, 64 * 4e-6
    gather = g.all_gather(p / calls * 2) + copy
    scatter = g.reduce_scatter(p / calls * 4) + copy
    # nothing to hide behind: every gather (forward and backward) and reduce-scatter shows
    assert zero3_exposed(g, p, calls, 2, 4, 0.0, 2, 0.0, copy) == pytest.approx(
        calls * (2 * gather + scatter)
    )
    # all hidden but the first gather and the last reduce-scatter
    assert zero3_exposed(g, p, calls, 2, 4, 1e6, 2, 0.0, copy) == pytest.approx(gather + scatter)
    # the zero-filled, copied gathered tensor and the copied reduce-scatter input: 3 and 2 passes
    hbm = 1e12
    moved = calls * (2 * 3 * (p / calls * 2) + 2 * (p / calls * 4)) / hbm
    with_bytes = zero3_exposed(g, p, calls, 2, 4, 0.0, 2, 0.0, copy, hbm)
    assert with_bytes - zero3_exposed(g, p, calls, 2, 4, 0.0, 2, 0.0, copy) == pytest.approx(moved)
    # more, smaller collectives of the same bytes pay more latency
    assert zero3_exposed(g, p, 4 * calls, 2, 4, 0.0) > zero3_exposed(g, p, calls, 2, 4, 0.0)


def test_parts_count_parameter_tensors_and_their_modules() -> None:
    prof = CostModel(spec=GPT).profile(1, 64, "megatron")
    (block,) = prof.templates
    # two norms, QKV, projection, two MLP linears: a weight and a bias each
    assert (block.param_tensors, block.param_modules) == (12, 6)
    # the token and position embeddings; the final norm's weight and bias and the tied embedding
    assert (prof.pre.param_tensors, prof.pre.param_modules) == (2, 2)
    assert (prof.post.param_tensors, prof.post.param_modules) == (3, 2)
    assert prof.shared_tensors == (1, 1)
    assert sum(t.param_tensors * len(t.blocks) for t in prof.templates) + 2 + 3 - 1 == len(
        prof.graph.parameters
    )
    # without biases each module owns one tensor
    (block,) = CostModel(spec=LLAMA).profile(1, 64, "megatron").templates
    assert block.param_tensors == block.param_modules > 0


def _zero3(gather: str, overlap: bool = True) -> TrainingConfig:
    return TrainingConfig(dp=64, global_batch=64, zero=3, zero3_gather=gather, overlap_zero=overlap)


def test_tensor_lists_price_every_collective_and_copy_unhidden() -> None:
    cm = CostModel(spec=GPT)
    cluster = load_cluster("dgx-a100-80gb", 64)
    est = cm.estimate(cluster, _zero3("tensor-list", overlap=False))
    g = Group.of(cluster, 64, 1, cluster.groups[0].device.efficiency_of("network"))
    p_local = float(cm.profile(1, 64, "megatron").graph.param_count)
    tensors = 2 * 12 + 2 + 3 - 1  # the tied embedding is one tensor on the one stage
    device = cluster.groups[0].device
    copy = 64 * device.kernel_launch_s
    hbm = device.memory_bandwidth * device.efficiency_of("memory")
    want = zero3_exposed(g, p_local, tensors, 2, 4, 0.0, 2, 0.0, copy, hbm)
    assert est.breakdown_s["zero_comm"] == pytest.approx(want)


def test_finer_collectives_cost_more() -> None:
    cm = CostModel(spec=GPT)
    cluster = load_cluster("dgx-a100-80gb", 64)
    comm = {
        g: cm.estimate(cluster, _zero3(g, overlap=False)).breakdown_s["zero_comm"]
        for g in ("unit", "module", "tensor-list")
    }
    assert comm["unit"] < comm["module"] < comm["tensor-list"]
    # prefetching hides most of it again
    hidden = cm.estimate(cluster, _zero3("module")).breakdown_s["zero_comm"]
    assert hidden < comm["module"]


def test_fsdp_gathers_units_only() -> None:
    with pytest.raises(ConfigError, match="zero3_gather"):
        TrainingConfig(dp=8, global_batch=8, zero=3, fsdp_units=True, zero3_gather="module")
    with pytest.raises(ConfigError, match="zero3_gather"):
        TrainingConfig(zero3_gather="layer")
    assert "zero3_gather" not in TrainingConfig().to_dict()
    assert TrainingConfig(zero3_gather="module").to_dict()["zero3_gather"] == "module"


def test_deepspeed_preset_gathers_as_its_published_runs_did_and_cites_it() -> None:
    ds = load_stack("deepspeed")
    assert ds.zero3_gather == "tensor-list" and "all_gather" in ds.source_of("zero3_gather")
    assert ds.with_kernels(_zero3("unit")).zero3_gather == "tensor-list"
    assert ds.configure(_zero3("unit")).zero3_gather == "tensor-list"
    # a configuration that names its own keeps it
    assert ds.with_kernels(_zero3("module")).zero3_gather == "module"
    assert load_stack("torchtitan").configure(_zero3("unit")).zero3_gather == "unit"


def test_a_tensor_list_hides_nothing() -> None:
    # each gather waited for the device (torch.cuda.synchronize), whatever overlap the stack allows
    cm = CostModel(spec=GPT)
    cluster = load_cluster("dgx-a100-80gb", 64)
    on = cm.estimate(cluster, _zero3("tensor-list")).breakdown_s["zero_comm"]
    off = cm.estimate(cluster, _zero3("tensor-list", overlap=False)).breakdown_s["zero_comm"]
    assert on == off


def test_cli_prices_the_collectives_as_named(cli) -> None:  # type: ignore[no-untyped-def]
    args = ("estimate", "--model", "gpt2-124m", "--cluster", "dgx-a100-80gb", "--gpus", "64", "--zero", "3")
    comm = {}
    for extra in ((), ("--zero3-gather", "tensor-list", "--no-zero3-overlap")):
        code, out, err = cli(*args, *extra, "--json")
        assert code == 0, err
        data = json.loads(out)
        comm[extra] = data["breakdown_s"]["zero_comm"]
        if extra:
            assert data["config"]["zero3_gather"] == "tensor-list" and data["config"]["overlap_zero"] is False
        else:
            assert "zero3_gather" not in data["config"] and "overlap_zero" not in data["config"]
    assert comm[()] < comm[("--zero3-gather", "tensor-list", "--no-zero3-overlap")]
    code, _, err = cli(*args, "--stack", "fsdp", "--zero3-gather", "module")
    assert code == 2 and "zero3_gather" in err and len(err.strip().splitlines()) == 1
