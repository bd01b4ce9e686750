"""Eager PyTorch's saved tensors for a torchtitan-style Llama block, measured on this CPU against
what the ``torchtitan`` stack prices (``coplan.cost.eager``): with grouped-query attention too,
where ``repeat_kv`` copies the key/value heads before SDPA, which saves the copies."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from autograd_saved import saved_storages

from coplan.cost import CostModel, TrainingConfig, load_stack
from coplan.cost.eager import gqa_repeat, repeat_kv_saved
from coplan.hardware import load_cluster
from coplan.models.spec import PRESETS, ModelSpec

SEQ, MB = 128, 2
PROBE = Path(__file__).resolve().parents[2] / "benchmarks" / "data"


def _spec(layers: int, kv: int) -> ModelSpec:
    return ModelSpec(name="tt", n_layers=layers, d_model=256, n_heads=8, n_kv_heads=kv, ffn_hidden=704,
                     vocab_size=1024, seq_len=SEQ, activation="swiglu", norm="rmsnorm", position="rope",
                     tied_embeddings=False, bias=False)  # fmt: skip


def _probe():  # type: ignore[no-untyped-def]
    """The step probe (``benchmarks/data/h100_step_probe.py``): its torchtitan-style block."""
    sys.path.insert(0, str(PROBE))
    try:
        import h100_step_probe as probe
    finally:
        sys.path.remove(str(PROBE))
    return probe


def _measured_per_block(s: ModelSpec, compile: bool = False) -> float:
    """Bytes one block saves for backward (two blocks less one), bf16, parameters and each block's
    input excluded: the step probe's torchtitan-style block, eager or each block compiled
    (torchtitan's ``apply_compile``)."""
    probe = _probe()
    table = probe.rope_table(s.head_dim, SEQ, s.rope_theta)

    def saved(n: int) -> int:
        torch.manual_seed(0)
        if compile:
            torch._dynamo.reset()
        blocks = [probe.Block(s).to(torch.bfloat16) for _ in range(n)]
        skip = {p.untyped_storage().data_ptr() for b in blocks for p in b.parameters()}
        skip.add(table.untyped_storage().data_ptr())
        x = torch.randn(MB, SEQ, s.d_model, dtype=torch.bfloat16, requires_grad=True)
        with saved_storages(skip) as seen:
            for b in blocks:
                skip.add(x.untyped_storage().data_ptr())
                x = (torch.compile(b) if compile else b)(x, table)
        return sum(seen.values())

    return float(saved(2) - saved(1))


def priced_vector_kernels(stack: str, kv: int, layers: int) -> tuple[float, float]:
    """(kernels, bytes) of the non-GEMM, non-attention kernels ``stack`` prices for the blocks of
    ``_spec(layers, kv)`` in one microbatch, nothing recomputed; bytes from each kernel's time less
    its launch at the H100's memory rate."""
    from coplan.cost.explain import kernel_costs

    cluster = load_cluster("dgx-h100", 1)
    dev = cluster.groups[0].device
    rate, launch = dev.memory_bandwidth * dev.efficiency["memory"], dev.kernel_launch_s
    model = CostModel(spec=_spec(layers, kv))
    base = TrainingConfig(microbatch=MB, global_batch=MB, seq=SEQ)
    config = load_stack(stack).configure(base).with_(recompute="none")
    rows = [
        k
        for k in kernel_costs(model.profile_for(config), cluster, config)
        if k.part.startswith("block") and k.kind == "vector"
    ]
    return sum(k.count for k in rows), sum(k.count * (k.seconds - launch) * rate for k in rows)


def _priced_per_block(kv: int, stack: str = "torchtitan") -> float:
    base = TrainingConfig(microbatch=MB, global_batch=MB, seq=SEQ)
    config = load_stack(stack).configure(base).with_(recompute="none")
    cluster = load_cluster("dgx-h100", 1)

    def act(layers: int) -> float:
        return CostModel(spec=_spec(layers, kv)).estimate(cluster, config).memory.activations_bytes

    return act(2) - act(1)


@pytest.mark.capture
@pytest.mark.parametrize("kv", [8, 2])
def test_eager_block_saves_what_the_torchtitan_stack_prices(kv):
    measured = _measured_per_block(_spec(1, kv))
    assert measured == _measured_per_block(_spec(1, 8))  # repeated K/V: as many as the query heads
    # within 0.1%: the IR prices the two blocks' shared storage (the RoPE table) as measured here
    assert _priced_per_block(kv) == pytest.approx(measured, rel=1e-3)


def test_repeat_kv_is_priced_only_for_grouped_query_attention():
    from coplan.capture.synthetic import build_graph

    for kv, expect in ((8, 0.0), (2, 3 * (8 - 2) * 32 * SEQ * MB)):
        g = build_graph(_spec(1, kv), MB, SEQ)
        attn = [op for op in g.ops if op.kind.name == "ATTENTION" and op.forward_op is None]
        assert (gqa_repeat(g, attn[0]) is None) == (kv == 8)
        assert sum(repeat_kv_saved(g, [op.id for op in g.ops])) == expect


def test_fused_rmsnorm_keeps_no_normalized_tensor_and_launches_one_kernel_each_way():
    """torchtitan's fused RMSNorm (``TrainingConfig.fused_rmsnorm``) against the Python one under
    eager PyTorch: each norm saves ``x * rstd`` (tokens x d, 16 bits) less, and launches 1 kernel
    forward and 1 backward instead of 6 + 2 and 13 + 2 (``coplan.cost.eager.PLANS``)."""
    from coplan.cost.eager import PLANS

    layers, tokens, d = 3, MB * SEQ, 256
    spec = _spec(layers, 8)
    config = load_stack("torchtitan").configure(TrainingConfig(microbatch=MB, global_batch=MB, seq=SEQ))
    cluster = load_cluster("dgx-h100", 1)
    model = CostModel(spec=spec)
    python, fused = (model.estimate(cluster, config.with_(fused_rmsnorm=f)) for f in (False, True))
    norms = 2 * layers  # the final norm sits outside the blocks and is not counted here
    assert python.memory.activations_bytes - fused.memory.activations_bytes == norms * tokens * d * 2
    eager = sum(len(PLANS[k][0]) + PLANS[k][1] for k in ("rms_norm", "norm_bwd:rms_norm"))
    assert python.kernels_per_step - fused.kernels_per_step == (norms + 1) * (eager - 2)
    assert fused.step_time_s < python.step_time_s
    # full recompute keeps no norm output either way
    full = [model.estimate(cluster, config.with_(recompute="full", fused_rmsnorm=f)) for f in (False, True)]
    assert full[0].memory.activations_bytes == full[1].memory.activations_bytes


def test_a_stack_whose_model_calls_nn_rmsnorm_runs_the_fused_kernel_where_its_kernels_are_eager():
    """``StackSpec.fused_rmsnorm``: PyTorch dispatches ``nn.RMSNorm`` to its fused kernel on CUDA
    where input and weight share a dtype, as coplan's runner's fp32 stream and weights do, so the
    runner's eager baseline on a GPU prices the fused norm; on a CPU (no fused kernel) its profile
    keeps the IR's kernels, and torchtitan's and fms's RMSNorms are tensor ops of their own."""
    from coplan.apply.predict import mode_stack

    config = TrainingConfig(microbatch=MB, global_batch=MB, seq=SEQ)
    coplan = load_stack("coplan")
    assert coplan.fused_rmsnorm and not coplan.configure(config).fused_rmsnorm  # its own kernels
    assert mode_stack(coplan, "eager", "cuda").configure(config).fused_rmsnorm
    assert not mode_stack(coplan, "eager", "cpu").configure(config).fused_rmsnorm
    assert not mode_stack(coplan, "compile", "cuda").configure(config).fused_rmsnorm
    for name in ("torchtitan", "fsdp", "eager", "megatron", "deepspeed"):
        assert not load_stack(name).fused_rmsnorm
        assert not load_stack(name).configure(config).fused_rmsnorm, name


def test_the_rmsnorm_dispatch_probe_sees_the_composite_ops_on_a_cpu():
    """``benchmarks/data/rmsnorm_dispatch.py`` (run by ``gpu_session.sh`` on a lent GPU, where the
    runner's case should show ``_fused_rms_norm``): on a CPU, which has no fused kernel, every case
    runs ``nn.RMSNorm`` as its composite ops, the mixed-dtype one with PyTorch's fallback warning."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "rmsnorm_dispatch.py"
    spec = importlib.util.spec_from_file_location("rmsnorm_dispatch", path)
    assert spec is not None and spec.loader is not None
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    got = {name: probe.dispatched("cpu", *case) for name, case in probe.CASES.items()}
    assert set(got) == {"runner", "bf16", "mixed"}
    for name, r in got.items():
        assert not r["fused"], name
        assert {"pow", "mean", "rsqrt"} <= set(r["forward"]), name
        assert r["backward"], name
    assert got["mixed"]["fallback_warning"] and not got["runner"]["fallback_warning"]


def test_written_out_attention_moves_the_scores_op_by_op() -> None:
    from dataclasses import replace as dc_replace

    from coplan.cost.kernels import Rates, Scale, eager_scores, kernel_time, launches

    # autocast: 8 passes of 16 bits and 4 of fp32 forward, 10 and 5 backward; without it, 8 and 11
    assert eager_scores(True, 2) == 8 * 2 + 4 * 4 == 32
    assert eager_scores(False, 2) == 10 * 2 + 5 * 4 == 40
    assert (eager_scores(True, 4), eager_scores(False, 4)) == (32, 44)
    spec = PRESETS["gpt-tiny"]
    config = TrainingConfig(
        microbatch=2, global_batch=2, flash_attention=False, kernels="eager", fusion="none"
    )
    prof = CostModel(spec=spec).profile(2, spec.seq_len, "none")
    device = load_cluster("dgx-a100-40gb", 1).groups[0].device
    rates = Rates.of(device, "bf16")
    eager = Scale.of(config)
    fused = dc_replace(eager, eager_attention=False)
    assert eager.eager_attention and not fused.eager_attention
    (block,) = prof.templates
    checked = 0
    for k in (*block.forward, *block.backward):
        if k.kind != "attention":
            continue
        checked += 1
        forward = k.phase.value == "forward"
        bh, sq, sk, _ = k.attn
        # Megatron's fused softmax moves the scores 4 times forward, 7 backward, in 16 bits
        extra_bytes = bh * sq * sk * (eager_scores(forward, 2) - 2 * (4 if forward else 7))
        extra_launches = launches(k, eager) - launches(k, fused)
        # the scale and the mask, and the two casts around the fp32 softmax, each way
        assert extra_launches == 4
        got = kernel_time(k, rates, eager) - kernel_time(k, rates, fused)
        assert got == pytest.approx(extra_bytes / rates.bandwidth + extra_launches * rates.launch_s)
    assert checked == 2  # the attention kernel forward and its gradient


def test_written_out_attention_under_autocast_keeps_an_fp32_and_a_16_bit_copy_of_the_scores() -> None:
    spec = PRESETS["gpt-tiny"]
    cm = CostModel(spec=spec)
    cluster = load_cluster("dgx-a100-40gb", 1)
    base = TrainingConfig(microbatch=2, global_batch=2, flash_attention=False, fusion="none")
    eager = cm.estimate(cluster, base.with_(kernels="eager"))
    megatron = cm.estimate(cluster, base)
    scores = 2 * spec.n_heads * spec.seq_len**2  # batch x heads x s x s per layer
    got = eager.memory.activations_bytes - megatron.memory.activations_bytes
    assert got == pytest.approx(spec.n_layers * scores * 4)


def _head_rows(vocab: int, cluster: str) -> dict[tuple[str, str], list]:
    from dataclasses import replace as _replace

    from coplan.cost.explain import kernel_costs

    spec = _replace(_spec(1, 8), vocab_size=vocab)
    config = load_stack("torchtitan").configure(TrainingConfig(microbatch=MB, global_batch=MB, seq=SEQ))
    if cluster == "cpu":  # a CPU has no FlashAttention-2 rates; the loss does not care
        config = config.with_(attention_kernel="auto")
    model = CostModel(spec=spec)
    rows: dict[tuple[str, str], list] = {}
    for r in kernel_costs(model.profile_for(config), load_cluster(cluster, 1), config):
        if r.part == "head" and r.name.startswith("(top)"):
            rows.setdefault((r.name.split(": ")[-1], r.phase), []).append(r.seconds)
    return rows


def test_aten_log_softmax_over_a_vocabulary_wider_than_shared_memory_reads_its_rows_again():
    """Eager PyTorch's loss (``coplan.cost.eager``): the fp32 cast and ATen's log-softmax as two
    kernels each way; over a row wider than 48 KiB of fp32 ATen's ``cunn_SoftMaxForward`` reads the
    row three times and writes it once (four passes against the staged kernel's two), and its
    backward reads the output gradient twice (four against three). ``nll_loss`` forward is
    token-sized; its backward writes the fp32 gradient once."""
    tokens = MB * SEQ
    device = load_cluster("dgx-h100", 1).device
    bw = device.memory_bandwidth * 0.85  # the preset's memory efficiency
    upcast_rate = device.efficiency_of("memory_upcast")  # 1 on an H100: measured on an H200 only
    launch = device.kernel_launch_s
    wide, narrow = 16384, 8192  # 64 KiB and 32 KiB rows of fp32
    for vocab, passes in ((wide, (4, 4)), (narrow, (2, 3))):
        rows = _head_rows(vocab, "dgx-h100")
        fwd = sorted(rows[("log_softmax", "forward")])
        bwd = sorted(rows[("log_softmax_bwd", "backward")])
        assert len(fwd) == len(bwd) == 2  # the cast and the softmax, each way
        logits = tokens * vocab * 4
        # the casts move 16 bits and fp32 per element: forward the upcast, at the device's
        # ``memory_upcast`` share of the rate (ATen's unrolled casting copy), backward the downcast
        up, down = (1.5 * logits / (bw * rate) + launch for rate in (upcast_rate, 1.0))
        for got, n, cast in ((fwd, passes[0], up), (bwd, passes[1], down)):
            softmax = n * logits / bw + launch
            assert got == pytest.approx(sorted((softmax, cast)), rel=0.01)
        assert max(rows[("nll_loss", "forward")]) < 1e-4  # launches only
        assert max(rows[("nll_loss_bwd", "backward")]) == pytest.approx(logits / bw + launch, rel=0.01)
    # on a CPU the passes over one row stay in the core's cache: no extra reads
    from coplan.cost.kernels import Rates

    cpu = load_cluster("cpu", 1).device
    assert not Rates.of(cpu, "bf16", "auto").looped_reductions
    assert Rates.of(device, "bf16", "auto").looped_reductions
    assert len(_head_rows(wide, "cpu")[("log_softmax", "forward")]) == 2


def test_fms_rope_rotates_real_pairs_at_twice_the_fp32_traffic_of_a_complex_product():
    """``eager_rope``: fms's RotaryEmbedding (real pairs times 2 x 2 rotations, then a sum) launches
    four kernels each way per q or k tensor and moves, per element, 8 fp32 and 2 16-bit elements
    forward, where a complex product launches three and moves 4 and 2; the ``fsdp`` preset, which
    prices fms's LLaMA, runs it."""
    from coplan.cost.eager import op_kernels
    from coplan.cost.parts import ACT, F32, TP

    graph = CostModel(spec=_spec(2, 8)).profile(MB, SEQ, "none").graph
    for target in ("rope", "rope_bwd"):
        op = next(o for o in graph.ops if o.target == target)
        # q and k each way: the gradient op writes the fused QKV gradient, and runs over q's and k's
        src = graph.ops[op.forward_op] if op.forward_op is not None else op
        tensors = [graph.tensors[t].numel for t in src.outputs if graph.tensors[t].shape]
        assert len(tensors) == 2
        n = float(sum(tensors))
        for form, kernels, f32 in (("complex", 3, 4.0), ("pairs", 4, 8.0)):
            got = op_kernels(graph, op, TP, float(MB * SEQ), form)
            assert len(got) == kernels * len(tensors)
            assert sum(k.bytes[F32 * 2 + TP] for k in got) == f32 * n
            assert sum(k.bytes[ACT * 2 + TP] for k in got) == 2.0 * n
    assert load_stack("fsdp").eager_rope == "pairs" and load_stack("torchtitan").eager_rope == "complex"
    config = load_stack("fsdp").configure(TrainingConfig(dp=8, global_batch=8))
    assert config.eager_rope == "pairs"
    spec = _spec(2, 8)
    cluster = load_cluster("dgx-h100", 8)
    eager = load_stack("fsdp").configure(TrainingConfig(dp=8, global_batch=8, seq=SEQ))
    slower = CostModel(spec=spec).estimate(cluster, eager).step_time_s
    faster = CostModel(spec=spec).estimate(cluster, eager.with_(eager_rope="complex")).step_time_s
    assert slower > faster


def test_each_eager_upcast_is_a_16_bit_to_fp32_copy_priced_at_the_devices_upcast_rate():
    """``UPCASTS``: every kernel marked is a copy reading 16 bits and writing fp32 per element (the
    ``(1, 1)`` kernels that read fp32 and write 16 bits are the vectorized downcasts); marked, a
    kernel moves its bytes at ``memory_upcast`` of the memory rate on the H200, where it was
    measured, and at the full rate on an H100, whose memory system differs."""
    import dataclasses

    from coplan.cost.eager import PLANS, UPCASTS, op_kernels
    from coplan.cost.kernels import Rates, Scale, memory_s
    from coplan.cost.parts import REPL

    for key, marked in UPCASTS.items():
        big, _ = PLANS[key]
        assert marked and all(big[i] == (1, 1) for i in marked), key
    graph = CostModel(spec=_spec(2, 8)).profile(MB, SEQ, "none").graph
    op = next(o for o in graph.ops if o.target == "rms_norm")
    got = op_kernels(graph, op, REPL, float(MB * SEQ))
    assert [k.upcast for k in got] == [True] + [False] * (len(got) - 1)
    config = TrainingConfig(microbatch=MB, global_batch=MB, seq=SEQ)
    scale = Scale.of(config)
    up, plain = got[0], dataclasses.replace(got[0], upcast=False)
    for cluster, rate in (("dgx-h200", 0.47), ("dgx-h100", 1.0)):
        r = Rates.of(load_cluster(cluster, 1).device, "bf16", "auto")
        assert memory_s(up, r, scale) == pytest.approx(memory_s(plain, r, scale) / rate)


def test_inductor_leaves_a_complex_rope_to_aten_between_generated_fp32_casts():
    """``INDUCTOR_FALLBACKS``: under ``torch.compile`` a RoPE written with complex numbers runs
    ATen's complex product between a generated cast to fp32 pairs and one back (three kernels per
    q or k tensor each way, the casts vectorized: no ``upcast``); a real-valued RoPE (fms's pairs)
    is generated code like any pointwise op, and the compiled step with a complex RoPE is priced
    slower."""
    from coplan.cost.eager import inductor_kernels
    from coplan.cost.parts import run_kernels

    spec = _spec(2, 8)
    model = CostModel(spec=spec)
    config = load_stack("torchtitan-compile").configure(
        TrainingConfig(microbatch=MB, global_batch=MB, seq=SEQ)
    )
    assert config.kernels == "inductor" and config.eager_rope == "complex"
    profile = model.profile_for(config)
    graph = profile.graph
    fwd, bwd = run_kernels(profile.templates[0], config.loss_fusion, config.activation_fusion)
    got_f, got_b = inductor_kernels(graph, fwd, bwd, lambda op: 0, "complex")

    def rope_op(k):  # type: ignore[no-untyped-def]
        real = [graph.ops[i] for i in k.ops if graph.ops[i].kind.name != "VIEW"]
        return next((o for o in real if o.target in ("rope", "rope_bwd")), None)

    holding = [k for k in (*fwd, *bwd) if rope_op(k) is not None]
    # the forward RoPE alone, its gradient in a group with the add summing it into the fused QKV
    # gradient: each kernel holding one becomes three kernels for q and three for k
    assert sorted(rope_op(k).target for k in holding) == ["rope", "rope_bwd"]
    assert any(len(k.ops) > 1 for k in holding)
    kept = [k for k in (*got_f, *got_b) if k not in (*fwd, *bwd)]
    assert len(kept) == 3 * 2 * len(holding) and not any(k.upcast for k in kept)
    assert len(got_f) + len(got_b) == len(fwd) + len(bwd) - len(holding) + 3 * 2 * len(holding)
    assert inductor_kernels(graph, fwd, bwd, lambda op: 0, "pairs") == (tuple(fwd), tuple(bwd))
    cluster = load_cluster("dgx-h100", 1)
    complex_s = model.estimate(cluster, config).step_time_s
    pairs_s = model.estimate(cluster, config.with_(eager_rope="pairs")).step_time_s
    assert complex_s > pairs_s


def test_the_logits_reach_the_loss_as_each_stack_casts_them():
    """``eager_loss_cast``: the model's ``.float()`` (a cast kernel and an fp32 copy each way),
    ``F.cross_entropy`` under autocast (a 16-bit log-softmax, then ``nll_loss``'s cast of the
    log-probabilities to fp32), or the loss in 16 bits (fms-fsdp's, no autocast on bf16 logits)."""
    from coplan.cost.eager import op_kernels
    from coplan.cost.parts import ACT, F32, TP

    vocab = 32768  # wider than ATen's 48 KiB staging in 16 bits (64 KiB) and in fp32
    spec = _spec(1, 8)
    graph = (
        CostModel(spec=type(spec)(**{**spec.to_dict(), "vocab_size": vocab})).profile(MB, SEQ, "none").graph
    )
    rows = float(MB * SEQ)
    n = rows * vocab

    def moved(target: str, form: str) -> tuple[int, float, float, float, float]:
        op = next(o for o in graph.ops if o.target == target)
        got = op_kernels(graph, op, TP, rows, loss=form)
        return (
            len([k for k in got if k.vec_flops > rows]),
            sum(k.bytes[ACT * 2 + TP] for k in got) / n,
            sum(k.bytes[F32 * 2 + TP] for k in got) / n,
            sum(k.loop_reads[ACT * 2 + TP] for k in got) / n,
            sum(k.loop_reads[F32 * 2 + TP] for k in got) / n,
        )

    # (big kernels, 16-bit and fp32 elements moved, 16-bit and fp32 read again) per logit
    assert moved("log_softmax", "float") == (2, 1.0, 3.0, 0.0, 2.0)
    assert moved("log_softmax_bwd", "float") == (2, 1.0, 4.0, 0.0, 1.0)
    # F.cross_entropy under autocast: a 16-bit log-softmax, then nll_loss's cast to fp32
    assert moved("log_softmax", "autocast") == (2, 3.0, 1.0, 2.0, 0.0)
    assert moved("log_softmax_bwd", "autocast") == (2, 4.0, 1.0, 1.0, 0.0)
    assert moved("log_softmax", "none") == (1, 2.0, 0.0, 2.0, 0.0)
    assert moved("log_softmax_bwd", "none") == (1, 3.0, 0.0, 1.0, 0.0)
    assert moved("nll_loss_bwd", "none")[1:3] == (1.0, 0.0)
    assert moved("nll_loss_bwd", "autocast")[1:3] == moved("nll_loss_bwd", "float")[1:3] == (0.0, 1.0)
    # DTensor's loss parallelism: the log-softmax written out (amax, sub, exp, sum, sub) after the
    # .float(); its backward in nll_loss's handler (zeros, exp, add, mul), the cast back after it
    assert moved("log_softmax", "parallel") == (6, 1.0, 9.0, 0.0, 0.0)
    assert moved("log_softmax_bwd", "parallel") == (1, 1.0, 1.0, 0.0, 0.0)
    assert moved("nll_loss_bwd", "parallel") == (4, 0.0, 8.0, 0.0, 0.0)
    casts = {name: load_stack(name).eager_loss_cast for name in ("torchtitan", "fsdp", "eager", "coplan")}
    assert casts == {"torchtitan": "parallel", "fsdp": "none", "eager": "autocast", "coplan": "autocast"}
    cluster = load_cluster("dgx-h100", 1)
    config = load_stack("eager").configure(TrainingConfig(microbatch=MB, global_batch=MB, seq=SEQ))
    model = CostModel(spec=type(spec)(**{**spec.to_dict(), "vocab_size": vocab}))
    step = {
        form: model.estimate(cluster, config.with_(eager_loss_cast=form)).step_time_s
        for form in ("float", "autocast", "none")
    }
    assert step["none"] < step["autocast"] < step["float"]


def test_a_fused_cross_entropy_keeps_the_16_bit_logits_on_the_irs_kernels():
    """``eager_loss_cast="fused"`` (llm-foundry's flash-attn cross-entropy, ``parts.FUSED_LOSS``):
    the loss keeps the 16-bit logits for backward where the IR's keeps fp32 log-probabilities (two
    bytes a logit fewer saved) and holds one 16-bit gradient where the IR's holds two fp32 ones (a
    smaller transient); its time is the IR's own loss kernels', which no eager plan replaces, so
    the step prices below the ``.float()`` form's."""
    from coplan.cost.eager import FUSED_RMSNORM, eager_kernels, shard_class
    from coplan.cost.parts import FUSED_LOSS, loss_variant, run_kernels

    spec = _spec(1, 8)
    model = CostModel(spec=spec)
    prof = model.profile(MB, SEQ, "none")
    logits = MB * SEQ * spec.vocab_size
    assert loss_variant(prof.post, "none", "fused") == FUSED_LOSS
    assert loss_variant(prof.post, "none", "float") == "none"  # no such variant: the IR's loss
    fwd, bwd = run_kernels(prof.post, "none", True)
    assert (fwd, bwd) == (prof.post.forward, prof.post.backward)
    # the loss side less its final norm (a fused one here): the IR's kernels as they are
    fused = eager_kernels(prof.graph, fwd, bwd, shard_class, FUSED_RMSNORM, loss="fused")
    assert fused == (tuple(fwd), tuple(bwd))
    for form in ("float", "autocast", "none"):
        got = eager_kernels(prof.graph, fwd, bwd, shard_class, loss=form)
        assert len(got[0]) + len(got[1]) >= len(fwd) + len(bwd)
    cluster = load_cluster("dgx-h100", 1)
    config = load_stack("fsdp").configure(TrainingConfig(microbatch=MB, global_batch=MB, seq=SEQ))
    est = {f: model.estimate(cluster, config.with_(eager_loss_cast=f)) for f in ("float", "fused")}
    assert est["float"].memory.activations_bytes - est["fused"].memory.activations_bytes == 2 * logits
    assert est["fused"].memory.transient_bytes < est["float"].memory.transient_bytes
    assert est["fused"].step_time_s < est["float"].step_time_s


def test_cli_prices_the_loss_cast_as_named(cli) -> None:  # type: ignore[no-untyped-def]
    """``coplan estimate --eager-loss-cast``: the stack's own form unless named; the named one in
    the JSON config, and a 16-bit loss pricing below ``.float()``'s on an eager stack."""
    import json

    args = (
        "estimate",
        "--model",
        "llama3-8b",
        "--gpus",
        "8",
        "--zero",
        "3",
        "--stack",
        "torchtitan",
        "--json",
    )
    step = {}
    for form in ("float", "none"):
        code, out, err = cli(*args, "--eager-loss-cast", form)
        assert code == 0, err
        data = json.loads(out)
        step[form] = data["step_time_s"]
        assert data["config"].get("eager_loss_cast", "float") == form
    code, out, _ = cli(*args)
    assert json.loads(out)["step_time_s"] == step["float"]  # torchtitan's own .float()
    assert step["none"] < step["float"]
    code, _, err = cli(*args, "--eager-loss-cast", "fp8")
    assert code == 2 and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("kv", [8, 2])
def test_an_eager_blocks_other_kernels_are_the_aten_ops_it_runs(kv):
    """The non-GEMM, non-attention kernels priced for one eager torchtitan-style block beside the
    ATen ops eager PyTorch dispatches for it forward and backward on this CPU (views aside; each a
    kernel on a GPU), by the bytes their tensors hold (read and written once): within 6%, and no
    more kernels priced than ops run."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops = 0
            self.bytes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            name = str(func)
            view = any(a.alias_info is not None for a in func._schema.returns) and not func._schema.is_mutable
            if view or func is torch.ops.aten.detach.default:
                return out
            if any(k in name for k in ("mm.default", "scaled_dot_product", "_unsafe_view")):
                return out
            tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
            self.ops += 1
            self.bytes += sum(t.numel() * t.element_size() for t in tensors)
            return out

    probe = _probe()

    def measured(n: int) -> tuple[int, int]:
        s = _spec(n, kv)
        table = probe.rope_table(s.head_dim, SEQ, s.rope_theta)
        torch.manual_seed(0)
        blocks = [probe.Block(s).to(torch.bfloat16) for _ in range(n)]
        x = torch.randn(MB, SEQ, s.d_model, dtype=torch.bfloat16, requires_grad=True)
        count = Count()
        with count:
            y = x
            for b in blocks:
                y = b(y, table)
            y.float().sum().backward()
        return count.ops, count.bytes

    (o1, m1), (o2, m2) = measured(1), measured(2)
    (k1, b1), (k2, b2) = (
        priced_vector_kernels("torchtitan", kv, 1),
        priced_vector_kernels("torchtitan", kv, 2),
    )
    assert 0.9 * (o2 - o1) <= k2 - k1 <= o2 - o1
    assert b2 - b1 == pytest.approx(m2 - m1, rel=0.06)


def test_flash_attns_variable_length_path_gathers_its_inputs_and_pads_its_output():
    """``attention_unpad`` (llm-foundry's ``attn_impl: flash``): per attention call a gather of q, k
    and v (each read and written once) and a zero fill plus an index-put of the output forward;
    the output gradient's gather and, per input, a zero fill and a scatter backward; and the
    unpadded output kept beside the padded one. A step priced with it is slower and holds more."""
    from coplan.cost.eager import unpad_kernels
    from coplan.cost.parts import ACT, TP

    spec = PRESETS["gpt2-124m"]
    model = CostModel(spec=spec)
    graph = model.profile(MB, SEQ, "none").graph
    fwd = next(o for o in graph.ops if o.kind.name == "ATTENTION" and o.phase.name == "FORWARD")
    bwd = next(o for o in graph.ops if o.forward_op == fwd.id)
    tokens = MB * SEQ
    qkv, out = 3 * tokens * spec.d_model, tokens * spec.d_model
    f, b = unpad_kernels(graph, fwd, TP), unpad_kernels(graph, bwd, TP)
    assert (len(f), len(b)) == (5, 7)
    assert sum(k.bytes[ACT * 2 + TP] for k in f) == pytest.approx(2 * qkv + 3 * out)
    assert sum(k.bytes[ACT * 2 + TP] for k in b) == pytest.approx(2 * out + 3 * qkv)
    cluster = load_cluster("dgx-h100", 1)
    config = load_stack("fsdp").configure(TrainingConfig(microbatch=MB, global_batch=MB, seq=SEQ))
    plain = model.estimate(cluster, config)
    unpadded = model.estimate(cluster, config.with_(attention_unpad=True))
    assert unpadded.step_time_s > plain.step_time_s
    saved = unpadded.memory.activations_bytes - plain.memory.activations_bytes
    assert saved == pytest.approx(spec.n_layers * out * 2)  # one 16-bit output a block
