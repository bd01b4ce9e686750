"""The cost model: closed-form activation memory, invariants of the step-time model, config errors."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coplan.cost import BREAKDOWN_KEYS, ConfigError, CostModel, TrainingConfig
from coplan.hardware import load_cluster
from coplan.models.spec import PRESETS, ModelSpec

GPT = ModelSpec(name="gpt-test", n_layers=4, d_model=1024, n_heads=16, vocab_size=8192, seq_len=1024)


def _one_layer_activations(config: TrainingConfig, spec: ModelSpec = GPT, on: str = "dgx-a100-80gb") -> float:
    """Activation bytes of one layer for one microbatch: the difference between 2 and 1 layers."""
    cluster = load_cluster(on, config.gpus)
    two = CostModel(spec=ModelSpec(**{**spec.to_dict(), "n_layers": 2})).estimate(cluster, config)
    one = CostModel(spec=ModelSpec(**{**spec.to_dict(), "n_layers": 1})).estimate(cluster, config)
    return two.memory.activations_bytes - one.memory.activations_bytes


@pytest.mark.parametrize(
    ("tp", "sp", "recompute", "closed_form"),
    [
        # Korthikanti et al. 2022 (arXiv 2205.05198), Sec. 4, per layer in 16-bit bytes, without
        # the dropout terms (GPT has no dropout): attention 10sbh + 2as^2b (softmax output),
        # MLP 18sbh, norms 4sbh -> 32sbh + 2as^2b.
        (1, False, "none", lambda s, b, h, a, t: s * b * h * 32 + 2 * a * s * s * b),
        # tensor parallel: norm inputs, QKV and fc1 inputs stay replicated (8sbh), the rest /t
        (4, False, "none", lambda s, b, h, a, t: s * b * h * (8 + 24 / t) + 2 * a * s * s * b / t),
        # plus sequence parallel: everything /t
        (4, True, "none", lambda s, b, h, a, t: s * b * h * 32 / t + 2 * a * s * s * b / t),
        # selective recompute of the attention core drops the a s^2 b term
        (4, True, "selective", lambda s, b, h, a, t: s * b * h * 32 / t),
        # full recompute keeps the layer input only
        (1, False, "full", lambda s, b, h, a, t: 2 * s * b * h),
    ],
)
def test_activation_memory_matches_closed_form(tp, sp, recompute, closed_form):
    b, s, h, a = 2, 1024, GPT.d_model, GPT.n_heads
    config = TrainingConfig(
        tp=tp,
        microbatch=b,
        global_batch=b,
        seq=s,
        sequence_parallel=sp,
        recompute=recompute,
        dtype="bf16",
        flash_attention=False,
    )
    got = _one_layer_activations(config)
    want = closed_form(s, b, h, a, tp)
    # coplan also keeps the norms' fp32 mean and rstd (4 x 4 sb bytes), which the formula leaves out
    assert got == pytest.approx(want, rel=0.01)


def _est(config: TrainingConfig, spec: ModelSpec = GPT, cluster: str = "dgx-h100"):
    return CostModel(spec=spec).estimate(load_cluster(cluster, config.gpus), config)


def test_breakdown_sums_to_step_time_and_keys():
    config = TrainingConfig(
        tp=2,
        pp=2,
        dp=2,
        microbatch=2,
        global_batch=16,
        seq=512,
        recompute="selective",
        sequence_parallel=True,
        zero=1,
    )
    est = _est(config)
    assert tuple(est.breakdown_s) == BREAKDOWN_KEYS
    assert sum(est.breakdown_s.values()) == pytest.approx(est.step_time_s, rel=1e-9)
    assert est.tokens_per_s == pytest.approx(16 * 512 / est.step_time_s)
    assert 0 < est.mfu < 1


def test_recompute_trades_memory_for_time():
    base = TrainingConfig(microbatch=4, global_batch=8, seq=1024)
    none, sel, full = (_est(base.with_(recompute=r)) for r in ("none", "selective", "full"))
    assert full.memory.activations_bytes < sel.memory.activations_bytes <= none.memory.activations_bytes
    assert full.step_time_s > sel.step_time_s >= none.step_time_s
    assert full.breakdown_s["recompute"] > 0 and none.breakdown_s["recompute"] == 0


def test_flash_attention_saves_memory_and_time():
    base = TrainingConfig(microbatch=2, global_batch=2, seq=1024)
    on, off = _est(base), _est(base.with_(flash_attention=False))
    assert off.memory.activations_bytes > on.memory.activations_bytes
    assert off.step_time_s > on.step_time_s


def test_zero_shards_optimizer_gradients_parameters():
    base = TrainingConfig(dp=8, microbatch=1, global_batch=8, seq=256)
    z = [_est(base.with_(zero=k)).memory for k in range(4)]
    assert z[1].optimizer_bytes == pytest.approx(z[0].optimizer_bytes / 8)
    assert z[2].grads_bytes == pytest.approx(z[0].grads_bytes / 8)
    assert z[3].params_bytes == pytest.approx(z[0].params_bytes / 8)
    # Megatron mixed precision: 2 + 4 + 12 bytes per parameter without sharding
    p = z[0].params_bytes / 2
    assert z[0].grads_bytes == pytest.approx(4 * p) and z[0].optimizer_bytes == pytest.approx(12 * p)


def test_first_pipeline_stage_holds_most_microbatches():
    config = TrainingConfig(pp=4, dp=2, microbatch=1, global_batch=32, seq=512)
    est = _est(config)
    assert [s.in_flight for s in est.stages] == [4, 3, 2, 1]
    inter = _est(config.with_(vpp=2, pp=2, dp=4))
    assert inter.stages[0].in_flight > inter.stages[1].in_flight


def test_interleaving_shrinks_the_bubble():
    base = TrainingConfig(pp=2, dp=4, microbatch=1, global_batch=32, seq=512)
    plain, inter = _est(base), _est(base.with_(vpp=2))
    assert inter.breakdown_s["pipeline_bubble"] < plain.breakdown_s["pipeline_bubble"]


def test_fusion_reduces_kernels_and_time_on_a_captured_graph():
    from coplan.capture.api import capture_spec

    graph = capture_spec(PRESETS["gpt-tiny"], 2, 32)
    cm = CostModel(graph=graph)
    cluster = load_cluster("h100-sxm")
    eager = cm.estimate(cluster, TrainingConfig(microbatch=2, global_batch=2, seq=32, fusion="none"))
    fused = cm.estimate(cluster, TrainingConfig(microbatch=2, global_batch=2, seq=32, fusion="megatron"))
    assert fused.kernels_per_step < eager.kernels_per_step
    assert fused.step_time_s < eager.step_time_s
    with pytest.raises(ConfigError):
        cm.estimate(cluster, TrainingConfig(microbatch=4, global_batch=4, seq=32))


def test_recompute_any_tensor_set():
    cm = CostModel(spec=GPT)
    cluster = load_cluster("h100-sxm")
    config = TrainingConfig(microbatch=2, global_batch=2, seq=512)
    prof = cm.profile(2, 512)
    part = prof.templates[0]
    gelu_out = next(name for _, name, _ in part.saved_items if "gelu" in name or "mlp" in name)
    base = cm.estimate(cluster, config)
    some = cm.estimate(cluster, config.with_(recompute=frozenset({gelu_out})))
    assert some.memory.activations_bytes < base.memory.activations_bytes
    assert some.breakdown_s["recompute"] > 0
    with pytest.raises(ConfigError, match="not saved"):
        cm.estimate(cluster, config.with_(recompute=frozenset({"no-such-tensor"})))


def test_tensor_parallel_adds_collectives_and_splits_memory():
    base = TrainingConfig(microbatch=2, global_batch=16, seq=512, dp=8)
    dp8, tp8 = _est(base), _est(base.with_(tp=8, dp=1, global_batch=2))
    assert tp8.breakdown_s["tp_comm"] > 0 and dp8.breakdown_s["tp_comm"] == 0
    assert tp8.memory.params_bytes < dp8.memory.params_bytes / 4


@pytest.mark.parametrize("position", ["learned", "rope"])
def test_each_block_has_two_tensor_parallel_exits_and_two_entries(position):
    # Megatron's layer: all-gather (or identity) into QKV and FC1, reduce-scatter (or all-reduce)
    # after the attention projection and FC2. The vocab-parallel embedding's own reduction belongs
    # to the embedding, even where the first block reads its output directly (no learned
    # positions): priced per layer it would add a third collective to every block.
    spec = ModelSpec(
        name="t", n_layers=2, d_model=256, n_heads=4, vocab_size=1024, seq_len=128, position=position
    )
    prof = CostModel(spec=spec).profile(2, 128)
    tokens = 2 * 128 * 256
    for part in prof.templates:
        assert part.tp_exits == (tokens, tokens)
        assert part.tp_entries == (tokens, tokens)
    assert prof.pre.tp_exits == (tokens,) and prof.pre.tp_entries == ()
    assert prof.post.tp_entries == (tokens,)


def test_model_flops_match_the_6nd_rule_for_a_large_model():
    spec = PRESETS["gpt3-175b"]
    config = TrainingConfig(tp=8, pp=8, dp=16, microbatch=1, global_batch=1024, seq=2048)
    est = _est(config, spec, "dgx-a100-80gb")
    flops = est.model_tflops_per_gpu * 1e12 * est.step_time_s * config.gpus
    n, tokens = spec.param_count(), 1024 * 2048
    s, L, h = 2048, spec.n_layers, spec.d_model
    # 6ND plus causal attention: the full score matrix's 12 L h s per token (forward and backward,
    # Megatron's count) halved under the causal mask
    assert flops == pytest.approx(6 * n * tokens + 6 * L * h * s * tokens, rel=0.005)


@settings(max_examples=25, deadline=None)
@given(
    tp=st.sampled_from([1, 2, 4]),
    pp=st.sampled_from([1, 2]),
    mb=st.sampled_from([1, 2]),
    m=st.integers(1, 4),
    rec=st.sampled_from(["none", "selective", "full"]),
    zero=st.integers(0, 3),
    sp=st.booleans(),
)
def test_estimates_are_finite_and_consistent(tp, pp, mb, m, rec, zero, sp):
    dp = 8 // (tp * pp)
    config = TrainingConfig(
        tp=tp,
        pp=pp,
        dp=dp,
        microbatch=mb,
        global_batch=mb * dp * m * pp,
        seq=256,
        recompute=rec,
        zero=zero,
        sequence_parallel=sp and tp > 1,
    )
    est = _est(config)
    assert math.isfinite(est.step_time_s) and est.step_time_s > 0
    assert all(v >= 0 for v in est.breakdown_s.values())
    assert sum(est.breakdown_s.values()) == pytest.approx(est.step_time_s, rel=1e-9)
    mem = est.memory
    assert mem.peak_bytes >= mem.params_bytes + mem.grads_bytes + mem.optimizer_bytes + mem.activations_bytes


# --- CLI contract ----------------------------------------------------------------------------------


def test_estimate_json_contract(cli):
    code, out, _ = cli(
        "estimate",
        "--model",
        "gpt2-124m",
        "--cluster",
        "dgx-h100",
        "--gpus",
        "8",
        "--tp",
        "2",
        "--pp",
        "2",
        "--microbatch",
        "2",
        "--global-batch",
        "16",
        "--recompute",
        "selective",
        "--sequence-parallel",
        "--zero",
        "1",
        "--dtype",
        "bf16",
        "--no-flash-attention",
        "--json",
    )
    assert code == 0
    data = json.loads(out)
    for key in (
        "step_time_s",
        "tokens_per_s",
        "model_tflops_per_gpu",
        "mfu",
        "fits",
        "memory",
        "breakdown_s",
    ):
        assert key in data
    for key in ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "peak_bytes"):
        assert data["memory"][key] > 0
    assert set(BREAKDOWN_KEYS) <= set(data["breakdown_s"])
    assert data["config"]["dp"] == 2


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--gpus", "8", "--tp", "3"], "does not divide"),
        (["--gpus", "8", "--tp", "2", "--pp", "2", "--dp", "4"], "does not equal"),
        (["--gpus", "8", "--tp", "8", "--model", "gpt-tiny"], "attention heads"),
        (["--gpus", "8", "--pp", "8", "--dp", "1", "--model", "gpt2-124m"], "not divisible by pp"),
        (["--gpus", "8", "--global-batch", "12", "--microbatch", "1"], "not divisible by microbatch"),
        (["--gpus", "2", "--pp", "2", "--vpp", "4", "--global-batch", "8"], "not divisible by pp"),
    ],
)
def test_inconsistent_configs_exit_2(cli, args, needle):
    code, _, err = cli("estimate", *args)
    assert code == 2
    assert needle in err and err.count("\n") == 1 and "Traceback" not in err


def test_a_config_that_does_not_fit_still_prints(cli):
    code, out, _ = cli("estimate", "--model", "llama2-70b", "--gpus", "8", "--tp", "8", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["fits"] is False and data["memory"]["peak_bytes"] > data["memory"]["capacity_bytes"]


def test_multi_node_ring_runs_both_levels_concurrently() -> None:
    # NCCL's ring crosses NVLink and the NICs in one pipeline: the slower level sets the time
    from coplan.cost.comm import Group

    cluster = load_cluster("dgx-h100", 32)
    g = Group.of(cluster, 16, 2, 1.0)  # 4 members per node on 4 nodes
    assert (g.local, g.nodes) == (4, 4)
    nbytes = 4e9
    nic = cluster.inter_node
    assert nic is not None
    sent = 15 / 16 * nbytes
    expected = sent / 4 / (nic.bandwidth * nic.efficiency)  # the NICs are the slower level here
    tree = math.ceil(math.log2(4)) * (cluster.groups[0].intra_node.latency_s + nic.latency_s)
    # NCCL's reduce-scatter is a ring: 15 steps, 3 of them across nodes; all-reduce may be a tree
    ring = 12 * cluster.groups[0].intra_node.latency_s + 3 * nic.latency_s
    assert g.reduce_scatter(nbytes) == pytest.approx(expected + ring)
    assert g.all_reduce(nbytes) == pytest.approx(2 * (expected + tree))


def test_fp8_sequence_parallel_gathers_one_byte_elements() -> None:
    # Transformer Engine gathers fp8-quantised GEMM inputs; reduce-scatters stay 16-bit
    spec = ModelSpec(
        name="t", n_layers=8, d_model=4096, n_heads=32, vocab_size=4096, seq_len=4096, activation="gelu"
    )
    cluster = load_cluster("dgx-h100", 8)
    base = TrainingConfig(tp=8, dp=1, microbatch=1, global_batch=1, seq=4096, sequence_parallel=True)
    bf16 = CostModel(spec=spec).estimate(cluster, base).stages[0].tp_comm_s
    fp8 = CostModel(spec=spec).estimate(cluster, base.with_(dtype="fp8")).stages[0].tp_comm_s
    # all-gathers are half of the block's collectives by bytes: fp8 saves at most a quarter overall
    assert 0.6 * bf16 < fp8 < 0.9 * bf16


def test_the_step_counter_math_of_a_captured_optimizer_launches_nothing():
    from coplan.capture.api import capture_spec

    graph = capture_spec(PRESETS["gpt-tiny"], 2, 32)
    prof = CostModel(graph=graph).profile(2, 32, "none")
    parts = (*prof.templates, prof.pre, prof.post)
    kernels = [k for part in parts for k in part.optimizer]
    scalar = [
        k for k in kernels if all(not graph.tensors[t].shape for i in k.ops for t in graph.ops[i].inputs)
    ]
    assert scalar and all(k.kind == "free" for k in scalar)  # bias corrections on 0-d tensors
    assert any(k.kind == "vector" for k in kernels)  # the updates themselves are priced


def test_gemm_dims_of_the_attention_output_projection_gradient():
    # the input gradient of the output projection comes out in the head layout (b, heads, s, hd);
    # the GEMM is still (b * s) x (heads * hd) x d_model, not (b * heads * s) x hd x d_model
    from coplan.capture.synthetic import build_graph
    from coplan.cost.profile import profile_graph

    spec = PRESETS["gpt2-124m"]
    b, s, d = 2, 128, spec.d_model
    prof = profile_graph(build_graph(spec, b, s))
    g = prof.graph
    for k in prof.templates[0].backward:
        if k.kind != "matmul":
            continue
        op = g.ops[next(i for i in k.ops if g.ops[i].kind.value == "matmul")]
        if op.module_path.endswith("attn.c_proj") and op.target == "linear_bwd_input":
            assert k.dims == (b * s, d, d)
            assert k.mm_flops == 2 * b * s * d * d
            break
    else:
        raise AssertionError("no input-gradient GEMM of the attention output projection")


# --- dropout, Megatron's loss kernels, stack flags ------------------------------------------------

GPT_DROP = ModelSpec(**{**GPT.to_dict(), "hidden_dropout": 0.1, "attention_dropout": 0.1})


def test_activation_memory_with_dropout_matches_korthikanti():
    # Korthikanti et al. 2022, Sec. 4.1, with dropout: 34sbh + 5as^2b per layer (the two hidden
    # dropout masks, one byte per element; softmax output, dropout mask and dropped probabilities)
    b, s, h, a = 2, 1024, GPT.d_model, GPT.n_heads
    config = TrainingConfig(microbatch=b, global_batch=b, seq=s, dtype="bf16", flash_attention=False)
    got = _one_layer_activations(config, GPT_DROP)
    assert got == pytest.approx(34 * s * b * h + 5 * a * s * s * b, rel=0.01)
    # flash attention keeps (seed, offset), not the mask
    flash = _one_layer_activations(config.with_(flash_attention=True), GPT_DROP)
    plain = _one_layer_activations(config.with_(flash_attention=True))
    assert flash - plain == pytest.approx(2 * s * b * h, abs=64)


def test_dropout_costs_time_and_zero_dropout_changes_nothing():
    config = TrainingConfig(microbatch=2, global_batch=2, seq=1024)
    base, drop = _est(config), _est(config, GPT_DROP)
    zero = _est(config, ModelSpec(**{**GPT.to_dict(), "hidden_dropout": 0.0}))
    assert zero.step_time_s == base.step_time_s
    assert drop.step_time_s > base.step_time_s
    unfused = config.with_(flash_attention=False)
    assert _est(unfused, GPT_DROP).step_time_s - _est(unfused).step_time_s > (
        drop.step_time_s - base.step_time_s
    )


def test_megatron_fusion_writes_the_dropout_mask_from_the_bias_dropout_add_kernel():
    prof = CostModel(spec=GPT_DROP).profile(2, 256)
    g = prof.graph
    fused = [k for k in prof.templates[0].forward if {g.ops[i].target for i in k.ops} == {"dropout", "add"}]
    assert len(fused) == 2  # after attention and after the MLP
    t = 2 * 256 * GPT.d_model
    # reads the projection output and the residual, writes the sum and the one-byte mask
    # (the projection output is in the tensor-parallel slot, the residual stream replicated)
    assert fused[0].bytes[0] + fused[0].bytes[1] == pytest.approx(3 * t)
    assert fused[0].bytes[4] == pytest.approx(t)


def _head_bytes(impl: str, spec: ModelSpec) -> tuple[float, float]:
    from coplan.cost.kernels import Scale
    from coplan.cost.parts import vdot

    prof = CostModel(spec=spec).profile(1, 256)
    w = Scale(1, False, (2.0, 2.0, 4.0, 4.0, 1.0, 1.0), 2, True).weights
    for name, f, b, _, _ in prof.post.loss_variants:
        if name == impl:
            return tuple(sum(vdot(k.bytes, w) for k in ks if k.kind == "vector") for ks in (f, b))  # type: ignore[return-value]
    raise AssertionError(impl)


@pytest.mark.parametrize(
    ("fusion", "loss", "low", "high"),
    [
        ("megatron", "none", 2.0, 2.05),
        ("megatron", "native", 2.0, 2.05),
        ("megatron", "te", 0.0, 0.1),
        ("none", "none", 8.0, 8.05),
    ],
)
def test_loss_temporaries_follow_the_kernels_that_run(fusion, loss, low, high):
    # the head dominates (vocabulary 65,536 against width 256): the transient working set is its
    # loss's. Megatron's kernels keep one fp32 buffer (counted as saved) and work in place, so only
    # the 16-bit logits and the 16-bit gradient handed back are temporaries: 2 bytes a logit.
    # Transformer Engine's keeps the 16-bit logits and writes the gradient into them: none (the
    # blocks' own temporaries are what is left). The IR's own log_softmax + nll_loss (eager) hold
    # two fp32 gradients at once: 8 bytes a logit.
    spec = ModelSpec(
        name="v", n_layers=2, d_model=256, n_heads=4, vocab_size=65536, seq_len=512, tied_embeddings=False
    )
    cfg = TrainingConfig(microbatch=4, global_batch=4, seq=512, dtype="bf16", fusion=fusion, loss_fusion=loss)
    est = CostModel(spec=spec).estimate(load_cluster("dgx-h100", 1), cfg)
    assert low <= est.memory.transient_bytes / (4 * 512 * 65536) <= high


def test_megatron_vocab_parallel_cross_entropy_passes():
    spec = ModelSpec(name="v", n_layers=1, d_model=256, n_heads=4, vocab_size=32768, seq_len=256)
    logits = 256 * 32768
    fwd, bwd = _head_bytes("none", spec)
    # float() 2 + 4, max 4, sub 8, exp 8, sum 4, div 8 = 38; mul 8 and the cast back 6 = 14 per logit
    assert fwd / logits == pytest.approx(38, rel=0.02)  # (the final norm's traffic is ~1/V of it)
    assert bwd / logits == pytest.approx(14, rel=0.02)
    te_fwd, te_bwd = _head_bytes("te", spec)
    assert te_fwd / logits == pytest.approx(6, rel=0.02) and te_bwd / logits == pytest.approx(4, rel=0.02)
    cluster = load_cluster("h100-sxm")
    config = TrainingConfig(microbatch=1, global_batch=1, seq=256)
    times = [
        CostModel(spec=spec).estimate(cluster, config.with_(loss_fusion=f)).step_time_s
        for f in ("none", "native", "te")
    ]
    assert times[0] > times[1] > times[2]
    with pytest.raises(ConfigError, match="loss_fusion"):
        TrainingConfig(loss_fusion="liger")


def test_blocking_pipeline_sends_and_16_bit_gradients():
    config = TrainingConfig(pp=2, vpp=2, dp=4, microbatch=1, global_batch=32, seq=512, zero=1)
    overlapped, blocking = _est(config), _est(config.with_(overlap_p2p=False))
    assert blocking.breakdown_s["pp_comm"] > overlapped.breakdown_s["pp_comm"]
    half = _est(config.with_(grad_reduce_fp32=False))
    assert half.memory.grads_bytes == pytest.approx(overlapped.memory.grads_bytes / 2)


def test_interleaved_last_stage_holds_one_microbatch_of_logits():
    from coplan.cost.stages import chunk_in_flight as _chunk_in_flight
    from coplan.cost.stages import in_flight as _in_flight

    # the last stage's last chunk runs one forward then its backward
    assert _chunk_in_flight(3, 4, 10, 32, 9) == 1
    # stage 0 holds chunk 0 of the first p microbatches and of p - 1 more
    assert _chunk_in_flight(0, 4, 10, 32, 0) == 7 and _in_flight(0, 4, 10, 32) == 43
    assert _chunk_in_flight(1, 4, 1, 32, 0) == _in_flight(1, 4, 1, 32) == 3


# --- recompute accounting (known bugs) -------------------------------------------------------------


def test_recomputing_a_block_output_prices_the_chain_back():
    cm = CostModel(spec=GPT)
    config = TrainingConfig(microbatch=2, global_batch=2, seq=512)
    part = cm.profile(2, 512).templates[0]
    names = frozenset(n for _, n, _ in part.saved_items)
    keep_out = names - {n for n in names if n.endswith("mlp_residual")}
    full, all_of, megatron = (_est(config.with_(recompute=r)) for r in ("full", names, keep_out))
    # Megatron's full recompute is the set keeping the block output: same memory, same re-run
    assert megatron.memory.activations_bytes == full.memory.activations_bytes
    # dropping the output too frees it, but every block must first re-run the blocks before it
    assert all_of.memory.activations_bytes < full.memory.activations_bytes
    fwd = full.stages[0].forward_s
    assert all_of.breakdown_s["recompute"] > full.breakdown_s["recompute"] + fwd / 2


def test_full_recompute_keeps_each_layer_input_and_the_final_norm_input():
    b, s, h = 2, 512, GPT.d_model
    cluster = load_cluster("h100-sxm", 2)
    none = TrainingConfig(microbatch=b, global_batch=2 * b, seq=s, pp=2)
    full = none.with_(recompute="full")
    est = CostModel(spec=GPT).estimate(cluster, full)
    ref = CostModel(spec=GPT).estimate(cluster, none)
    layer_in = 2 * s * b * h
    # stage 0 (2 microbatches in flight): its 2 layer inputs, the first being the embedding output,
    # which the embedding side keeps anyway (counted once); the rest of the embedding side as is.
    # Without recompute stage 0 keeps its blocks' saved tensors less the output it sent (freed)
    embedding = ref.stages[0].memory.activations_bytes - 2 * _blocks_none(ref) + 2 * layer_in
    assert est.stages[0].memory.activations_bytes == pytest.approx(
        2 * 2 * layer_in + embedding - 2 * layer_in
    )
    # last stage (one microbatch): its 2 layer inputs and the final norm's input, and the head;
    # without recompute it keeps its blocks' saved tensors and the input it received
    head = ref.stages[1].memory.activations_bytes - _blocks_none(ref) - layer_in
    assert est.stages[1].memory.activations_bytes == pytest.approx(3 * layer_in + head)


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_pipeline_stages_hold_received_inputs_and_free_or_keep_sent_outputs(recompute):
    b, s, h = 2, 512, GPT.d_model
    cluster = load_cluster("h100-sxm", 2)
    megatron = TrainingConfig(microbatch=b, global_batch=4 * b, seq=s, pp=2, recompute=recompute)
    torch_pp = megatron.with_(pipeline_keeps_outputs=True)
    a, k = (CostModel(spec=GPT).estimate(cluster, c) for c in (megatron, torch_pp))
    boundary = 2 * s * b * h  # one (mb, seq, d) bf16 activation
    # the receiving stage holds its input either way; only the sender's choice differs: stage 0
    # (2 microbatches in flight) keeps 2 sent outputs more when the stack backpropagates through them
    assert k.stages[1].memory.activations_bytes == pytest.approx(a.stages[1].memory.activations_bytes)
    assert k.stages[0].memory.activations_bytes - a.stages[0].memory.activations_bytes == pytest.approx(
        2 * boundary
    )
    # under Megatron the boundary is held once, by the receiver: the two stages' activations, each
    # at one microbatch in flight, add up to the unpipelined model's
    one = TrainingConfig(microbatch=b, global_batch=4 * b, seq=s, recompute=recompute)
    whole = CostModel(spec=GPT).estimate(load_cluster("h100-sxm", 1), one)
    per_mb0 = a.stages[0].memory.activations_bytes / 2
    assert per_mb0 + a.stages[1].memory.activations_bytes == pytest.approx(
        whole.memory.activations_bytes, rel=1e-9
    )


def _blocks_none(est) -> float:
    """Activation bytes two blocks keep for one microbatch without recompute (bf16 weights)."""
    from coplan.cost.parts import vdot

    part = CostModel(spec=GPT).profile(est.config.microbatch, est.config.seq).templates[0]
    return 2 * vdot(part.saved["none"], (2.0, 2.0, 4.0, 4.0, 1.0, 1.0))


def test_cpu_cluster_sizes_to_two_processes():
    cluster = load_cluster("cpu", 2)
    est = CostModel(spec=PRESETS["gpt-tiny"]).estimate(
        cluster, TrainingConfig(dp=2, microbatch=2, global_batch=8, seq=64)
    )
    assert est.gpus == 2 and est.breakdown_s["dp_comm"] >= 0


# --- ZeRO-3 -----------------------------------------------------------------------------------------


def test_zero3_pays_per_layer_latency_and_holds_gathered_layers():
    from coplan.cost.comm import Group
    from coplan.cost.zero import zero3_exposed, zero3_transient

    cluster = load_cluster("dgx-h100", 1024)
    g = Group.of(cluster, 1024, 1, 1.0)
    p = 8e9
    one = zero3_exposed(g, p, 1, 2, 2, 0.0)
    many = zero3_exposed(g, p, 80, 2, 2, 0.0)
    # the same bytes in 80 collectives each way pay 79 more ring latencies (1023 steps each)
    ring = 896 * cluster.groups[0].intra_node.latency_s + 127 * cluster.inter_node.latency_s  # type: ignore[union-attr]
    assert many - one == pytest.approx(3 * 79 * ring, rel=1e-6)
    # compute hides all but the first gather and the last reduce-scatter
    hidden = zero3_exposed(g, p, 80, 2, 2, 1e3)
    assert hidden == pytest.approx(g.all_gather(p / 80 * 2) + g.reduce_scatter(p / 80 * 2))
    assert zero3_transient(p, 80, 2, 4) == pytest.approx(p / 80 * 8)
    config = TrainingConfig(dp=8, microbatch=1, global_batch=8, seq=256)
    z1, z3 = _est(config.with_(zero=1)), _est(config.with_(zero=3))
    assert z3.memory.transient_bytes > z1.memory.transient_bytes


@pytest.mark.parametrize("overlap", [False, True])
def test_zero2_reduces_gradients_every_microbatch(overlap):
    # ZeRO-2 holds only its shard of the gradients, so each of the m microbatches reduce-scatters;
    # ZeRO-1 (Megatron's distributed optimizer) accumulates whole gradients and reduces once. The
    # same reduction shows m times instead of once: m - 1 more, each what its own backward cannot
    # hide (all of it without overlap). With one microbatch both are the same step.
    m = 4
    config = TrainingConfig(dp=16, microbatch=1, global_batch=16 * m, seq=256, overlap_grad_reduce=overlap)
    z1, z2 = _est(config.with_(zero=1)), _est(config.with_(zero=2))
    once = z1.stages[0].dp_comm_s
    assert once > 0
    assert z2.step_time_s - z1.step_time_s == pytest.approx((m - 1) * once, rel=1e-9)
    assert z2.breakdown_s["zero_comm"] - z1.breakdown_s["zero_comm"] == pytest.approx(
        (m - 1) * once, rel=1e-9
    )
    assert z2.memory.peak_bytes < z1.memory.peak_bytes
    single = config.with_(global_batch=16)
    assert _est(single.with_(zero=2)).step_time_s == pytest.approx(_est(single.with_(zero=1)).step_time_s)


def test_fp8_keeps_gemm_inputs_in_one_byte():
    # Transformer Engine keeps the fp8 copy of a GEMM's input: the norm outputs and the GeLU
    # output (4h) drop to one byte per element, the attention output gains a one-byte copy
    b, s, h = 2, 1024, GPT.d_model
    config = TrainingConfig(microbatch=b, global_batch=b, seq=s, dtype="bf16")
    bf16 = _one_layer_activations(config, on="dgx-h100")
    fp8 = _one_layer_activations(config.with_(dtype="fp8"), on="dgx-h100")
    assert bf16 - fp8 == pytest.approx((1 + 1 + 4 - 1) * s * b * h)
    # an A100 has no fp8 units: Transformer Engine would not run fp8 there, and the GEMMs are bf16
    assert _one_layer_activations(config.with_(dtype="fp8")) == _one_layer_activations(config)


def test_megatron_fused_kernels_recompute_norm_and_swiglu_intermediates():
    # Transformer Engine's RMSNorm backward rebuilds x * rstd from x and rstd, and Megatron's fused
    # SwiGLU keeps its input and recomputes SiLU: under the Megatron stack neither is stored, while
    # eager kernels (PyTorch's composites) keep both. GPT's LayerNorm and GeLU keep the same set.
    b, s = 2, 64
    llama = CostModel(spec=PRESETS["llama-tiny"])
    spec = PRESETS["llama-tiny"]
    megatron = llama.profile(b, s, "megatron").templates[0].saved["none"]
    eager = llama.profile(b, s, "none").templates[0].saved["none"]
    # elements per block: two norms' normalized inputs (b x s x d) and SiLU's output (b x s x ffn)
    dropped = 2 * b * s * spec.d_model + b * s * spec.ffn
    assert sum(eager) - sum(megatron) == dropped
    gpt = CostModel(spec=GPT)
    assert (
        gpt.profile(b, s, "megatron").templates[0].saved["none"]
        == gpt.profile(b, s, "none").templates[0].saved["none"]
    )


def test_megatron_fused_kernels_neither_write_nor_read_what_they_recompute():
    # Megatron's bias_swiglu runs SiLU and the product as one forward kernel (read gate and up,
    # write the product: 3 passes of b x s x ffn) and one backward kernel that recomputes SiLU
    # (read the gradient, gate and up, write both gradients: 5 passes), where eager PyTorch runs
    # four kernels (2 + 3 + 5 + 3 passes). Transformer Engine's RMSNorm neither writes its
    # normalized input in forward nor reads it in backward (b x s x d each way).
    b, s = 2, 64
    spec = PRESETS["llama-tiny"]
    cm = CostModel(spec=spec)
    act, hidden = b * s * spec.ffn, b * s * spec.d_model

    def kernels(mode: str, path: str) -> dict[tuple[str, ...], float]:
        prof = cm.profile(b, s, mode)
        part, g = prof.templates[0], prof.graph
        return {
            tuple(g.ops[i].name.rsplit("_", 1)[0] for i in k.ops): sum(k.bytes)
            for k in (*part.forward, *part.backward)
            if k.kind == "vector" and {g.ops[i].module_path for i in k.ops} == {path}
        }

    fused, eager = kernels("megatron", "h.0.mlp"), kernels("none", "h.0.mlp")
    assert fused == {("silu", "mul"): 3 * act, ("mul_bwd", "silu_bwd"): 5 * act}
    assert eager == {("silu",): 2 * act, ("mul",): 3 * act, ("mul_bwd",): 5 * act, ("silu_bwd",): 3 * act}
    fused, eager = kernels("megatron", "h.0.ln_1"), kernels("none", "h.0.ln_1")
    for name in (("rms_norm",), ("norm_bwd",)):
        assert eager[name] - fused[name] == hidden


def test_attention_logsumexp_is_kept_in_fp32_under_16_bit_training():
    # flash kernels write their logsumexp in fp32 whatever the training dtype: in a block's saved
    # vector (activation-width, fp32, byte entries; replicated and tensor-parallel each) it is the
    # only fp32-class tensor, and it is sharded with the heads
    b, s = 2, 512
    part = CostModel(spec=GPT).profile(b, s).templates[0]
    _, _, f32_r, f32_t, _, _ = part.saved["none"]
    assert (f32_r, f32_t) == (0.0, float(b * GPT.n_heads * s))


def test_estimate_dropout_flags_override_the_model(cli):
    base = ["--model", "gpt-tiny", "--cluster", "h100-sxm", "--microbatch", "2", "--json"]

    def step_and_acts(*extra):
        code, out, _ = cli("estimate", *base, *extra)
        assert code == 0
        data = json.loads(out)
        return data["step_time_s"], data["memory"]["activations_bytes"]

    plain = step_and_acts()
    assert step_and_acts("--hidden-dropout", "0", "--attention-dropout", "0") == plain  # the preset's 0
    dropped = step_and_acts("--hidden-dropout", "0.1", "--attention-dropout", "0.1")
    assert dropped[0] > plain[0] and dropped[1] > plain[1]  # mask kernels and 1-byte masks saved
    code, out, err = cli("estimate", *base, "--hidden-dropout", "1.5")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and "--hidden-dropout" in err


def test_interleaved_stage_holds_its_own_chunks():
    # stage s of an interleaved pipeline runs chunks s, s + p, ...: with chunks of 1, 2, 3, 4 layers
    # on two stages, stage 0 holds 1 + 3 and stage 1 holds 2 + 4
    spec = ModelSpec(name="t", n_layers=10, d_model=256, n_heads=4, vocab_size=512, seq_len=128)
    config = TrainingConfig(pp=2, vpp=2, microbatch=1, global_batch=4, stage_layers=(1, 2, 3, 4))
    est = CostModel(spec=spec).estimate(load_cluster("dgx-h100", 2), config)
    assert [st.layers for st in est.stages] == [4, 6]
    # the stage with more layers is the slower one (the head's work is small at this width)
    assert est.stages[1].forward_s > est.stages[0].forward_s


def test_a_tied_embedding_is_held_once_per_stage_holding_both_ends() -> None:
    """GPT-2 ties its output projection to the token embedding: one stage holding both ends keeps
    one tensor (what ``nn.Module.parameters()`` counts); two stages each keep their own copy."""
    import torch

    from coplan.models.transformer import Transformer

    spec = PRESETS["gpt-tiny"]
    assert spec.tied_embeddings
    with torch.device("meta"):
        real = sum(p.numel() for p in Transformer(spec).parameters())
    model = CostModel(spec=spec)
    one = model.estimate(
        load_cluster("dgx-h100", 1), TrainingConfig(microbatch=1, global_batch=1, seq=64, dtype="fp32")
    )
    assert one.memory.params_bytes == 4 * real
    two = model.estimate(
        load_cluster("dgx-h100", 2), TrainingConfig(microbatch=1, global_batch=2, seq=64, pp=2, dtype="fp32")
    )
    embedding = spec.vocab_size * spec.d_model
    assert sum(st.memory.params_bytes for st in two.stages) == 4 * (real + embedding)


def test_deepspeeds_pipeline_engine_sends_the_whole_activation_from_every_tensor_parallel_rank():
    """``pp_send="whole"`` (DeepSpeed's ``_exec_send_activations``): each tensor-parallel rank sends
    the stage's whole activation, and the forward send carries the causal mask in fp16, where
    Megatron's scatter-gather sends 1/t and all-gathers it: exactly one point-to-point time each."""
    from coplan.cost.comm import p2p_time

    # TP inside a node, the two stages on two nodes: the sends cross the network
    config = TrainingConfig(tp=8, pp=2, dp=1, microbatch=2, global_batch=8, seq=512, zero=1)
    cluster = load_cluster("dgx-h100", config.gpus)
    net = cluster.groups[0].device.efficiency_of("network")
    whole = _est(config.with_(pp_send="whole"))
    activation = 512 * 2 * GPT.d_model * 2  # [seq, microbatch, hidden] in 16 bits
    send = p2p_time(cluster, activation, True, net)
    first, last = whole.stages[0].pp_comm_s, whole.stages[1].pp_comm_s
    assert first == pytest.approx(send + p2p_time(cluster, 2 * 512**2, True, net))
    assert last == pytest.approx(send)  # the gradient: no mask
    split = _est(config)
    assert split.stages[1].pp_comm_s < last  # 1/t over the network, the gather over NVLink
    # sequence-parallel activations are already split: only the mask differs
    sp = config.with_(sequence_parallel=True)
    assert _est(sp.with_(pp_send="whole")).stages[1].pp_comm_s == pytest.approx(_est(sp).stages[1].pp_comm_s)
    with pytest.raises(ConfigError, match="pp_send"):
        TrainingConfig(pp_send="broadcast")
