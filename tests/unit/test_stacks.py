"""Stacks as data: presets, validation, eager decompositions and per-op checkpointing."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from coplan.capture.synthetic import build_graph
from coplan.cost import CostModel, TrainingConfig, load_stack, load_stack_file, stack_names
from coplan.cost.checkpoint import checkpointed_blocks, selective_op_names
from coplan.cost.config import ConfigError
from coplan.cost.eager import PLANS, eager_kernels, op_kernels, shard_class
from coplan.cost.kernels import Rates
from coplan.cost.parts import ACT, F32, REPL, TP
from coplan.cost.stacks import SETTINGS, StackError, StackSpec, stack_from_dict
from coplan.hardware import load_cluster
from coplan.models.spec import ModelSpec

SPEC = ModelSpec(
    name="tiny-llama",
    n_layers=2,
    d_model=256,
    n_heads=4,
    n_kv_heads=2,
    ffn_hidden=512,
    vocab_size=1000,
    seq_len=64,
    activation="swiglu",
    norm="rmsnorm",
    position="rope",
    bias=False,
)


def test_every_preset_loads_and_cites_each_setting_it_gives() -> None:
    names = stack_names()
    for needed in ("megatron", "torchtitan", "fsdp", "deepspeed", "eager", "coplan"):
        assert needed in names
    for name in names:
        s = load_stack(name)
        assert s.name == name
        for setting in SETTINGS:
            assert s.source_of(setting), f"{name}: {setting} has no citation"


def test_megatron_preset_changes_no_configuration() -> None:
    config = TrainingConfig(dp=8, global_batch=16, zero=1, recompute="selective")
    assert load_stack("megatron").configure(config) is config


def test_megatron_preset_prices_exactly_as_before() -> None:
    cm = CostModel(spec=SPEC)
    cluster = load_cluster("dgx-h100", 8)
    for config in (
        TrainingConfig(dp=8, global_batch=16, zero=3, recompute="selective"),
        TrainingConfig(tp=2, dp=4, global_batch=8, zero=1, sequence_parallel=True),
    ):
        before = cm.estimate(cluster, config)
        after = cm.estimate(cluster, load_stack("megatron").configure(config))
        assert after.step_time_s == before.step_time_s
        assert after.memory.peak_bytes == before.memory.peak_bytes


def test_runner_matches_coplan_preset_and_cpu_turns_overlap_off() -> None:
    gpu, cpu = StackSpec.runner("cuda"), StackSpec.runner("cpu")
    assert gpu == load_stack("coplan")
    # SDPA on torch >= 2.10 runs each GPU's own kernel: cuDNN first on Hopper and Blackwell
    assert (gpu.overlap, gpu.attention_kernel) == (True, "auto")
    assert (cpu.overlap, cpu.attention_kernel) == (False, "auto")
    h100 = load_cluster("dgx-h100", 1).device
    assert h100.attention_kernel == "cudnn"


def test_eager_stack_runs_each_op_and_is_slower_than_compiled() -> None:
    cm = CostModel(spec=SPEC)
    cluster = load_cluster("dgx-h100", 1)
    base = TrainingConfig(global_batch=4, microbatch=4)
    eager = load_stack("torchtitan").configure(base)
    compiled = load_stack("torchtitan-compile").configure(base)
    assert (eager.kernels, eager.fusion, eager.attention_kernel) == ("eager", "none", "flash2")
    assert (compiled.kernels, compiled.fusion) == ("inductor", "megatron")
    assert cm.estimate(cluster, eager).step_time_s > cm.estimate(cluster, compiled).step_time_s


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"name": "x", "kernels": "cuda-graphs", "sources": {"kernels": "a"}}, "kernels"),
        ({"name": "x", "kernels": "eager"}, None),
        ({"name": "x", "bogus": 1}, "bogus"),
        ({"name": "x", "reserved_fraction": 1.5, "sources": {"reserved_fraction": "a"}}, "reserved_fraction"),
        ({"name": "x", "checkpointing": ["sometimes"], "sources": {"checkpointing": "a"}}, "checkpointing"),
        (
            {"name": "x", "pipeline_zero_stages": [4], "sources": {"pipeline_zero_stages": "a"}},
            "pipeline_zero_stages",
        ),
        ({"name": "x", "fsdp_pipeline": "always", "sources": {"fsdp_pipeline": "a"}}, "fsdp_pipeline"),
        ({"kernels": "eager"}, "name"),
    ],
)
def test_bad_stack_files_are_refused(data: dict, field: str | None) -> None:
    with pytest.raises(StackError) as info:
        stack_from_dict(data, "f.json")
    if field is not None:
        assert info.value.field == field


def test_stack_file_round_trip(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "mine.json"
    data = load_stack("fsdp").to_dict() | {"name": "mine"}
    path.write_text(json.dumps(data))
    got = load_stack_file(path)
    assert got.name == "mine" and got.kernels == "eager" and got.sharding == "fsdp1"
    path.write_text("{not json")
    with pytest.raises(StackError):
        load_stack_file(path)


def test_a_stack_file_extends_a_preset_keeping_its_citations_but_its_own() -> None:
    base = load_stack("torchtitan")
    got = stack_from_dict(
        {"name": "mine", "extends": "torchtitan", "optimizer": "fused", "sources": {"optimizer": "fork"}},
        "mine.json",
    )
    assert got.name == "mine" and got.optimizer == "fused" and base.optimizer != "fused"
    for setting in SETTINGS:
        if setting != "optimizer":
            assert getattr(got, setting) == getattr(base, setting), setting
            assert got.source_of(setting) == base.source_of(setting), setting
    assert got.source_of("optimizer") == "fork"
    assert got.about == "the torchtitan preset with optimizer from mine.json"
    # and prices as the preset does but for the fused update
    cm = CostModel(spec=SPEC)
    cluster = load_cluster("dgx-h100", 8)
    config = TrainingConfig(dp=8, global_batch=8, zero=3)
    mine, theirs = (cm.estimate(cluster, s.configure(config)) for s in (got, base))
    assert mine.breakdown_s["optimizer"] < theirs.breakdown_s["optimizer"]
    assert mine.breakdown_s["compute"] == theirs.breakdown_s["compute"]


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"name": "x", "extends": "titan"}, "extends"),
        ({"name": "x", "extends": ["fsdp"]}, "extends"),
        ({"name": "x", "extends": "fsdp", "kernels": "inductor"}, "sources"),
        ({"name": "x", "extends": "fsdp", "kernels": "jit", "sources": {"kernels": "a"}}, "kernels"),
    ],
)
def test_bad_extensions_are_refused(data: dict, field: str) -> None:
    with pytest.raises(StackError) as info:
        stack_from_dict(data, "f.json")
    assert info.value.field == field


def _op(graph, target):  # type: ignore[no-untyped-def]
    return next(op for op in graph.ops if op.target == target and op.block == 0)


def test_eager_rms_norm_decomposition_counts() -> None:
    g = build_graph(SPEC, 2, 64)
    norm = _op(g, "rms_norm")
    n = float(g.tensors[norm.inputs[0]].numel)
    rows = n / SPEC.d_model
    fwd = op_kernels(g, norm, REPL, rows)
    assert len(fwd) == 6 + 2  # float, pow, mean, mul, type_as, weight mul; eps add, rsqrt
    big = [k for k in fwd if k.vec_flops == n]
    assert sum(k.bytes[ACT * 2 + REPL] for k in big) == 4 * n
    assert sum(k.bytes[F32 * 2 + REPL] for k in big) == 7 * n
    bwd_op = next(op for op in g.ops if op.target == "norm_bwd" and op.forward_op == norm.id)
    bwd = op_kernels(g, bwd_op, REPL, rows)
    assert len(bwd) == 13 + 2
    assert sum(k.bytes[ACT * 2 + REPL] for k in bwd) == 8 * n
    assert sum(k.bytes[F32 * 2 + REPL] for k in bwd) == 19 * n


def test_eager_rope_runs_three_kernels_per_tensor_each_way() -> None:
    g = build_graph(SPEC, 1, 64)
    rope = _op(g, "rope")
    ks = op_kernels(g, rope, shard_class(rope), 64.0)
    q, k = (float(g.tensors[t].numel) for t in rope.outputs)
    assert len(ks) == 2 * len(PLANS["rope"][0]) == 6
    assert sum(x.bytes[F32 * 2 + TP] for x in ks) == 4 * (q + k)


def test_eager_kernels_replace_only_planned_single_op_kernels() -> None:
    cm = CostModel(spec=SPEC)
    prof = cm.profile(1, 64, "none")
    block = prof.templates[0]
    fwd, bwd = eager_kernels(prof.graph, block.forward, block.backward, shard_class)
    norms = sum(1 for op in prof.graph.ops if op.block == 0 and op.target == "rms_norm")
    ropes = sum(1 for op in prof.graph.ops if op.block == 0 and op.target == "rope")
    # each norm: 1 kernel -> 8; each rope: 1 -> 6 (q and k); grouped-query attention (2 key/value
    # heads of 4): the copies of keys and values to every head before it
    assert len(fwd) == len(block.forward) + 7 * norms + 5 * ropes + 2
    assert len(bwd) > len(block.backward)


def test_selective_op_policy_keeps_odd_matmuls_and_attention() -> None:
    g = build_graph(SPEC, 1, 64)
    names = selective_op_names(g)
    # calls: c_attn 1-3 (kept), attn.c_proj 4 (recomputed), c_gate 5 (kept), c_fc 6 (recomputed)
    # attn.c_proj.out is not saved at all (the residual add needs no input for its gradient)
    assert "h.0.mlp.c_fc.out" in names
    assert "h.0.attn.c_attn.out" not in names and "h.0.mlp.c_gate.out" not in names
    assert "h.0.attn.out" not in names
    assert "h.0.ln_1.out" in names
    est = CostModel(spec=SPEC).estimate(
        load_cluster("dgx-h100", 1), TrainingConfig(global_batch=1, recompute=names)
    )
    assert est.breakdown_s["recompute"] > 0


def test_per_op_recompute_regathers_the_tp_inputs_it_drops_on_pytorch_stacks_only() -> None:
    """DTensor's column-parallel linears keep their gathered input; torchtitan's per-op policy
    recomputes the norm outputs they gather (an all-gather is not among the ops it saves), so each
    dropped input is gathered again in backward: one more all-gather of it per microbatch, on the
    PyTorch stacks' kernels. Megatron's sequence parallelism re-gathers (overlapped) either way."""
    names = selective_op_names(build_graph(SPEC, 1, 64))
    assert "h.0.ln_1.out" in names and "h.0.ln_2.out" in names
    cluster = load_cluster("dgx-h100", 2)
    base = TrainingConfig(tp=2, sequence_parallel=True, microbatch=1, global_batch=1, seq=64)
    model = CostModel(spec=SPEC)

    def tp_comm(config: TrainingConfig) -> float:
        return model.estimate(cluster, config).breakdown_s["tp_comm"]

    titan = load_stack("torchtitan").configure(base)
    plain = tp_comm(titan)
    both = tp_comm(titan.with_(recompute=names)) - plain
    attention_input = tp_comm(titan.with_(recompute=names - {"h.0.ln_2.out"})) - plain
    # the two inputs have the same elements (tokens x d_model), so dropping both gathers twice
    assert attention_input > 0 and both == pytest.approx(2 * attention_input, rel=1e-9)
    kept = frozenset(n for n in names if not n.endswith(("ln_1.out", "ln_2.out")))
    assert tp_comm(titan.with_(recompute=kept)) == pytest.approx(tp_comm(titan))
    megatron = base.with_(recompute=names)
    assert tp_comm(megatron) == pytest.approx(tp_comm(base))


def test_dtensor_sequence_parallel_copies_each_gathered_tensor_once_more() -> None:
    """DTensor shards the sequence (dim 1) and NCCL gathers and scatters dim 0, so every
    all-gather's output and every reduce-scatter's input is re-laid out by one copy on the compute
    stream (``torch.cat(torch.chunk(...))``): per TP collective, its full tensor read and written
    once and one launch, on the PyTorch stacks' kernels only."""
    cluster = load_cluster("dgx-h100", 2)
    base = TrainingConfig(tp=2, sequence_parallel=True, microbatch=1, global_batch=1, seq=64)
    model = CostModel(spec=SPEC)
    titan = load_stack("torchtitan").configure(base)
    prof = model.profile(1, 64, titan.fusion)
    r = Rates.of(cluster.groups[0].device, titan.dtype, titan.attention_kernel)
    parts = [(prof.pre, 1), *((t, len(t.blocks)) for t in prof.templates), (prof.post, 1)]
    # forward and backward: each entry's all-gather and its gradient's reduce-scatter, each exit's
    # reduce-scatter and its gradient's all-gather, 16-bit elements
    copies = sum(
        n * 2 * (2 * k * 2 / r.bandwidth + r.launch_s)
        for part, n in parts
        for k in (*part.tp_entries, *part.tp_exits)
    )
    assert copies > 0

    def tp_comm(config: TrainingConfig) -> float:
        return model.estimate(cluster, config).breakdown_s["tp_comm"]

    assert tp_comm(titan) - tp_comm(base) == pytest.approx(copies, rel=1e-9)
    # without sequence parallelism the collectives are all-reduces in place: nothing to re-lay out
    plain = base.with_(sequence_parallel=False)
    assert tp_comm(load_stack("torchtitan").configure(plain)) == pytest.approx(tp_comm(plain))


def test_checkpointed_blocks_follow_each_stacks_rule() -> None:
    # torchtitan: blocks N, 2N, ... (counted from 1)
    assert checkpointed_blocks("selective-layer:2", 40) == 20
    assert checkpointed_blocks("selective-layer:3", 32) == 10
    # fms-fsdp's docstring: p = 1/3 is [no-ac, ac, no-ac, no-ac, ac, no-ac, ...], p = 2/3 is
    # [ac, no-ac, ac, ac, no-ac, ac, ...]
    assert checkpointed_blocks("selective-fraction:0.3333333333", 6) == 2
    assert checkpointed_blocks("selective-fraction:0.6666666667", 6) == 4
    assert checkpointed_blocks("selective-fraction:0.4", 40) == 16
    assert checkpointed_blocks("selective-fraction:1", 80) == 80
    assert checkpointed_blocks("selective-fraction:0", 80) == 0
    assert checkpointed_blocks("full", 40) is None


def test_cli_stack_choices_match_the_presets() -> None:
    from coplan.cli.options import StackName

    assert tuple(sorted(s.value for s in StackName)) == stack_names()


def test_per_op_checkpointing_keeps_what_eager_and_compiled_blocks_keep() -> None:
    # the policy tags each op and Inductor honours the tags, but a compiled block saves only the
    # tagged outputs its backward reads, where eager checkpointing caches every one: each block's
    # MLP down-projection output (measured: tests/unit/test_inductor_saved.py)
    cm = CostModel(spec=SPEC)
    cluster = load_cluster("dgx-h100", 1)
    base = TrainingConfig(global_batch=2, microbatch=2, seq=64)
    kept = {}
    for stack in ("torchtitan", "torchtitan-compile"):
        config = load_stack(stack).configure(base)
        names = selective_op_names(cm.profile(2, 64, config.fusion).graph)
        act = cm.estimate(cluster, config.with_(recompute=names)).memory.activations_bytes
        # beyond each block's input (all full checkpointing keeps; the head is priced apart)
        kept[stack] = act - cm.estimate(cluster, config.with_(recompute="full")).memory.activations_bytes
        assert kept[stack] > 0
    down = SPEC.n_layers * 2 * 64 * SPEC.d_model * 2  # layers x tokens x d, 16-bit
    assert kept["torchtitan"] - kept["torchtitan-compile"] == pytest.approx(down)


def test_fsdp_holds_the_root_unit_gathered_beside_two_blocks_and_one_gradient() -> None:
    from coplan.cost.zero import fsdp_transient, zero3_transient

    block, root = 8e9, 1e9
    # root in the parameter dtype, two of 32 blocks gathered, one block's fp32 gradients
    assert fsdp_transient(block, root, 32, 2, 4) == pytest.approx(root * 2 + block / 32 * (2 * 2 + 4))
    # FSDP1's flat parameters: the unit resharded last is still held (``record_stream``)
    assert fsdp_transient(block, root, 32, 2, 4, flat=True) == pytest.approx(
        root * 2 + block / 32 * (3 * 2 + 4)
    )
    cm = CostModel(spec=SPEC)
    cluster = load_cluster("dgx-h100", 8)
    config = TrainingConfig(dp=8, global_batch=8, zero=3)
    fsdp = cm.estimate(cluster, load_stack("torchtitan").configure(config))
    zero3 = cm.estimate(cluster, config.with_(kernels="eager", fusion="none", attention_kernel="flash2"))
    # the same step with ZeRO-3's even split into blocks: only the units' bytes differ
    blocks = SPEC.n_layers * SPEC.block_params()
    # every parameter the blocks do not own (the IR's embedding, final norm and head): FSDP's
    # parameter shard is 1/8 of them, in fp32
    root = fsdp.memory.params_bytes * 8 / 4 - blocks
    assert root > 0
    got = fsdp.memory.transient_bytes - zero3.memory.transient_bytes
    want = fsdp_transient(blocks, root, 2, 2, 4) - zero3_transient(blocks + root, 2, 2, 4)
    assert got == pytest.approx(want)


def test_an_eager_loss_beside_compiled_blocks_prices_the_loss_side_as_eager() -> None:
    cm = CostModel(spec=SPEC)
    cluster = load_cluster("dgx-h100", 1)
    base = TrainingConfig(global_batch=2, microbatch=2, seq=64)
    compiled = load_stack("torchtitan-compile").configure(base)
    assert not compiled.eager_loss
    split = replace(load_stack("torchtitan-compile"), eager_loss=True).configure(base)
    assert split.eager_loss and split.fusion == compiled.fusion
    eager = load_stack("torchtitan").configure(base)
    est = {c: cm.estimate(cluster, cfg) for c, cfg in (("c", compiled), ("s", split), ("e", eager))}
    # the loss side's unfused kernels (and the logits' fp32 copy) hold more beside the state (this
    # small a step peaks in the optimizer's multi-tensor update, where neither is held)
    held = {c: e.memory.activations_bytes + e.memory.transient_bytes for c, e in est.items()}
    assert held["s"] > held["c"]
    # the blocks stay compiled: the step stays below the all-eager one
    assert est["s"].kernels_per_step < est["e"].kernels_per_step
    # a stack that compiles nothing ignores the flag
    assert not replace(load_stack("torchtitan"), eager_loss=True).configure(base).eager_loss


def test_fsdp_schedule_shows_what_the_neighbouring_unit_cannot_hide() -> None:
    from coplan.cost.zero import fsdp_schedule

    # 3 units, all-gather and reduce-scatter 1 s each, 2 s of forward and 4 s of backward per
    # unit. Forward: gather 0 [0, 1], unit 0 [1, 3] (gather 1 [1, 2]), unit 1 [3, 5] (gather 2
    # [3, 4]), unit 2 [5, 7]. Backward: gather 2 [7, 8], unit 2 [8, 12] (gather 1 [8, 9], its
    # reduce-scatter [12, 13]), unit 1 [12, 16] (gather 0 [13, 14], scatter [16, 17]), unit 0
    # [16, 20], scatter [20, 21]: 21 s for 18 s of compute
    assert fsdp_schedule(3, 1.0, 1.0, 6.0, 12.0) == pytest.approx(3.0)
    # collectives outlasting compute: forward communication cannot hide behind the backward.
    # Forward gathers [0, 3], [3, 6], [6, 9]; units [3, 5], [6, 8], [9, 11]. Backward gather
    # [11, 14]; unit 2 [14, 18] (gather [14, 17], scatter [18, 21]); unit 1 [18, 22] (gather
    # [21, 24], scatter [24, 27]); unit 0 [24, 28], scatter [28, 31]
    assert fsdp_schedule(3, 3.0, 3.0, 6.0, 12.0) == pytest.approx(31.0 - 18.0)
    # without resharding after forward nothing is gathered in backward
    assert fsdp_schedule(3, 1.0, 1.0, 6.0, 12.0, gathers=1) == pytest.approx(2.0)
    # HYBRID_SHARD: each unit's all-reduce across replicas follows its reduce-scatter on its own
    # stream; the last one shows: [21, 23]
    assert fsdp_schedule(3, 1.0, 1.0, 6.0, 12.0, replicate=2.0) == pytest.approx(5.0)


def test_hybrid_shard_keeps_the_collectives_in_the_node_and_shards_within_it() -> None:
    cm = CostModel(spec=SPEC)
    cluster = load_cluster("dgx-h100", 32)
    config = load_stack("fsdp").configure(TrainingConfig(dp=32, global_batch=32, zero=3))
    full, hybrid = cm.estimate(cluster, config), cm.estimate(cluster, config.with_(fsdp_shard=8))
    assert hybrid.memory.optimizer_bytes == pytest.approx(full.memory.optimizer_bytes * 4)
    assert hybrid.stages[0].zero_comm_s != full.stages[0].zero_comm_s
    with pytest.raises(ConfigError):
        config.with_(fsdp_shard=5)


def test_a_compiled_loss_runs_as_inductor_generates_it() -> None:
    from coplan.cost.loss import _PLANS

    # one read of the 16-bit logits forward, one read and one 16-bit write backward
    assert _PLANS["inductor"] == (((1, 0),), 0, ((2, 0),), 0)
    cm = CostModel(spec=SPEC)
    cluster = load_cluster("dgx-h100", 1)
    base = TrainingConfig(global_batch=2, microbatch=2, seq=64)
    compiled = load_stack("torchtitan-compile").configure(base)
    assert compiled.loss_fusion == "inductor"
    megatron_ce = cm.estimate(cluster, compiled.with_(loss_fusion="none"))
    inductor_ce = cm.estimate(cluster, compiled)
    # Megatron's cross-entropy keeps the fp32 softmax and runs six passes; Inductor's keeps the
    # 16-bit logits and runs one each way
    assert inductor_ce.memory.activations_bytes < megatron_ce.memory.activations_bytes
    assert inductor_ce.kernels_per_step < megatron_ce.kernels_per_step
    # an eager loss stays the IR's own; Megatron's preset keeps its default
    assert replace(load_stack("torchtitan-compile"), eager_loss=True).configure(base).loss_fusion == "none"
    assert load_stack("megatron").configure(base).loss_fusion == "none"


def test_a_stack_without_overlap_prices_estimates_as_its_plans() -> None:
    # DeepSpeed's pipeline engine reduces gradients after the last microbatch: coplan estimate
    # --stack deepspeed prices the collectives unhidden, as a plan for the stack is priced
    config = TrainingConfig(dp=8, global_batch=8, zero=1, overlap_param_gather=True)
    got = load_stack("deepspeed").configure(config)
    assert (got.overlap_grad_reduce, got.overlap_param_gather, got.overlap_zero) == (False, False, False)
    kept = load_stack("megatron").configure(config)
    assert (kept.overlap_grad_reduce, kept.overlap_param_gather, kept.overlap_zero) == (True, True, True)
    from coplan.plan import PlanContext

    cm = CostModel(spec=SPEC)
    cluster = load_cluster("dgx-h100", 8)
    ctx = PlanContext(cm, cluster, 8, 64, stack=load_stack("deepspeed"))
    plan = ctx.default_plan()
    priced = ctx.price(plan).step_time_s
    est = cm.estimate(cluster, load_stack("deepspeed").configure(ctx.config_of(plan)))
    assert est.step_time_s == pytest.approx(priced)


def test_fsdp_keeps_one_fp32_shard_where_megatron_keeps_a_16_bit_copy_beside_its_master() -> None:
    """PyTorch FSDP under a mixed-precision policy: the fp32 shard is the parameter and the master
    weight at once, and the reduced gradient comes back in fp32 whatever the reduce dtype: 4 + 4 + 8
    bytes a parameter over the shards; Megatron's ZeRO-3 keeps 2 + 4 + 12."""
    cm = CostModel(spec=SPEC)
    cluster = load_cluster("dgx-h100", 8)
    config = TrainingConfig(dp=8, global_batch=8, zero=3, dtype="bf16")
    got = {}
    for stack, reduce16 in (("torchtitan", False), ("fsdp", True), ("megatron", False)):
        c = load_stack(stack).configure(config.with_(grad_reduce_fp32=not reduce16))
        m = cm.estimate(cluster, c).memory
        got[stack] = (m.params_bytes, m.grads_bytes, m.optimizer_bytes)
    w = got["megatron"][0] / 2  # parameters per GPU
    assert got["megatron"] == pytest.approx((2 * w, 4 * w, 12 * w), rel=1e-12)
    assert got["torchtitan"] == pytest.approx((4 * w, 4 * w, 8 * w), rel=1e-12)
    assert got["fsdp"] == got["torchtitan"]  # a 16-bit reduction comes back in fp32 too


def test_gradient_accumulation_outside_the_gemms_costs_a_pass_over_the_parameters() -> None:
    """Where no ZeRO stage shards the gradients between microbatches, autograd adds each later
    microbatch's gradient into ``.grad`` (old and new read, sum written) and DeepSpeed's
    BF16_Optimizer copies every microbatch's 16-bit gradients into fp32 (2 + 4 + 4 bytes): one
    memory-bound pass over the local parameters after a microbatch's backward, averaged over the
    step's microbatches. Megatron's weight-gradient GEMMs accumulate themselves: nothing."""
    from coplan.cost.optimizer import ACCUMULATION_BYTES, accumulation_s

    assert accumulation_s("fused", 1e9, 8, 1e12) == 0.0
    # four microbatches: the three later ones add 3 x 4 bytes a parameter in fp32
    assert accumulation_s("autograd32", 1e9, 4, 1e12) == pytest.approx(1e9 * 12 * 3 / 4 / 1e12)
    assert accumulation_s("autograd16", 1e9, 4, 1e12) == pytest.approx(1e9 * 6 * 3 / 4 / 1e12)
    assert accumulation_s("autograd16", 1e9, 1, 1e12) == 0.0
    assert accumulation_s("fp32-buffer", 1e9, 1, 1e12) == pytest.approx(1e9 * 10 / 1e12)
    assert set(ACCUMULATION_BYTES) == {"fused", "autograd16", "autograd32", "fp32-buffer", "fsdp-unsharded"}

    cluster = load_cluster("dgx-h100", 8)
    model = CostModel(spec=SPEC)
    device = cluster.groups[0].device
    rate = device.memory_bandwidth * device.efficiency_of("memory")
    params = float(model.profile(1, 64, "megatron").graph.param_count)
    base = TrainingConfig(dp=8, global_batch=32, microbatch=1, seq=64, zero=1)

    def bwd(config: TrainingConfig) -> float:
        return model.estimate(cluster, config).stages[0].backward_s

    for mode in ("autograd16", "autograd32", "fp32-buffer"):
        got = bwd(base.with_(grad_accumulation=mode)) - bwd(base)
        assert got == pytest.approx(accumulation_s(mode, params, 4, rate), rel=1e-9)
    # gradients sharded between microbatches (ZeRO-2): the accumulation is on the shard, left out
    sharded = base.with_(zero=2)
    assert bwd(sharded.with_(grad_accumulation="autograd32")) == pytest.approx(bwd(sharded))
    with pytest.raises(ConfigError, match="grad_accumulation"):
        TrainingConfig(grad_accumulation="later")
    assert "grad_accumulation" not in base.to_dict()
    assert base.with_(grad_accumulation="fp32-buffer").to_dict()["grad_accumulation"] == "fp32-buffer"
    # the presets: Megatron's GEMMs accumulate, the PyTorch stacks' autograd in fp32, DeepSpeed's
    # 16-bit modules in 16 bits
    assert load_stack("megatron").grad_accumulation == "fused"
    assert load_stack("deepspeed").configure(base).grad_accumulation == "autograd16"
    assert load_stack("torchtitan").configure(base).grad_accumulation == "autograd32"


@pytest.mark.parametrize("optimizer", ["fused", "foreach"])
def test_fsdp_gradients_are_not_held_before_backward_with_one_microbatch(optimizer: str) -> None:
    """PyTorch FSDP makes each unit's gradient shard after its backward and ``zero_grad`` drops them
    after the step: with one microbatch the peak is the larger of every activation or every
    gradient beside the parameters, state and working set, not both; with two the first
    microbatch's gradients are held through the second. Multi-tensor AdamW's fp32 list adds a
    moment beside every gradient while it steps."""
    cm = CostModel(spec=SPEC)
    cluster = load_cluster("dgx-h100", 8)
    stack = replace(load_stack("torchtitan"), optimizer=optimizer)
    for batch, held in ((8, False), (16, True)):
        c = stack.configure(TrainingConfig(global_batch=batch, microbatch=1, seq=64, zero=3, dp=8))
        m = cm.estimate(cluster, c).memory
        w, g, o = m.params_bytes, m.grads_bytes, m.optimizer_bytes
        want = w + o + m.transient_bytes + (m.activations_bytes + g if held else max(m.activations_bytes, g))
        if optimizer == "foreach":
            want = max(want, w + g + o + g)  # the moment list: fp32 over the shard, as the gradient
        assert m.peak_bytes == pytest.approx(want)
        assert m.peak_grads_bytes == (g if held or m.peak_bytes == w + g + o + g else 0.0)


@pytest.mark.parametrize("stack", ["megatron", "coplan", "eager"])
@pytest.mark.parametrize("dp", [1, 8])
def test_where_each_stack_keeps_its_gradients(stack: str, dp: int) -> None:
    """Megatron's gradient buffer lives through the run. PyTorch's ``.grad`` is made by backward
    (one microbatch: activations or gradients at the peak, not both); under DDP (ZeRO 0 over
    several ranks) the reducer's buckets hold another copy through the run, so its end of backward
    holds the gradients twice."""
    cm = CostModel(spec=SPEC)
    cluster = load_cluster("dgx-h100", dp)
    for batch, m_ in ((dp, 1), (2 * dp, 2)):
        c = load_stack(stack).configure(TrainingConfig(global_batch=batch, microbatch=1, seq=64, dp=dp))
        assert c.num_microbatches == m_
        m = cm.estimate(cluster, c).memory
        w, g, o, a, t = (
            m.params_bytes,
            m.grads_bytes,
            m.optimizer_bytes,
            m.activations_bytes,
            m.transient_bytes,
        )
        buckets = g if stack != "megatron" and dp > 1 else 0.0
        if stack == "megatron":
            want = w + g + o + a + t
        elif m_ > 1:
            want = w + o + buckets + g + a + t
        else:
            want = w + o + buckets + t + max(a, g)
        assert m.peak_bytes == pytest.approx(want)
