"""Context parallelism (``TrainingConfig.cp``): one rank holds 1/cp of every sequence, its attention
meets every key, its gradients are reduced over dp x cp ranks, and the ring's transfers show only
where they outlast a step of attention (``coplan.cost.context``)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from coplan.capture.synthetic import build_graph
from coplan.cost import ConfigError, CostModel, TrainingConfig
from coplan.cost.context import kv_elements, ring_exposed
from coplan.cost.parts import CAUSAL_FRACTION, attention_share, model_flops
from coplan.hardware import load_cluster
from coplan.ir.types import OpKind, Phase
from coplan.models.spec import PRESETS

SPEC = replace(PRESETS["llama2-7b"], n_layers=4, seq_len=16384)


def _config(cp: int, dp: int, **kw) -> TrainingConfig:
    return TrainingConfig(tp=2, cp=cp, dp=dp, microbatch=1, global_batch=16, seq=16384, **kw)


def test_a_rank_computes_its_share_of_every_sequence_and_the_step_the_same_flops():
    """The rank's graph holds seq/cp tokens; its attention computes 1/cp of the causal scores of
    the whole sequence (cp times what its local shapes count), so cp ranks together compute the
    step's FLOPs exactly, and model FLOPs per step do not depend on cp."""
    whole = build_graph(SPEC, 1, 16384)
    rank = build_graph(SPEC, 1, 16384 // 4, cp=4)
    attn = [op for op in rank.ops if op.kind is OpKind.ATTENTION]
    assert attn and all(attention_share(op) == CAUSAL_FRACTION * 4 for op in attn)
    assert model_flops(rank.ops) * 4 == pytest.approx(model_flops(whole.ops), rel=1e-12)
    cluster = load_cluster("dgx-h100", 16)
    model = CostModel(spec=SPEC)
    one, four = model.estimate(cluster, _config(1, 8)), model.estimate(cluster, _config(4, 2))
    flops = [e.model_tflops_per_gpu * e.step_time_s for e in (one, four)]
    assert flops[0] == pytest.approx(flops[1], rel=1e-12)
    assert one.tokens_per_s * one.step_time_s == pytest.approx(16 * 16384)
    assert four.tokens_per_s * four.step_time_s == pytest.approx(16 * 16384)


def test_activations_shrink_by_cp_and_model_states_shard_over_dp_times_cp():
    """Without recompute every saved block tensor is per token: a rank keeps 1/cp of them. ZeRO-1
    shards the optimizer over dp x cp ranks (the same parameters), so (cp 4, dp 2) keeps what
    (cp 1, dp 8) keeps."""
    cluster = load_cluster("dgx-h100", 16)
    model = CostModel(spec=SPEC)
    one = model.estimate(cluster, _config(1, 8, zero=1)).stages[0].memory
    four = model.estimate(cluster, _config(4, 2, zero=1)).stages[0].memory
    assert four.optimizer_bytes == one.optimizer_bytes
    assert four.params_bytes == one.params_bytes
    assert four.activations_bytes == pytest.approx(one.activations_bytes / 4, rel=0.02)


def test_ring_transfers_show_only_what_a_step_of_attention_cannot_hide():
    assert ring_exposed(8.0, 1.0, 4) == 0.0  # 2 s of attention a step hides 1 s transfers
    assert ring_exposed(8.0, 3.0, 4) == pytest.approx(3 * (3.0 - 2.0))
    assert ring_exposed(8.0, 3.0, 1) == 0.0
    # keys and values of one rank: the rotated keys and the value slice of the fused projection
    g = build_graph(SPEC, 1, 1024, cp=2)
    fwd = next(op for op in g.ops if op.kind is OpKind.ATTENTION and op.phase is Phase.FORWARD)
    elems, heads = kv_elements(g, fwd)
    assert (elems, heads) == (2 * 1024 * SPEC.kv_heads * SPEC.head_dim, SPEC.kv_heads)
    gpt = PRESETS["gpt2-124m"]
    g = build_graph(gpt, 2, 512, cp=2)
    fwd = next(op for op in g.ops if op.kind is OpKind.ATTENTION and op.phase is Phase.FORWARD)
    assert kv_elements(g, fwd) == (2 * 2 * 512 * gpt.d_model, gpt.n_heads)


def test_the_ring_shows_across_a_slow_network_and_hides_inside_a_node():
    """tp 8 x cp 2 spans two nodes: over a network a hundred times slower than the preset's, the
    transfers outlast attention's steps; inside one node (tp 4 x cp 2) they hide."""
    model = CostModel(spec=SPEC)
    fast = load_cluster("dgx-h100", 16)
    slow_data = fast.to_dict()
    slow_data["inter_node"]["bandwidth"] /= 100
    from coplan.hardware.cluster import ClusterSpec

    slow = ClusterSpec.from_dict(slow_data, source="test")
    across = TrainingConfig(tp=8, cp=2, microbatch=1, global_batch=1, seq=16384)
    assert model.estimate(fast, across).breakdown_s["cp_comm"] >= 0.0
    assert model.estimate(slow, across).breakdown_s["cp_comm"] > 0.0
    inside = TrainingConfig(tp=4, cp=2, dp=2, microbatch=1, global_batch=2, seq=16384)
    assert model.estimate(slow, inside).breakdown_s["cp_comm"] == 0.0


def test_context_parallel_configurations_that_cannot_run_are_refused():
    model = CostModel(spec=SPEC)
    cluster = load_cluster("dgx-h100", 16)
    with pytest.raises(ConfigError, match="2 x cp"):
        model.estimate(cluster, TrainingConfig(tp=2, cp=8, microbatch=1, global_batch=1, seq=8200))
    with pytest.raises(ConfigError, match="tp x cp x pp x dp"):
        model.estimate(cluster, TrainingConfig(tp=2, cp=4, microbatch=1, global_batch=1, seq=16384))
    with pytest.raises(ConfigError, match="flash"):
        model.estimate(
            cluster,
            TrainingConfig(tp=2, cp=8, microbatch=1, global_batch=1, seq=16384, flash_attention=False),
        )
    captured = CostModel(graph=build_graph(SPEC, 1, 1024))
    with pytest.raises(ConfigError, match="model spec"):
        captured.estimate(cluster, TrainingConfig(tp=2, cp=8, microbatch=1, global_batch=1, seq=1024))
    assert TrainingConfig(cp=2, dp=3, global_batch=3).to_dict()["cp"] == 2
    assert "cp" not in TrainingConfig().to_dict()


# --- planning ----------------------------------------------------------------------------------


def _ctx(stack: str, seq: int, gpus: int = 8):
    from coplan.cost import load_stack
    from coplan.plan import PlanContext

    spec = replace(PRESETS["llama-tiny"], seq_len=16384)
    return PlanContext(
        CostModel(spec=spec), load_cluster("dgx-h100", gpus), global_batch=8, seq=seq, stack=load_stack(stack)
    )


def test_the_search_offers_context_parallelism_only_where_the_stack_runs_it_and_sequences_are_long():
    from coplan.passes.parallel import MIN_CP_TOKENS, candidates

    long = {p.cp for p in candidates(_ctx("megatron", 16384))}
    assert long == {1, 2, 4}  # 16,384 tokens over 8 would leave 2,048 a rank
    assert all(16384 // c >= MIN_CP_TOKENS for c in long)
    assert {p.cp for p in candidates(_ctx("torchtitan", 16384))} == {1, 2, 4}
    assert {p.cp for p in candidates(_ctx("megatron", 4096))} == {1}
    assert {p.cp for p in candidates(_ctx("fsdp", 16384))} == {1}
    assert {p.cp for p in candidates(_ctx("coplan", 16384))} == {1}
    assert all(p.gpus == 8 for p in candidates(_ctx("megatron", 16384)))


def test_a_context_parallel_plan_is_checked_priced_emitted_and_reloaded():
    import tomllib

    from coplan.plan import check
    from coplan.plan.emit import emit
    from coplan.plan.types import ParallelPlan, Plan

    ctx = _ctx("megatron", 16384)
    plan = ctx.default_plan().with_(parallel=ParallelPlan(tp=2, cp=4, microbatch=1))
    assert check(plan, ctx) == []
    est = ctx.price(plan)
    assert est.config.cp == 4 and est.gpus == 8
    assert Plan.from_dict(plan.to_dict()) == plan
    assert plan.to_dict()["parallel"]["cp"] == 4
    assert "cp" not in ctx.default_plan().to_dict()["parallel"]  # older plans keep their fingerprint
    assert "CP4" in plan.parallel.describe()
    spec = ctx.model.spec
    args = emit(plan, spec, "megatron").text
    assert "--context-parallel-size 4" in " ".join(args.split())
    toml = tomllib.loads(emit(plan, spec, "torchtitan").text)
    assert toml["parallelism"]["context_parallel_degree"] == 4
    fsdp = _ctx("fsdp", 16384)
    problems = check(plan.with_(parallel=ParallelPlan(cp=8, microbatch=1, zero=3)), fsdp)
    assert any("context parallelism" in str(p) for p in problems)


def test_only_the_rings_diagonal_step_pays_the_causal_occupancy_derating():
    """A causal rank's ring runs one causal call (its diagonal step, 1/cp of its attention) and
    full blocks for the rest (Transformer Engine's ``AttnFuncWithCPAndKVP2P``): the occupancy
    derating fitted on causal kernels (``attention_parallel_half``) prices only that share."""
    import math

    from coplan.cost.kernels import ATTN_TILE_ROWS, Rates, Scale, kernel_time, shape_factor

    model = CostModel(spec=SPEC)
    cluster = load_cluster("dgx-h100", 16)
    rates = Rates.of(cluster.groups[0].device, "bf16", "auto")
    for cp, dp in ((1, 8), (4, 2)):
        config = _config(cp, dp)
        kernels = [
            k for part in model.profile_for(config).templates for k in (*part.forward, *part.backward)
            if k.kind == "attention"
        ]  # fmt: skip
        assert kernels and all(k.diagonal == 1.0 / cp for k in kernels)
        k = kernels[0]
        scale = Scale.of(config)
        whole = kernel_time(replace(k, diagonal=1.0), rates, scale)
        got = kernel_time(k, rates, scale)
        bh, sq, _, _ = k.attn
        backward = k.phase is Phase.BACKWARD
        half = rates.attn_bwd_par_half if backward else rates.attn_par_half
        occupancy = shape_factor((bh / scale.div(k.shard) * math.ceil(sq / ATTN_TILE_ROWS),), half)
        if cp == 1:
            assert got == whole
        else:  # the compute term scales by (1/cp) / occupancy + (1 - 1/cp), against 1 / occupancy
            launch = rates.launch_s
            ratio = (1 / cp / occupancy + 1 - 1 / cp) * occupancy
            assert got - launch == pytest.approx((whole - launch) * ratio, rel=1e-9)


def test_pytorchs_exchange_gathers_once_and_merges_in_fp32() -> None:
    """PyTorch's ``context_parallel`` (torchtitan's): one all-gather of every rank's keys and values
    beside the first step, the key/value gradients passed on in fp32 (the last after the loop),
    and the steps' outputs merged in fp32 (``context.torch_ring``)."""
    from coplan.cost.context import TORCH_CP_BYTES, allgather_exposed, torch_ring

    assert allgather_exposed(8.0, 1.0, 4) == pytest.approx(3.0 - 2.0)
    assert allgather_exposed(40.0, 1.0, 4) == 0.0 and allgather_exposed(1.0, 5.0, 1) == 0.0
    # nothing to hide behind and free memory passes: the exchanges alone, 16-bit keys and values
    # of 100 bytes at 1 s per 100 bytes, their gradients in fp32 at twice that
    fwd, bwd = torch_ring((0.0, 0.0), lambda b: b / 100, 100.0, 2.0, 0.0, 0.0, float("inf"), 4)
    assert fwd == pytest.approx(3 * 1.0)
    assert bwd == pytest.approx(3 * 1.0 + 3 * 2.0 + 2.0)
    # long attention hides every exchange but the last gradient transfer; the merges remain
    q, kv, bw = 1e6, 5e5, 1e9
    fwd, bwd = torch_ring((1e3, 1e3), lambda b: b / 1e9, 1e6, 2.0, q, kv, bw, 4)
    b = TORCH_CP_BYTES
    assert fwd == pytest.approx((q * (b["forward_q_first"] + 3 * b["forward_q_step"]) + kv * 3 * 4.0) / bw)
    grads = 1e6 * 2 / 1e9
    merges = q * (b["backward_q_once"] + 4 * b["backward_q_step"])
    merges += kv * (b["backward_kv_once"] + 4 * b["backward_kv_step"] + 3 * 4.0)
    assert bwd == pytest.approx(grads + merges / bw)
    # compiled blocks merge each step in one generated kernel
    compiled, _ = torch_ring((1e3, 1e3), lambda b: b / 1e9, 1e6, 2.0, q, kv, bw, 4, compiled=True)
    assert compiled < fwd


def test_torchtitans_context_parallelism_is_priced_as_pytorch_runs_it() -> None:
    from coplan.cost import load_stack

    cluster = load_cluster("dgx-h100", 16)
    model = CostModel(spec=SPEC)
    titan = load_stack("torchtitan").configure(_config(4, 2))
    assert titan.cp_exchange == "allgather" and titan.to_dict()["cp_exchange"] == "allgather"
    assert load_stack("megatron").configure(_config(4, 2)).cp_exchange == "p2p"
    assert "cp_exchange" not in _config(4, 2).to_dict()
    ring = model.estimate(cluster, titan.with_(cp_exchange="p2p"))
    gather = model.estimate(cluster, titan)
    # inside a node the ring hides; PyTorch's fp32 merges and last gradient transfer do not
    assert ring.breakdown_s["cp_comm"] == 0.0 < gather.breakdown_s["cp_comm"]
    assert gather.breakdown_s["compute"] == ring.breakdown_s["compute"]
    with pytest.raises(ConfigError, match="cp_exchange"):
        TrainingConfig(cp_exchange="ring")


def test_cli_prices_the_exchange_as_named(cli) -> None:  # type: ignore[no-untyped-def]
    args = ("estimate", "--model", "llama2-7b", "--gpus", "8", "--cp", "4", "--seq", "4096")
    args += ("--global-batch", "2", "--stack", "torchtitan", "--json")
    got = {}
    for mode in ("allgather", "p2p"):
        code, out, err = cli(*args, "--cp-exchange", mode)
        assert code == 0, err
        data = json.loads(out)
        assert data["config"].get("cp_exchange", "p2p") == mode
        got[mode] = data["breakdown_s"]["cp_comm"]
    assert got["allgather"] > got["p2p"]


def _cp_probe():  # benchmarks/data is not a package: the probe loaded by path
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "cp_ring_probe.py"
    spec = importlib.util.spec_from_file_location("cp_ring_probe", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_the_ring_probes_steps_are_pytorchs_load_balanced_share_of_the_causal_scores(cp: int) -> None:
    """``cp_ring_probe.ring_steps`` follows ``_templated_ring_attention``: one causal call on the
    rank's own keys, then ``rank`` calls of all its queries against half the keys and the rest of
    half its queries against all of them, so every rank computes exactly 1/cp of the causal score
    matrix of the whole sequence (the counted FLOPs coplan prices under context parallelism)."""
    probe = _cp_probe()
    local = 4096
    whole = 4.0 * probe.HEADS * probe.HEAD_DIM * (cp * local) ** 2 / 2  # causal, the whole sequence
    for rank in range(cp):
        steps = probe.ring_steps(cp, rank, local)
        assert len(steps) == cp and steps[0] == probe.Step(local, local, True, False)
        assert sum(s.partial for s in steps) == cp - 1 - rank
        assert sum(probe.step_flops(s) for s in steps) == pytest.approx(whole / cp, rel=1e-12)
    with pytest.raises(ValueError, match="rank"):
        probe.ring_steps(cp, cp, local)


def test_the_ring_probe_prices_one_ranks_attention_without_a_gpu() -> None:
    probe = _cp_probe()
    two, four = probe.priced(32768, 2, "grand-teton-h100"), probe.priced(65536, 4, "grand-teton-h100")
    assert 0 < two["forward_s"] < two["backward_s"]
    # twice the sequence over twice the ranks: each rank's share of the scores doubles
    assert four["forward_s"] == pytest.approx(2 * two["forward_s"], rel=0.15)
