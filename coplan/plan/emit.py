"""A plan as a recipe: what runs it on Megatron-LM, on torchtitan, or on coplan itself.

    emit(plan, spec, "megatron")    # pretrain_gpt.py arguments and the torchrun line
    emit(plan, spec, "torchtitan")  # a torchtitan job TOML
    emit(plan, spec, "coplan")      # the coplan run command and a Python snippet

Each result is the text to print and ``notes``: the plan's decisions the target cannot express
exactly, and what the emitted recipe does instead. Where a stack has no flag for a plan's
recomputed set, the recipe recomputes a superset (so the plan's memory bound still holds, at some
extra compute) and the note names what it recomputes beyond the plan.

Flag and key names were checked against the stacks' own argument definitions:

- Megatron-LM ``megatron/training/arguments.py`` (NVIDIA/Megatron-LM @ 67f3515c8a, Jan 2026, where
  every flag used here is a literal ``add_argument``); later versions generate the same names from
  config dataclass fields (``megatron/core/transformer/transformer_config.py``,
  ``megatron/core/model_parallel_config.py``, ``megatron/training/config/training_config.py``
  through ``ArgumentGroupFactory``), checked @ d98e8a64dd (Aug 2026);
- torchtitan ``torchtitan/config/job_config.py`` (pytorch/torchtitan @ e347b1e5e6, Feb 2026, the
  last version read from TOML files; the float8 converter registers as ``quantize.linear.float8``
  in ``torchtitan/components/quantization/float8.py``; gradient accumulation is
  ``global_batch_size // (local_batch_size * dp)`` in ``torchtitan/train.py``; op-level selective
  checkpointing saves matmul and attention outputs, every second matmul excepted, in
  ``torchtitan/distributed/activation_checkpoint.py``).
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from coplan.cost.stages import split_layers
from coplan.errors import SpecError
from coplan.ir.types import OpKind, TensorRole
from coplan.models.spec import ModelSpec
from coplan.plan.types import Plan, names

TARGETS: tuple[str, ...] = ("megatron", "torchtitan", "coplan")

#: GPUs per node when the plan's cluster is not a preset this coplan knows
_DEFAULT_PER_NODE = 8


@dataclass(frozen=True, slots=True)
class Emitted:
    """What runs a plan on ``target``: ``text`` to print, and ``notes`` on what it cannot express."""

    target: str
    text: str
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.target not in TARGETS:
            raise SpecError(
                "--emit", None, f"unknown target {self.target!r}; choose from {', '.join(TARGETS)}"
            )
        if not isinstance(self.text, str) or not self.text.strip():
            raise SpecError("--emit", None, "emitted text must be a non-empty string")
        object.__setattr__(self, "notes", tuple(str(n) for n in self.notes))


def emit(
    plan: Plan,
    spec: ModelSpec,
    target: str,
    *,
    plan_path: str = "plan.json",
    model: str | None = None,
    async_tp: bool = True,
    policy: str | None = None,
) -> Emitted:
    """The recipe that runs ``plan`` (made for the model ``spec``) on ``target``.

    ``plan_path`` is where the plan file is (``coplan plan --out``), ``model`` the ``--model``
    argument that names the model to ``coplan run`` (default: the plan's model). ``async_tp``: the
    plan was priced with PyTorch's async TP where it compiles sequence-parallel TP (the stack's
    ``StackSpec.async_tp``), so a torchtitan recipe turns it on there. ``policy``: the stack's
    checkpointing policy the plan's recompute set is, where it is one
    (``coplan.plan.context.policy_sets``): a torchtitan recipe runs its per-op policy by name."""
    if target not in TARGETS:
        raise SpecError("--emit", None, f"unknown target {target!r}; choose from {', '.join(TARGETS)}")
    if target == "megatron":
        return _megatron(plan, spec)
    if target == "torchtitan":
        return _torchtitan(plan, spec, async_tp, policy)
    return _coplan(plan, spec, plan_path, model or plan.model)


# --- the recomputed set, in the terms the stacks use ----------------------------------------------


@dataclass(frozen=True, slots=True)
class _Block:
    """The saved activations of one transformer block, by name relative to the block
    (``ln_1.out``), with the kind of op that produces each, and the block's output."""

    saved: dict[str, OpKind]
    output: str
    container: str


def _block(spec: ModelSpec) -> _Block:
    from coplan.capture.synthetic import build_graph

    # names do not depend on depth or sizes: one block and a short sequence keep the build cheap
    g = build_graph(replace(spec, n_layers=1), 1, min(16, spec.seq_len))
    container = g.meta.block_container or "h"
    prefix = f"{container}.0."
    saved: dict[str, OpKind] = {}
    for t in g.saved_tensors():
        if t.role is TensorRole.ACTIVATION and t.name.startswith(prefix):
            op = g.producer(t)
            saved[t.name[len(prefix) :]] = op.kind if op is not None else OpKind.OTHER
    out = next((n for n in saved if n.endswith("mlp_residual")), list(saved)[-1] if saved else "")
    return _Block(saved=saved, output=out, container=container)


@dataclass(frozen=True, slots=True)
class _Remat:
    """A plan's recomputed set split into what lies inside blocks (relative names) and outside."""

    inside: frozenset[str]
    outside: frozenset[str]
    per_stage_differs: bool
    block: _Block
    #: blocks of each model chunk fully recomputed (None: every block)
    layers: int | None = None
    #: blocks per model chunk (the smallest chunk where they differ)
    chunk: int = 0

    @property
    def full(self) -> bool:
        """Everything a block saves but its output: one checkpoint per block does exactly this."""
        every = set(self.block.saved) - {self.block.output}
        return bool(every) and every <= self.inside


def _remat(plan: Plan, spec: ModelSpec) -> _Remat:
    block = _block(spec)
    pattern = re.compile(rf"^{re.escape(block.container)}\.\d+\.(.+)$")
    inside: set[str] = set()
    outside: set[str] = set()
    for name in plan.remat.all_names:
        m = pattern.match(name)
        if m:
            inside.add(m.group(1))
        else:
            outside.add(name)
    stages = plan.remat.per_stage
    differs = stages is not None and len({frozenset(s) for s in stages}) > 1
    p = plan.parallel
    chunk = min(split_layers(spec.n_layers, p.pp * p.vpp, p.stage_layers))
    return _Remat(frozenset(inside), frozenset(outside), differs, block, plan.remat.layers, chunk)


def _common_remat_notes(r: _Remat, stack: str) -> list[str]:
    notes = []
    if r.per_stage_differs:
        notes.append(
            f"the plan recomputes a different set per pipeline stage; {stack} applies one setting to "
            "every stage, here the union of the stages' sets"
        )
    if r.outside:
        notes.append(
            f"{stack} checkpoints blocks only: {names(r.outside)}, recomputed by the plan outside the "
            "blocks, stays saved (more activation memory than planned)"
        )
    return notes


def _extra(r: _Remat, dropped: Iterable[str]) -> str:
    more = sorted(set(dropped) - r.inside)
    return f"; it also recomputes {names(more)}, which the plan keeps (extra compute)" if more else ""


# --- Megatron-LM ----------------------------------------------------------------------------------

#: Megatron's default --recompute-modules under selective granularity (the attention core)
_MEGATRON_ATTENTION_CORE = "core_attn"


def _megatron_module(rel: str, kind: OpKind, spec: ModelSpec) -> str | None:
    """The --recompute-modules entry that drops the block tensor ``rel`` (None: no module does)."""
    if rel.startswith(("ln_1.", "ln_2.")):
        return "layernorm"
    if kind is OpKind.ATTENTION:
        return _MEGATRON_ATTENTION_CORE
    if rel.startswith("mlp."):
        return "moe" if spec.is_moe else "mlp"
    return None


def _megatron_recompute(r: _Remat, spec: ModelSpec) -> tuple[list[str], list[str]]:
    notes = _common_remat_notes(r, "Megatron-LM")
    if not r.inside:
        return [], notes
    full = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    every = set(r.block.saved) - {r.block.output}
    if r.full and r.layers is not None and r.layers < r.chunk:
        # the first N blocks of each chunk (megatron/core/transformer/transformer_block.py)
        block = ["--recompute-method", "block", "--recompute-num-layers", str(r.layers)]
        return ["--recompute-granularity", "full", *block], notes
    if r.full:
        return full, notes
    modules = {rel: _megatron_module(rel, r.block.saved.get(rel, OpKind.OTHER), spec) for rel in r.inside}
    uncovered = sorted(rel for rel, m in modules.items() if m is None)
    if uncovered:
        notes.append(
            f"Megatron-LM has no selective recompute module for {names(uncovered)}: full recomputation "
            f"of every layer instead{_extra(r, every)}"
        )
        return full, notes
    chosen = sorted({m for m in modules.values() if m is not None})
    dropped = [rel for rel, k in r.block.saved.items() if _megatron_module(rel, k, spec) in chosen]
    if set(dropped) != set(r.inside):
        notes.append(
            f"--recompute-modules {' '.join(chosen)} recomputes whole submodules{_extra(r, dropped)}"
        )
    args = ["--recompute-granularity", "selective"]
    if chosen != [_MEGATRON_ATTENTION_CORE]:  # Megatron's default module list
        args += ["--recompute-modules", *chosen]
    return args, notes


def _megatron_layers(plan: Plan, spec: ModelSpec) -> tuple[list[str], list[str]]:
    p, args, notes = plan.parallel, [], []
    chunks = p.pp * p.vpp
    if p.vpp > 1:
        if spec.n_layers % chunks == 0:
            args += ["--num-layers-per-virtual-pipeline-stage", str(spec.n_layers // chunks)]
        else:
            notes.append(
                f"{spec.n_layers} layers do not split evenly into {chunks} virtual stages: Megatron-LM "
                "needs --num-layers-per-virtual-pipeline-stage to divide the layers per stage"
            )
    split = p.stage_layers
    if split is not None and len(set(split)) > 1:
        middle = split[1:-1]
        if p.vpp == 1 and len(split) == p.pp and len(set(middle)) <= 1:
            args += ["--decoder-first-pipeline-num-layers", str(split[0])]
            args += ["--decoder-last-pipeline-num-layers", str(split[-1])]
        else:
            notes.append(
                f"uneven stage split {'/'.join(map(str, split))}: Megatron-LM sets only the first and last "
                "stage's layers (--decoder-first/last-pipeline-num-layers); the middle stages split evenly"
            )
    return args, notes


def _megatron_precision(plan: Plan) -> tuple[list[str], list[str]]:
    c, notes = plan.precision, []
    args = {
        "bf16": ["--bf16"],
        "fp16": ["--fp16"],  # dynamic loss scaling unless --loss-scale is given
        "fp8": ["--bf16", "--fp8-format", "hybrid"],  # e4m3 forward, e5m2 gradients (Transformer Engine)
    }.get(c.compute, [])
    if c.compute == "tf32":
        notes.append("tf32: Megatron-LM has no flag; PyTorch's TF32 matmul setting decides")
    if c.ops:
        notes.append(
            f"per-op dtype overrides ({names(n for n, _ in c.ops)}) have no Megatron-LM flag: its fused "
            "kernels keep softmax, norms and the loss in fp32 themselves (--attention-softmax-in-fp32)"
        )
    if not c.master_weights and c.compute != "fp32":
        notes.append("the plan keeps no fp32 master weights; Megatron-LM's mixed precision always does")
    if c.grad_reduce != "fp32":
        args = [*args, "--grad-reduce-in-bf16"]
        if c.grad_reduce == "fp16":
            notes.append("gradients reduced in fp16: Megatron-LM reduces 16-bit gradients in bf16")
    if c.fp8_params:
        args = [*args, "--fp8-param-gather"]
    return args, notes


def _megatron(plan: Plan, spec: ModelSpec) -> Emitted:
    p = plan.parallel
    notes: list[str] = []
    a: list[str] = [
        "--tensor-model-parallel-size", str(p.tp),
        "--pipeline-model-parallel-size", str(p.pp),
    ]  # fmt: skip
    if p.cp > 1:
        a += ["--context-parallel-size", str(p.cp)]
    layers, why = _megatron_layers(plan, spec)
    a += layers
    notes += why
    if p.sequence_parallel and p.tp > 1:
        a.append("--sequence-parallel")
    if p.zero >= 1:
        a.append("--use-distributed-optimizer")
    if p.fsdp_shard is not None:
        notes.append(
            f"hybrid sharding in groups of {p.fsdp_shard} has no Megatron-LM flag: the distributed "
            "optimizer shards over every data-parallel rank"
        )
    if p.zero >= 2:
        notes.append(
            f"ZeRO-{p.zero} has no Megatron-LM flag: --use-distributed-optimizer shards the optimizer "
            "state only (ZeRO-1), so gradients"
            + (" and parameters" if p.zero == 3 else "")
            + " stay replicated (more memory than planned); Megatron-FSDP "
            "(--use-megatron-fsdp --data-parallel-sharding-strategy "
            + ("optim_grads" if p.zero == 2 else "optim_grads_params")
            + ") is the sharded alternative"
        )
    a += ["--micro-batch-size", str(p.microbatch), "--global-batch-size", str(plan.global_batch)]
    a += ["--seq-length", str(plan.seq), "--max-position-embeddings", str(spec.seq_len)]
    a += ["--num-layers", str(spec.n_layers), "--hidden-size", str(spec.d_model)]
    a += ["--num-attention-heads", str(spec.n_heads), "--ffn-hidden-size", str(spec.ffn)]
    if spec.kv_heads != spec.n_heads:
        a += ["--group-query-attention", "--num-query-groups", str(spec.kv_heads)]
    a += ["--normalization", "RMSNorm" if spec.norm == "rmsnorm" else "LayerNorm"]
    a += ["--norm-epsilon", repr(spec.norm_eps)]
    if spec.activation == "swiglu":
        a.append("--swiglu")
    elif spec.activation == "relu2":
        a.append("--squared-relu")
    if spec.position == "rope":
        a += ["--position-embedding-type", "rope", "--rotary-base", str(int(spec.rope_theta))]
        if spec.rope_theta != int(spec.rope_theta):
            notes.append(f"--rotary-base takes an integer; the model's RoPE base is {spec.rope_theta}")
    if not spec.tied_embeddings:
        a.append("--untie-embeddings-and-output-weights")
    if not spec.bias:
        a.append("--disable-bias-linear")
    # Megatron-LM's defaults are 0.1: the model's own probabilities are written out
    a += ["--hidden-dropout", repr(float(spec.hidden_dropout))]
    a += ["--attention-dropout", repr(float(spec.attention_dropout))]
    if spec.is_moe:
        a += ["--num-experts", str(spec.n_experts), "--moe-router-topk", str(spec.top_k)]
        a += ["--moe-expert-capacity-factor", repr(float(spec.capacity_factor))]
    precision, why = _megatron_precision(plan)
    a += precision
    notes += why
    recompute, why = _megatron_recompute(_remat(plan, spec), spec)
    a += recompute
    notes += why
    if plan.flash_attention:
        a.append("--use-flash-attn")
    if plan.fusion.groups:
        notes.append(
            f"fusion: Megatron-LM chooses its own fused kernels (bias-GELU, bias-dropout-add, softmax, "
            f"RoPE, Transformer Engine's norm+linear); the plan's {len(plan.fusion.groups)} fusion "
            "groups are not applied as planned"
        )
    notes.append(
        f"vocabulary: Megatron-LM takes it from the tokenizer (the model has {spec.vocab_size:,} "
        "tokens, padded to a multiple of --make-vocab-size-divisible-by)"
    )
    nodes, per_node = _nodes(plan)
    launch = ["torchrun", "--nnodes", str(nodes), "--nproc-per-node", str(per_node)]
    if nodes > 1:
        launch += ["--node-rank", "$NODE_RANK", "--master-addr", "$MASTER_ADDR", "--master-port", "6000"]
    lines = [
        f"# Megatron-LM: {plan.model} on {plan.gpus} GPUs, {p.describe()}, {plan.precision.compute} "
        f"(plan {plan.fingerprint})",
        "# run on every node"
        + (" (set NODE_RANK and MASTER_ADDR)" if nodes > 1 else "")
        + "; add the job's data, tokenizer, optimizer and checkpoint arguments",
        " ".join(launch) + " pretrain_gpt.py \\",
        *_pairs(a),
    ]
    return Emitted("megatron", "\n".join(lines) + "\n", tuple(notes))


def _pairs(args: Sequence[str]) -> list[str]:
    """One flag (with its values) per line, continued with backslashes."""
    out: list[list[str]] = []
    for x in args:
        if x.startswith("--") or not out:
            out.append([x])
        else:
            out[-1].append(x)
    rows = ["    " + " ".join(shlex.quote(v) if not v.startswith("$") else v for v in row) for row in out]
    return [r + " \\" for r in rows[:-1]] + rows[-1:]


def _nodes(plan: Plan) -> tuple[int, int]:
    """(nodes, processes per node) for the plan's GPU count on its cluster."""
    from coplan.hardware import load_cluster

    try:
        per_node = load_cluster(plan.cluster, plan.gpus).groups[0].devices_per_node
    except SpecError:
        per_node = _DEFAULT_PER_NODE
    per_node = max(1, min(per_node, plan.gpus))
    nodes = -(-plan.gpus // per_node)
    # torchrun starts the same number of processes on every node
    return nodes, (plan.gpus // nodes if plan.gpus % nodes == 0 else per_node)


# --- torchtitan -----------------------------------------------------------------------------------


def _torchtitan_recompute(r: _Remat, policy: str | None = None) -> tuple[dict[str, Any], list[str]]:
    notes = _common_remat_notes(r, "torchtitan")
    if not r.inside:
        return {"mode": "none"}, notes
    if policy == "selective-op" and not r.per_stage_differs:
        # the plan's set is torchtitan's own per-op policy over this model (every second matmul's
        # output recomputed too), as the planner priced it: the recipe names the policy
        return {"mode": "selective", "selective_ac_option": "op"}, notes
    every = set(r.block.saved) - {r.block.output}
    if r.full and r.layers is not None and r.layers < r.chunk:
        # every N-th block: the chunk's blocks // N of them (``StackSpec.layer_counts``)
        n = next((n for n in range(2, r.chunk + 1) if r.chunk // n == r.layers), 0)
        if n:
            return {"mode": "selective", "selective_ac_option": str(n)}, notes
        notes.append(
            f"torchtitan checkpoints every N-th block: no N gives {r.layers} of {r.chunk} blocks, so every "
            "block is checkpointed (extra compute)"
        )
    if r.full:
        return {"mode": "full"}, notes
    saved_by_policy = {OpKind.MATMUL, OpKind.ATTENTION}
    kept = sorted(rel for rel in r.inside if r.block.saved.get(rel, OpKind.OTHER) in saved_by_policy)
    if kept:
        notes.append(
            f"torchtitan's op-level selective checkpointing saves matmul and attention outputs, so "
            f"recomputing {names(kept)} needs full checkpointing of every block{_extra(r, every)}"
        )
        return {"mode": "full"}, notes
    cheap = [rel for rel, k in r.block.saved.items() if k not in saved_by_policy and rel != r.block.output]
    notes.append(
        'selective_ac_option = "op" recomputes every op but matmuls and attention (and every second '
        f"matmul){_extra(r, cheap)}"
    )
    return {"mode": "selective", "selective_ac_option": "op"}, notes


def _torchtitan(plan: Plan, spec: ModelSpec, async_tp: bool = True, policy: str | None = None) -> Emitted:
    p, c = plan.parallel, plan.precision
    notes: list[str] = [
        f"[model] names a torchtitan model and flavor: register one with the sizes of {spec.name} "
        f"({spec.n_layers} layers, dim {spec.d_model}, {spec.n_heads} heads, {spec.kv_heads} KV heads, "
        f"FFN {spec.ffn}, vocabulary {spec.vocab_size:,})"
    ]
    # llama3 is torchtitan's dense decoder of this shape; llama4 its mixture-of-experts one
    model: dict[str, Any] = {"name": "llama4" if spec.is_moe else "llama3", "flavor": spec.name}
    if spec.is_moe:
        notes.append(
            f"experts: a llama4 flavor with {spec.n_experts} experts, top-{spec.top_k} routing; torchtitan's "
            "MoE routes without a capacity limit"
        )
    training: dict[str, Any] = {"global_batch_size": plan.global_batch, "seq_len": plan.seq}
    # torchtitan's DDP runs only as the sole parallelism (parallelize.py: "DDP has not supported
    # > 1D parallelism"): replicas beside TP or PP are FSDP2 shards
    shard = p.zero >= 1 or (p.dp > 1 and p.tp * p.pp > 1)
    par: dict[str, Any] = {
        "data_parallel_replicate_degree": 1 if shard else p.dp,
        "data_parallel_shard_degree": p.dp if shard else 1,
        "tensor_parallel_degree": p.tp,
        "pipeline_parallel_degree": p.pp,
        # torchtitan's FSDP shards over the data- and context-parallel ranks together
        "context_parallel_degree": p.cp,
    }
    if p.fsdp_shard is not None:
        # HSDP: FSDP2 over the 2-D (dp_replicate, dp_shard) mesh, sharded within each group of
        # dp_shard x cp ranks and replicated across the groups
        if p.fsdp_shard % p.cp == 0:
            par["data_parallel_shard_degree"] = p.fsdp_shard // p.cp
            par["data_parallel_replicate_degree"] = p.dp * p.cp // p.fsdp_shard
        else:
            notes.append(
                f"hybrid sharding in groups of {p.fsdp_shard}: torchtitan's shard groups are "
                f"data_parallel_shard_degree x context_parallel_degree ({p.cp}) ranks, which do not "
                "make that group; sharded over every data-parallel rank instead"
            )
    if shard:
        # FSDP2 keeps parameters gathered from forward to backward unless it reshards (ZeRO-3);
        # under a pipeline ZeRO-3 runs as torchtitan's default does there, gathered through the
        # step (``TrainingConfig.fsdp_pipeline``, how the plan was priced)
        if p.zero == 3:
            par["fsdp_reshard_after_forward"] = "default" if p.pp > 1 else "always"
        else:
            par["fsdp_reshard_after_forward"] = "never"
    if p.zero == 0 and shard:
        notes.append(
            "data parallelism without ZeRO: torchtitan runs DDP only without TP or PP, so the replicas "
            "are FSDP2 shards here (ZeRO-2 memory, parameters gathered each step)"
        )
    elif p.zero == 1:
        notes.append("ZeRO-1: torchtitan's FSDP2 shards gradients as well (ZeRO-2), which needs less memory")
    if p.pp > 1:
        # a pipeline splits each DP rank's batch into microbatches; otherwise torchtitan accumulates
        training["local_batch_size"] = plan.global_batch // p.dp
        par["pipeline_parallel_microbatch_size"] = p.microbatch
        par["pipeline_parallel_schedule"] = "Interleaved1F1B" if p.vpp > 1 else "1F1B"
        chunks = p.pp * p.vpp
        split = p.stage_layers
        if split is not None and len(set(split)) > 1:
            par["module_fqns_per_model_part"] = _torchtitan_parts(split)
        elif spec.n_layers % chunks == 0:
            # torchtitan counts the embedding and the norm + output as a layer each by default
            # (``pipeline_parallel_first_stage_less_layers`` / ``..._last_stage_less_layers`` = 1,
            # torchtitan/distributed/pipeline_parallel.py ``pipeline_llm``: ceil((layers + 2) /
            # layers_per_stage) virtual stages, which then need not divide by the pipeline
            # degree): weights of 0 give the even split the plan was priced with
            par["pipeline_parallel_layers_per_stage"] = spec.n_layers // chunks
            par["pipeline_parallel_first_stage_less_layers"] = 0
            par["pipeline_parallel_last_stage_less_layers"] = 0
    else:
        training["local_batch_size"] = p.microbatch
    if p.tp > 1 and not p.sequence_parallel:
        notes.append("torchtitan's tensor parallelism always shards norms and residuals by sequence")
    if async_tp and p.tp > 1 and p.sequence_parallel and plan.fusion.label == "compiled":
        # priced as async TP where the stack compiles (``StackSpec.async_tp``): the recipe runs it
        par["enable_async_tensor_parallel"] = True
    training["mixed_precision_param"] = "float32" if c.compute in ("fp32", "tf32") else "bfloat16"
    training["mixed_precision_reduce"] = "float32"
    if c.compute == "fp16":
        notes.append("fp16: torchtitan trains in bf16 or fp32 only; bf16 here")
    if c.compute == "tf32":
        notes.append("tf32: torchtitan has no key; PyTorch's TF32 matmul setting decides")
    if c.ops:
        notes.append(f"per-op dtype overrides ({names(n for n, _ in c.ops)}) have no torchtitan key")
    if not c.master_weights and c.compute != "fp32":
        notes.append("the plan keeps no fp32 master weights; torchtitan's FSDP2 mixed precision does")
    if c.compute == "fp8":
        model["converters"] = ["quantize.linear.float8"]
    if c.grad_reduce != "fp32":
        notes.append("gradients reduced in 16 bits: torchtitan's FSDP2 reduces in float32 only")
    ac, why = _torchtitan_recompute(_remat(plan, spec), policy)
    notes += why
    fused = bool(plan.fusion.groups)
    if fused:
        notes.append(
            f"fusion: torch.compile (Inductor) fuses by its own rules; the plan's "
            f"{len(plan.fusion.groups)} fusion groups are not applied as planned"
        )
    # a plan priced with torch.compile's kernels (the ``compiled`` option, torchtitan-compile's)
    # runs compiled; one priced with eager kernels runs eager
    compiled = fused or plan.fusion.label == "compiled"
    if not plan.flash_attention:
        notes.append("torchtitan runs attention through scaled_dot_product_attention (flash where it can)")
    sections: list[tuple[str, dict[str, Any]]] = [
        ("job", {"description": f"coplan plan {plan.fingerprint}: {plan.model} on {plan.gpus} GPUs"}),
        ("model", model),
        ("training", training),
        ("parallelism", par),
        ("activation_checkpoint", ac),
        ("compile", {"enable": compiled, "components": ["model", "loss"]}),
    ]
    if c.compute == "fp8":
        float8: dict[str, Any] = {"recipe_name": "tensorwise", "filter_fqns": ["output"]}
        if c.fp8_params:
            float8["enable_fsdp_float8_all_gather"] = True
        sections.append(("quantize.linear.float8", float8))
    nodes, per_node = _nodes(plan)
    head = [
        f"# torchtitan job config: {p.describe()}, {c.compute} (plan {plan.fingerprint})",
        f"# save as plan.toml; run: NGPU={per_node} CONFIG_FILE=plan.toml ./run_train.sh"
        + (f"  (on each of {nodes} nodes, through torchrun --nnodes {nodes})" if nodes > 1 else ""),
    ]
    return Emitted("torchtitan", "\n".join(head) + "\n\n" + _toml(sections), tuple(notes))


def _torchtitan_parts(split: Sequence[int]) -> list[list[str]]:
    """torchtitan's per-chunk module lists for an uneven split (Llama module names)."""
    parts: list[list[str]] = []
    start = 0
    for i, n in enumerate(split):
        mods = [f"layers.{k}" for k in range(start, start + n)]
        if i == 0:
            mods.insert(0, "tok_embeddings")
        if i == len(split) - 1:
            mods += ["norm", "output"]
        parts.append(mods)
        start += n
    return parts


def _toml(sections: Sequence[tuple[str, dict[str, Any]]]) -> str:
    out = []
    for name, values in sections:
        out.append(f"[{name}]")
        out += [f"{k} = {_toml_value(v)}" for k, v in values.items()]
        out.append("")
    return "\n".join(out)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return "[" + ", ".join(_toml_value(x) for x in v) + "]"


# --- coplan ---------------------------------------------------------------------------------------

_SNIPPET = """\
import torch

import coplan
from coplan.models.spec import load_model_spec
from coplan.models.transformer import build_model, example_batch
from coplan.plan.types import Plan

plan = Plan.load({path!r})
spec = load_model_spec({model!r})
model = torch.compile(build_model(spec), backend=coplan.backend(plan, spec))
idx, targets = example_batch(spec, plan.parallel.microbatch, plan.seq)
loss = model(idx, targets)  # the plan's precision, recomputation and fusion apply here
loss.backward()
"""


def _coplan(plan: Plan, spec: ModelSpec, plan_path: str, model: str) -> Emitted:
    from coplan.apply.dist import supported

    notes: list[str] = []
    why = supported(plan.parallel)
    if why is not None:
        notes.append(f"coplan run refuses this layout: {why}")
    if plan.gpus > 1:
        notes.append(
            "the snippet applies the plan to one process; coplan run also applies the layout "
            f"({plan.parallel.describe()}) across {plan.gpus} processes"
        )
    cmd = ["coplan", "run", "--model", model, "--plan", plan_path, "--nproc", str(plan.gpus), "--steps", "10"]
    text = (
        f"# train 10 steps under plan {plan.fingerprint} and compare measured with predicted:\n"
        + " ".join(shlex.quote(x) for x in cmd)
        + "\n\n# or apply the plan in Python:\n"
        + _SNIPPET.format(path=plan_path, model=model)
    )
    return Emitted("coplan", text, tuple(notes))
