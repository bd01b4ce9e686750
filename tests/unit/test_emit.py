"""``coplan.plan.emit``: a plan as Megatron-LM arguments, a torchtitan TOML, or the coplan run
command; each carries the plan's layout and says in its notes what it cannot express."""

from __future__ import annotations

import argparse
import ast
import shlex
import tomllib
from dataclasses import replace
from typing import Any

import pytest

from coplan.errors import SpecError
from coplan.models.spec import ModelSpec, load_model_spec
from coplan.plan.emit import TARGETS, Emitted, emit
from coplan.plan.types import ParallelPlan, Plan, PrecisionPlan, RematPlan

#: a small Llama-style model: grouped-query attention, SwiGLU, RMSNorm, RoPE, untied, no bias
LLAMA = ModelSpec(
    name="tiny-llama",
    n_layers=8,
    d_model=256,
    n_heads=8,
    n_kv_heads=2,
    vocab_size=1000,
    ffn_hidden=688,
    seq_len=512,
    activation="swiglu",
    norm="rmsnorm",
    position="rope",
    tied_embeddings=False,
    bias=False,
)


def _plan(spec: ModelSpec, gpus: int, **kw: Any) -> Plan:
    base: dict[str, Any] = {
        "model": spec.name,
        "graph": "",
        "cluster": "dgx-h100",
        "gpus": gpus,
        "global_batch": 64,
        "seq": 256,
    }
    return Plan(**(base | kw))


@pytest.fixture(scope="module")
def planned() -> tuple[Plan, ModelSpec]:
    """A plan as ``coplan plan`` makes it for a small job."""
    from coplan.cli.plan_cmd import make_context, run_all

    ctx = make_context("gpt2-124m", "dgx-h100", 8, None, None, None, 0.0)
    plan = run_all(ctx, ["sequential"], None)["sequential"].plan
    return plan, load_model_spec("gpt2-124m")


# --- Megatron-LM: an argparse mirror of the flags emitted (Megatron's names and arities) ------------


def _megatron_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pretrain_gpt.py", exit_on_error=False)
    ints = [
        "--tensor-model-parallel-size",
        "--pipeline-model-parallel-size",
        "--num-layers-per-virtual-pipeline-stage",
        "--decoder-first-pipeline-num-layers",
        "--decoder-last-pipeline-num-layers",
        "--micro-batch-size",
        "--global-batch-size",
        "--seq-length",
        "--max-position-embeddings",
        "--num-layers",
        "--hidden-size",
        "--num-attention-heads",
        "--ffn-hidden-size",
        "--num-query-groups",
        "--rotary-base",
        "--recompute-num-layers",
        "--num-experts",
        "--moe-router-topk",
    ]
    for f in ints:
        p.add_argument(f, type=int)
    for f in ["--norm-epsilon", "--hidden-dropout", "--attention-dropout", "--moe-expert-capacity-factor"]:
        p.add_argument(f, type=float)
    flags = [
        "--sequence-parallel",
        "--use-distributed-optimizer",
        "--group-query-attention",
        "--swiglu",
        "--squared-relu",
        "--untie-embeddings-and-output-weights",
        "--disable-bias-linear",
        "--bf16",
        "--fp16",
        "--use-flash-attn",
    ]
    for f in flags:
        p.add_argument(f, action="store_true")
    p.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"])
    p.add_argument("--position-embedding-type", choices=["learned_absolute", "rope"])
    p.add_argument("--fp8-format", choices=["e4m3", "hybrid"])
    p.add_argument("--recompute-granularity", choices=["full", "selective"])
    p.add_argument("--recompute-method", choices=["uniform", "block"])
    p.add_argument("--recompute-modules", nargs="*", choices=["core_attn", "layernorm", "mlp", "moe"])
    return p


def _megatron(out: Emitted) -> tuple[list[str], argparse.Namespace]:
    """The torchrun words before ``pretrain_gpt.py`` and the parsed arguments after it."""
    words = shlex.split(out.text.replace("\\\n", " "), comments=True)
    at = words.index("pretrain_gpt.py")
    return words[:at], _megatron_parser().parse_args(words[at + 1 :])


def test_megatron_arguments_carry_the_planned_layout(planned: tuple[Plan, ModelSpec]) -> None:
    plan, spec = planned
    out = emit(plan, spec, "megatron")
    launch, a = _megatron(out)
    p = plan.parallel
    assert (a.tensor_model_parallel_size, a.pipeline_model_parallel_size) == (p.tp, p.pp)
    assert a.micro_batch_size == p.microbatch and a.global_batch_size == plan.global_batch
    assert a.seq_length == plan.seq
    assert (a.num_layers, a.hidden_size, a.num_attention_heads) == (spec.n_layers, spec.d_model, spec.n_heads)
    assert a.use_distributed_optimizer == (p.zero >= 1)
    assert a.use_flash_attn == plan.flash_attention
    assert a.bf16 == (plan.precision.compute in ("bf16", "fp8"))
    nodes = int(launch[launch.index("--nnodes") + 1])
    per_node = int(launch[launch.index("--nproc-per-node") + 1])
    assert launch[0] == "torchrun" and nodes * per_node == plan.gpus
    if p.zero >= 2:
        assert any(f"ZeRO-{p.zero} has no Megatron-LM flag" in n for n in out.notes)


def test_megatron_model_and_pipeline_flags() -> None:
    plan = _plan(
        LLAMA,
        16,
        parallel=ParallelPlan(tp=2, pp=2, dp=4, vpp=2, sequence_parallel=True, zero=1, microbatch=2),
        precision=PrecisionPlan(compute="fp16", loss_scaling=True, ops=(("softmax_3", "fp32"),)),
    )
    out = emit(plan, LLAMA, "megatron")
    _, a = _megatron(out)
    assert a.num_layers_per_virtual_pipeline_stage == LLAMA.n_layers // (2 * 2)
    assert a.sequence_parallel and a.use_distributed_optimizer
    assert a.group_query_attention and a.num_query_groups == LLAMA.kv_heads
    assert a.ffn_hidden_size == LLAMA.ffn and a.normalization == "RMSNorm"
    assert a.swiglu and a.position_embedding_type == "rope" and a.untie_embeddings_and_output_weights
    assert a.disable_bias_linear and a.fp16 and not a.bf16 and a.fp8_format is None
    assert a.recompute_granularity is None  # nothing recomputed
    assert any("per-op dtype overrides" in n for n in out.notes)
    # ZeRO-1 is expressed exactly: no note about sharding
    assert not any("ZeRO" in n for n in out.notes)


def test_megatron_uneven_first_and_last_stage() -> None:
    plan = _plan(LLAMA, 4, parallel=ParallelPlan(pp=4, microbatch=1, stage_layers=(1, 3, 3, 1)))
    _, a = _megatron(emit(plan, LLAMA, "megatron"))
    assert (a.decoder_first_pipeline_num_layers, a.decoder_last_pipeline_num_layers) == (1, 1)


def test_megatron_fp8_and_zero3() -> None:
    plan = _plan(
        LLAMA, 8, parallel=ParallelPlan(dp=8, zero=3, microbatch=8), precision=PrecisionPlan(compute="fp8")
    )
    out = emit(plan, LLAMA, "megatron")
    _, a = _megatron(out)
    assert a.bf16 and a.fp8_format == "hybrid"
    assert any("ZeRO-3 has no Megatron-LM flag" in n and "optim_grads_params" in n for n in out.notes)


def _block_names(spec: ModelSpec) -> list[str]:
    """Every activation block 0 saves for backward (what full recomputation drops, with its output)."""
    from coplan.capture.synthetic import build_graph
    from coplan.ir.types import TensorRole

    g = build_graph(spec, 1, 16)
    return [
        t.name for t in g.saved_tensors() if t.role is TensorRole.ACTIVATION and t.name.startswith("h.0.")
    ]


def _recompute(spec: ModelSpec, names: set[str], **kw: Any) -> Plan:
    return _plan(
        spec, 2, parallel=ParallelPlan(pp=2, microbatch=1), remat=RematPlan(recompute=frozenset(names)), **kw
    )


def test_megatron_recompute_mapping() -> None:
    spec = load_model_spec("gpt2-124m")
    every = set(_block_names(spec)) - {"h.0.mlp_residual"}
    _, full = _megatron(emit(_recompute(spec, every), spec, "megatron"))
    assert full.recompute_granularity == "full" and full.recompute_method == "uniform"
    assert full.recompute_num_layers == 1

    attn = _recompute(spec, {"h.0.attn.out", "h.0.attn.lse"})
    out = emit(attn, spec, "megatron")
    _, sel = _megatron(out)
    assert sel.recompute_granularity == "selective" and sel.recompute_modules is None  # core_attn
    assert not any("recompute" in n for n in out.notes)

    # the first 3 blocks of each chunk (12 layers over pp 2: 6 a chunk): Megatron's block method
    some = _plan(
        spec,
        2,
        parallel=ParallelPlan(pp=2, microbatch=1),
        remat=RematPlan(recompute=frozenset(every), layers=3),
    )
    _, blk = _megatron(emit(some, spec, "megatron"))
    assert blk.recompute_granularity == "full" and blk.recompute_method == "block"
    assert blk.recompute_num_layers == 3
    # as many as the chunk holds is every block
    _, all_ = _megatron(
        emit(replace(some, remat=RematPlan(recompute=frozenset(every), layers=6)), spec, "megatron")
    )
    assert all_.recompute_method == "uniform" and all_.recompute_num_layers == 1

    mlp = emit(_recompute(spec, {"h.0.mlp.gelu"}), spec, "megatron")
    _, a = _megatron(mlp)
    assert a.recompute_granularity == "selective" and a.recompute_modules == ["mlp"]
    assert any("mlp.c_fc.out" in n and "extra compute" in n for n in mlp.notes)

    # the QKV projection's output has no selective module: full recomputation, said in a note
    qkv = emit(_recompute(spec, {"h.0.attn.c_attn.out"}), spec, "megatron")
    _, a = _megatron(qkv)
    assert a.recompute_granularity == "full"
    assert any("no selective recompute module for attn.c_attn.out" in n for n in qkv.notes)


def test_recompute_per_stage_and_outside_blocks_are_noted() -> None:
    spec = load_model_spec("gpt2-124m")
    remat = RematPlan(per_stage=(frozenset({"h.0.attn.out", "h.0.attn.lse"}), frozenset({"ln_f.out"})))
    plan = _plan(spec, 2, parallel=ParallelPlan(pp=2, microbatch=1), remat=remat)
    for target, stack in (("megatron", "Megatron-LM"), ("torchtitan", "torchtitan")):
        notes = emit(plan, spec, target).notes
        assert any("different set per pipeline stage" in n for n in notes), target
        assert any(f"{stack} checkpoints blocks only: ln_f.out" in n for n in notes), target


# --- torchtitan ---------------------------------------------------------------------------------


def _toml(out: Emitted) -> dict[str, Any]:
    return tomllib.loads(out.text)


def test_torchtitan_toml_has_the_planned_degrees(planned: tuple[Plan, ModelSpec]) -> None:
    plan, spec = planned
    cfg = _toml(emit(plan, spec, "torchtitan"))
    p, par = plan.parallel, cfg["parallelism"]
    assert par["tensor_parallel_degree"] == p.tp and par["pipeline_parallel_degree"] == p.pp
    sharded = par["data_parallel_shard_degree"]
    replicated = par["data_parallel_replicate_degree"]
    assert sharded * replicated == p.dp
    if p.tp * p.pp == 1:
        assert (sharded == p.dp) == (p.zero >= 1 or p.dp == 1)
    assert (
        cfg["training"]["seq_len"] == plan.seq and cfg["training"]["global_batch_size"] == plan.global_batch
    )
    assert cfg["training"]["local_batch_size"] == p.microbatch
    assert cfg["compile"]["enable"] == bool(plan.fusion.groups)


def test_torchtitan_checkpoints_every_nth_block() -> None:
    spec = load_model_spec("gpt2-124m")  # 12 layers
    every = set(_block_names(spec)) - {"h.0.mlp_residual"}
    for layers, option in ((6, "2"), (4, "3"), (1, "7")):
        plan = _plan(spec, 1, remat=RematPlan(recompute=frozenset(every), layers=layers))
        ac = _toml(emit(plan, spec, "torchtitan"))["activation_checkpoint"]
        assert ac == {"mode": "selective", "selective_ac_option": option}
        assert 12 // int(option) == layers
    # 5 of 12 is no every-N-th count: every block, said in a note
    out = emit(_plan(spec, 1, remat=RematPlan(recompute=frozenset(every), layers=5)), spec, "torchtitan")
    assert _toml(out)["activation_checkpoint"] == {"mode": "full"}
    assert any("no N gives 5 of 12 blocks" in n for n in out.notes)


def test_a_plan_priced_compiled_runs_compiled() -> None:
    # torchtitan-compile's plans are priced with torch.compile's kernels: their recipe compiles
    from coplan.cost import CostModel, load_stack
    from coplan.hardware import load_cluster
    from coplan.models.spec import PRESETS
    from coplan.plan import PlanContext
    from coplan.plan.types import FusionPlan
    from coplan.search import run_strategy

    spec = PRESETS["llama-tiny"]
    for stack in ("torchtitan-compile", "torchtitan"):
        ctx = PlanContext(CostModel(spec=spec), load_cluster("dgx-h100", 2), 4, 64, stack=load_stack(stack))
        plan = run_strategy("sequential", ctx).plan
        # production's fusion pass turns torch.compile on where the stack can (torchtitan's flag)
        assert plan.fusion.label == "compiled"
        assert _toml(emit(plan, spec, "torchtitan"))["compile"]["enable"] is True
        eager = plan.with_(fusion=FusionPlan(label="eager"))
        assert _toml(emit(eager, spec, "torchtitan"))["compile"]["enable"] is False


def test_torchtitan_pipeline_fp8_and_checkpointing() -> None:
    spec = load_model_spec("gpt2-124m")
    plan = _plan(
        spec,
        16,
        parallel=ParallelPlan(tp=2, pp=2, dp=4, vpp=2, zero=0, microbatch=2, sequence_parallel=True),
        precision=PrecisionPlan(compute="fp8"),
        remat=RematPlan(recompute=frozenset({"h.0.mlp.gelu", "h.0.ln_1.rstd"})),
    )
    out = emit(plan, spec, "torchtitan")
    cfg = _toml(out)
    par = cfg["parallelism"]
    # DDP beside TP and PP is not something torchtitan runs: FSDP2 shards instead, said in a note
    assert par["data_parallel_replicate_degree"] == 1 and par["data_parallel_shard_degree"] == 4
    assert any("DDP only without TP or PP" in n for n in out.notes)
    assert par["pipeline_parallel_microbatch_size"] == 2
    assert par["pipeline_parallel_schedule"] == "Interleaved1F1B"
    assert par["pipeline_parallel_layers_per_stage"] == spec.n_layers // 4
    # torchtitan's virtual stages: ceil((layers + first + last weights) / layers per stage), which
    # must be the pipeline's chunks for the even split the plan was priced with
    first, last = (
        par["pipeline_parallel_first_stage_less_layers"],
        par["pipeline_parallel_last_stage_less_layers"],
    )
    assert -(-(spec.n_layers + first + last) // par["pipeline_parallel_layers_per_stage"]) == 4
    assert cfg["training"]["local_batch_size"] == plan.global_batch // 4
    assert cfg["model"]["converters"] == ["quantize.linear.float8"]
    assert cfg["quantize"]["linear"]["float8"]["recipe_name"] == "tensorwise"
    assert cfg["activation_checkpoint"] == {"mode": "selective", "selective_ac_option": "op"}

    # a matmul output is kept by op-level checkpointing: only full checkpointing drops it
    qkv = emit(_recompute(spec, {"h.0.attn.c_attn.out"}), spec, "torchtitan")
    assert _toml(qkv)["activation_checkpoint"]["mode"] == "full"
    assert any("attn.c_attn.out" in n for n in qkv.notes)
    assert _toml(emit(_recompute(spec, set()), spec, "torchtitan"))["activation_checkpoint"]["mode"] == "none"


def test_a_plan_recomputing_torchtitans_per_op_policy_runs_that_policy() -> None:
    """The per-op policy recomputes every second matmul's output too (``cost.checkpoint``): a plan
    whose set is that policy's runs it by name, not as full checkpointing."""
    from coplan.cost import CostModel, load_stack
    from coplan.hardware import load_cluster
    from coplan.models.spec import PRESETS
    from coplan.plan import PlanContext
    from coplan.plan.context import policy_sets

    spec = PRESETS["llama-tiny"]
    ctx = PlanContext(
        CostModel(spec=spec), load_cluster("dgx-h100", 2), 4, 64, stack=load_stack("torchtitan")
    )
    per_op = policy_sets(ctx)["selective-op"]
    plan = ctx.default_plan().with_(remat=RematPlan(recompute=per_op))
    named = _toml(emit(plan, spec, "torchtitan", policy="selective-op"))["activation_checkpoint"]
    assert named == {"mode": "selective", "selective_ac_option": "op"}
    # without the policy's name the recipe reads the set's matmul output as the plan's own choice,
    # which only full checkpointing drops
    bare = emit(plan, spec, "torchtitan")
    assert _toml(bare)["activation_checkpoint"]["mode"] == "full"
    assert any("mlp.c_fc.out" in n for n in bare.notes), bare.notes


def test_torchtitan_uneven_split_and_zero3() -> None:
    plan = _plan(LLAMA, 8, parallel=ParallelPlan(pp=2, dp=4, zero=3, microbatch=1, stage_layers=(3, 5)))
    out = emit(plan, LLAMA, "torchtitan")
    par = _toml(out)["parallelism"]
    parts = par["module_fqns_per_model_part"]
    assert [sum(m.startswith("layers.") for m in part) for part in parts] == [3, 5]
    assert parts[0][0] == "tok_embeddings" and parts[-1][-2:] == ["norm", "output"]
    # under a pipeline torchtitan's default keeps the units gathered through the step, as priced
    assert par["fsdp_reshard_after_forward"] == "default" and par["data_parallel_shard_degree"] == 4
    flat = emit(_plan(LLAMA, 8, parallel=ParallelPlan(dp=8, zero=3, microbatch=1)), LLAMA, "torchtitan")
    assert _toml(flat)["parallelism"]["fsdp_reshard_after_forward"] == "always"
    fp16 = emit(
        _plan(LLAMA, 1, precision=PrecisionPlan(compute="fp16", loss_scaling=True)), LLAMA, "torchtitan"
    )
    assert _toml(fp16)["training"]["mixed_precision_param"] == "bfloat16"
    assert any("fp16" in n for n in fp16.notes)


# --- coplan ---------------------------------------------------------------------------------------


def test_coplan_command_and_snippet(planned: tuple[Plan, ModelSpec]) -> None:
    plan, spec = planned
    out = emit(plan, spec, "coplan", plan_path="out dir/plan.json")
    line = next(x for x in out.text.splitlines() if x.startswith("coplan run"))
    words = shlex.split(line)
    assert words[words.index("--plan") + 1] == "out dir/plan.json"
    assert int(words[words.index("--nproc") + 1]) == plan.gpus
    assert words[words.index("--model") + 1] == plan.model
    snippet = out.text[out.text.index("import torch") :]
    tree = ast.parse(snippet)
    calls = {
        n.func.attr for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
    }
    assert {"backend", "compile", "load"} <= calls
    assert "'out dir/plan.json'" in snippet


def test_coplan_notes_a_layout_coplan_run_refuses() -> None:
    plan = _plan(LLAMA, 8, parallel=ParallelPlan(pp=2, dp=4, microbatch=1))
    out = emit(plan, LLAMA, "coplan")
    assert any("coplan run refuses this layout" in n for n in out.notes)
    single = emit(_plan(LLAMA, 1), LLAMA, "coplan")
    assert single.notes == ()


# --- refusals -------------------------------------------------------------------------------------


def test_unknown_target_names_the_choices() -> None:
    with pytest.raises(SpecError) as exc:
        emit(_plan(LLAMA, 1), LLAMA, "deepspeed")
    assert all(t in str(exc.value) for t in TARGETS) and "deepspeed" in str(exc.value)
    with pytest.raises(SpecError):
        Emitted("nope", "text")
    with pytest.raises(SpecError):
        Emitted("coplan", "  ")


def test_mixture_of_experts_and_an_unknown_cluster() -> None:
    spec = load_model_spec("mixtral-8x7b")
    plan = _plan(
        spec,
        12,
        cluster="not-a-preset",
        parallel=ParallelPlan(tp=2, dp=6, microbatch=1),
        remat=RematPlan(recompute=frozenset({"h.0.mlp.silu"})),
    )
    out = emit(plan, spec, "megatron")
    launch, a = _megatron(out)
    assert (a.num_experts, a.moe_router_topk) == (spec.n_experts, spec.top_k)
    assert a.moe_expert_capacity_factor == spec.capacity_factor
    assert a.recompute_modules == ["moe"]
    # torchrun starts as many processes on every node
    nodes = int(launch[launch.index("--nnodes") + 1])
    per_node = int(launch[launch.index("--nproc-per-node") + 1])
    assert nodes * per_node == plan.gpus
    titan = emit(plan, spec, "torchtitan")
    assert _toml(titan)["model"]["name"] == "llama4"
    assert any("experts" in n for n in titan.notes)


def test_torchtitan_ddp_alone() -> None:
    par = _toml(emit(_plan(LLAMA, 4, parallel=ParallelPlan(dp=4, microbatch=4)), LLAMA, "torchtitan"))
    par = par["parallelism"]
    assert par["data_parallel_replicate_degree"] == 4 and par["data_parallel_shard_degree"] == 1
    assert "fsdp_reshard_after_forward" not in par


def test_torchtitan_compile_plans_run_async_tp_where_tp_is_sequence_parallel() -> None:
    from coplan.cost import CostModel, load_stack
    from coplan.hardware import load_cluster
    from coplan.models.spec import PRESETS
    from coplan.plan import PlanContext
    from coplan.plan.types import ParallelPlan
    from coplan.search import run_strategy

    spec = PRESETS["llama-tiny"]
    ctx = PlanContext(
        CostModel(spec=spec), load_cluster("dgx-h100", 2), 4, 64, stack=load_stack("torchtitan-compile")
    )
    plan = run_strategy("sequential", ctx).plan
    tp = plan.with_(parallel=ParallelPlan(tp=2, pp=1, dp=1, sequence_parallel=True, microbatch=4))
    assert ctx.config_of(tp).async_tp
    assert _toml(emit(tp, spec, "torchtitan"))["parallelism"]["enable_async_tensor_parallel"] is True
    plain = plan.with_(parallel=ParallelPlan(tp=1, pp=1, dp=2, microbatch=2))
    assert not ctx.config_of(plain).async_tp
    assert "enable_async_tensor_parallel" not in _toml(emit(plain, spec, "torchtitan"))["parallelism"]
    # the torchtitan stack runs it in its compiled plans only (async TP needs torch.compile)
    from coplan.plan.types import FusionPlan

    titan = PlanContext(
        CostModel(spec=spec), load_cluster("dgx-h100", 2), 4, 64, stack=load_stack("torchtitan")
    )
    assert not titan.config_of(tp.with_(fusion=FusionPlan(label="eager"))).async_tp
    assert titan.config_of(tp.with_(fusion=FusionPlan(label="compiled"))).async_tp


def test_plan_prints_a_recipe_note_as_written(cli) -> None:  # type: ignore[no-untyped-def]
    """A note naming the recipe's ``[model]`` section reaches the terminal with its brackets, not
    read as Rich markup."""
    code, out, err = cli("plan", "--model", "gpt-tiny", "--stack", "torchtitan", "--emit", "torchtitan")
    assert code == 0, err
    assert "note: [model] names a torchtitan model" in " ".join(out.split())
