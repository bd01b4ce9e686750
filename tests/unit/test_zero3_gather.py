"""ZeRO-3's collectives as a stack issues them: per layer, per module owning parameters, or per
parameter tensor with a tensor per rank (``TrainingConfig.zero3_gather``, ``coplan.cost.zero``)."""

from __future__ import annotations

import json

import pytest

from coplan.cost import CostModel, TrainingConfig, load_stack
from coplan.cost.comm import Group
from coplan.cost.config import ConfigError
from coplan.cost.zero import recompute_regathered, zero3_exposed
from coplan.hardware import load_cluster
from coplan.models.spec import PRESETS, ModelSpec

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


def test_deepspeed_regathers_a_recomputed_module_used_again_beyond_the_reuse_distance() -> None:
    h = 20480.0  # MT-NLG 530B's blocks: QKV, projection, the two MLP linears
    sizes = [3 * h * h, h * h, 4 * h * h, 4 * h * h]
    # the last module's backward follows its recomputed forward at once; the others wait for
    # twice the elements of the modules after them (their recompute, then their backward)
    assert recompute_regathered(sizes) == 8 * h * h
    assert recompute_regathered(sizes, reuse_distance=2 * 4 * h * h + 1) == 4 * h * h
    # a small block is kept whole between its recompute and its backward
    assert recompute_regathered([3e6, 1e6, 4e6, 4e6]) == 0.0
    assert recompute_regathered([]) == 0.0


def test_block_modules_in_forward_order_hold_the_block_parameters() -> None:
    (block,) = CostModel(spec=GPT).profile(1, 64, "megatron").templates
    sizes = block.param_module_sizes
    assert len(sizes) == block.param_modules
    assert sum(a + b for a, b in sizes) == pytest.approx(sum(block.params))
    d = GPT.d_model
    # ln_1, then QKV (weight and bias, tensor-parallel), ...; the MLP's output linear last
    assert sizes[0] == (2 * d, 0.0)
    assert sizes[1] == (0.0, 3 * d * d + 3 * d)
    assert sum(sizes[-1]) == 4 * d * d + d


def test_deepspeed_recompute_gathers_large_blocks_a_third_time() -> None:
    big = ModelSpec(n_layers=2, d_model=16384, n_heads=128, vocab_size=32000, seq_len=256)
    cm = CostModel(spec=big)
    cluster = load_cluster("dgx-a100-80gb", 64)

    def comm(gather: str, recompute: str) -> float:
        cfg = TrainingConfig(
            dp=64, global_batch=64, zero=3, zero3_gather=gather, overlap_zero=False, recompute=recompute
        )
        return cm.estimate(cluster, cfg).breakdown_s["zero_comm"]

    # per-module hooks fire again in the recompute: all but the last module are gathered again
    assert comm("tensor-list", "full") > comm("tensor-list", "none")
    assert comm("module", "full") > comm("module", "none")
    # a unit gathered around the checkpointed block (FSDP) is gathered twice either way
    assert comm("unit", "full") == pytest.approx(comm("unit", "none"))
    # a small model's blocks stay gathered from their recompute to their backward
    small = CostModel(spec=GPT)
    cfg = _zero3("module", overlap=False)
    none = small.estimate(cluster, cfg).breakdown_s["zero_comm"]
    full = small.estimate(cluster, cfg.with_(recompute="full")).breakdown_s["zero_comm"]
    assert full == pytest.approx(none)


def test_cli_prices_gradient_accumulation_as_named(cli) -> None:  # type: ignore[no-untyped-def]
    args = ("estimate", "--model", "gpt2-124m", "--cluster", "dgx-a100-80gb", "--gpus", "8")
    args = (*args, "--global-batch", "64", "--microbatch", "2", "--json")
    code, out, err = cli(*args)
    assert code == 0, err
    plain = json.loads(out)
    assert "grad_accumulation" not in plain["config"]
    code, out, err = cli(*args, "--grad-accumulation", "autograd32")
    assert code == 0, err
    data = json.loads(out)
    assert data["config"]["grad_accumulation"] == "autograd32"
    assert data["step_time_s"] > plain["step_time_s"]
    code, _, err = cli(*args[:-1], "--grad-accumulation", "later")
    assert code == 2 and "grad-accumulation" in err
