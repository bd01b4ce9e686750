"""Hybrid sharding (HSDP) as a plan decision: FSDP's units sharded within a node's GPUs and
replicated across nodes, searched where the stack runs it, priced as `coplan estimate
--fsdp-shard` prices it, emitted as torchtitan's shard and replicate degrees, refused elsewhere."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from coplan.apply.dist import supported
from coplan.cost import CostModel, load_stack
from coplan.cost.envelope import validated
from coplan.hardware import load_cluster
from coplan.hardware.cluster import ClusterSpec
from coplan.models.spec import PRESETS
from coplan.passes.parallel import candidates
from coplan.plan import PlanContext, PlanError
from coplan.plan.capabilities import config_problems, layout_problem
from coplan.plan.emit import emit
from coplan.plan.types import ParallelPlan, Plan
from coplan.search import run_strategy

GPUS = 32  # four 8-GPU nodes


def slow_network(gpus: int = GPUS) -> ClusterSpec:
    """DGX H100 nodes on 800 Gb/s a node (fms-fsdp's cluster): 12.5 GB/s a GPU between nodes."""
    hw = load_cluster("dgx-h100", gpus)
    assert hw.inter_node is not None
    return replace(hw, inter_node=replace(hw.inter_node, bandwidth=800e9 / 8 / 8))


def ctx_for(stack: str, hw: ClusterSpec | None = None) -> PlanContext:
    return PlanContext(
        CostModel(spec=PRESETS["llama2-7b"]),
        hw or slow_network(),
        global_batch=64,
        seq=4096,
        stack=load_stack(stack),
    )


def test_a_shard_group_divides_the_zero_ranks_and_needs_fsdp_units() -> None:
    ok = ParallelPlan(dp=32, zero=3, fsdp_shard=8)
    assert ok.describe() == "TP1 PP1 DP32 ZeRO-3 HSDP8 mb1"
    for bad in (
        {"dp": 32, "zero": 3, "fsdp_shard": 6},  # does not divide 32
        {"dp": 32, "zero": 3, "fsdp_shard": 32},  # one group: plain FSDP
        {"dp": 32, "zero": 1, "fsdp_shard": 8},  # ZeRO-1 shards no units
        {"dp": 32, "zero": 3, "fsdp_shard": 0},
    ):
        with pytest.raises(PlanError) as info:
            ParallelPlan(**bad)  # type: ignore[arg-type]
        assert info.value.field == "parallel.fsdp_shard"


def test_the_search_offers_hsdp_only_where_the_stack_runs_it() -> None:
    for stack, expected in (("fsdp", {None, 8}), ("torchtitan", {None, 8}), ("coplan", {None})):
        shards = {p.fsdp_shard for p in candidates(ctx_for(stack)) if p.tp == 1 and p.zero >= 2}
        assert shards == expected, stack
    # a node holds 8 / TP of the sharding ranks
    tp2 = {p.fsdp_shard for p in candidates(ctx_for("torchtitan")) if p.tp == 2 and p.zero == 3}
    assert tp2 == {None, 4}
    # inside one node there is nothing to replicate across
    one_node = {p.fsdp_shard for p in candidates(ctx_for("fsdp", load_cluster("dgx-h100", 8)))}
    assert one_node == {None}
    assert layout_problem(load_stack("megatron"), ParallelPlan(dp=32, zero=3, fsdp_shard=8)) is not None


def test_on_a_slow_network_the_plan_shards_within_nodes_priced_as_estimate_prices_it() -> None:
    ctx = ctx_for("fsdp")
    best = run_strategy("joint", ctx)
    p = best.plan.parallel
    assert p.fsdp_shard == 8 and p.zero >= 2
    # sharded over every rank instead: slower on this network
    flat = ctx.price(best.plan.with_(parallel=replace(p, fsdp_shard=None)))
    assert best.estimate.step_time_s < flat.step_time_s
    # the same configuration as coplan estimate builds it
    config = ctx.config_of(best.plan)
    assert config.fsdp_shard == 8 and config.shard_ranks == 8
    assert config_problems(ctx.stack, config) == []
    again = ctx.model.estimate(ctx.cluster, config)
    assert again.step_time_s == pytest.approx(best.estimate.step_time_s)
    # no validated run shards this way
    trust = validated(best.estimate, ctx.model.spec, ctx.stack.name)
    assert any(n.startswith("hybrid sharding (FSDP within groups of 8)") for n in trust.extrapolated)


def test_a_hybrid_plan_round_trips_and_keeps_other_plans_fingerprints(tmp_path: Path) -> None:
    ctx = ctx_for("torchtitan")
    plan = ctx.default_plan()
    flat = plan.with_(parallel=replace(plan.parallel, dp=32, zero=3))
    hybrid = plan.with_(parallel=replace(flat.parallel, fsdp_shard=8))
    assert "fsdp_shard" not in flat.to_dict()["parallel"]
    assert hybrid.to_dict()["parallel"]["fsdp_shard"] == 8
    assert hybrid.fingerprint != flat.fingerprint
    path = tmp_path / "plan.json"
    path.write_text(hybrid.to_json())
    again = Plan.from_dict(json.loads(path.read_text()))
    assert again == hybrid and again.fingerprint == hybrid.fingerprint


def test_hsdp_is_emitted_as_torchtitans_degrees_and_refused_by_coplan_run() -> None:
    ctx = ctx_for("torchtitan")
    plan = ctx.default_plan()
    hybrid = plan.with_(parallel=replace(plan.parallel, tp=2, dp=16, zero=3, fsdp_shard=4))
    out = emit(hybrid, PRESETS["llama2-7b"], "torchtitan")
    assert "data_parallel_shard_degree = 4" in out.text
    assert "data_parallel_replicate_degree = 4" in out.text
    megatron = emit(hybrid, PRESETS["llama2-7b"], "megatron")
    assert any("hybrid sharding" in n for n in megatron.notes)
    why = supported(replace(hybrid.parallel, tp=1, dp=32, fsdp_shard=8))
    assert why is not None and "hybrid sharding" in why
