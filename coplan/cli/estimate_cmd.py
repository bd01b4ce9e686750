"""``coplan estimate``: step time, memory and MFU of one training configuration."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich import box
from rich.table import Table

from coplan.cli.choices import (
    AttentionKernel,
    BucketScope,
    CpExchange,
    Dtype,
    Fp8Scaling,
    FsdpPipeline,
    Fusion,
    GradAccumulation,
    LossCast,
    LossFusion,
    Optimizer,
    PpSend,
    Recompute,
    Zero3Gather,
)
from coplan.cli.common import human_bytes, mfu_words, positive, print_json, show_trust, stdout
from coplan.cli.history_cmd import RecordDbOpt, RecordHistoryOpt, record, recording_to, say_recorded
from coplan.cli.options import (
    DEFAULT_CLUSTER,
    DEFAULT_GPUS,
    DEFAULT_MODEL,
    ClusterOpt,
    CompileOpt,
    GlobalBatchOpt,
    GpusOpt,
    JsonOpt,
    MicrobatchOpt,
    ModelOpt,
    SeqOpt,
    StackFileOpt,
    StackOpt,
    compiled_stack,
    default_global_batch,
    resolve_stack,
)

if TYPE_CHECKING:
    from coplan.cost import CostModel
    from coplan.cost.estimate import Estimate
    from coplan.cost.explain import KernelCost
    from coplan.cost.steptrace import ReservedMemory
    from coplan.hardware.cluster import ClusterSpec


def estimate(
    model: ModelOpt = DEFAULT_MODEL,
    cluster: ClusterOpt = DEFAULT_CLUSTER,
    gpus: GpusOpt = DEFAULT_GPUS,
    tp: Annotated[int, typer.Option("--tp", help="Tensor-parallel degree.")] = 1,
    pp: Annotated[int, typer.Option("--pp", help="Pipeline-parallel degree.")] = 1,
    cp: Annotated[
        int,
        typer.Option(
            "--cp",
            help="Context-parallel degree: ranks sharing each sequence, attention over a ring "
            "(Megatron's --context-parallel-size).",
        ),
    ] = 1,
    dp: Annotated[
        int | None, typer.Option("--dp", help="Data-parallel degree \\[default: N / (tp x pp)].")
    ] = None,
    vpp: Annotated[int, typer.Option("--vpp", help="Model chunks per pipeline rank (interleaved 1F1B).")] = 1,
    microbatch: MicrobatchOpt = 1,
    global_batch: GlobalBatchOpt = None,
    seq: SeqOpt = None,
    recompute: Annotated[
        Recompute,
        typer.Option(
            "--recompute",
            help="Activation recomputation: none, Megatron-LM's selective (the attention core), full "
            "(each block), or torchtitan's per-op selective-op (every saved tensor but the outputs "
            "of every other matmul and of attention).",
        ),
    ] = Recompute.none,
    recompute_layers: Annotated[
        int | None,
        typer.Option(
            "--recompute-layers",
            help="With --recompute full, recompute only the first N blocks of each pipeline chunk; the "
            "others save their activations (Megatron-LM's --recompute-method block "
            "--recompute-num-layers N) \\[default: every block].",
            show_default=False,
        ),
    ] = None,
    sequence_parallel: Annotated[
        bool,
        typer.Option(
            "--sequence-parallel", help="Shard norms and dropout along the sequence (needs --tp > 1)."
        ),
    ] = False,
    zero: Annotated[int, typer.Option("--zero", help="ZeRO stage 0-3 (1 = distributed optimizer).")] = 0,
    dtype: Annotated[
        Dtype, typer.Option("--dtype", help="Matmul precision (16-bit and fp8 keep fp32 master weights).")
    ] = Dtype.bf16,
    flash_attention: Annotated[
        bool, typer.Option("--flash-attention/--no-flash-attention", help="Fused attention kernel.")
    ] = True,
    attention_kernel: Annotated[
        AttentionKernel,
        typer.Option(
            "--attention-kernel",
            help="Fused attention kernel: auto (what Transformer Engine picks on the device: cuDNN on "
            "Hopper, FlashAttention-2 on Ampere) or one the stack forces (flash2: NVTE_FUSED_ATTN=0, "
            "PyTorch SDPA; triton: MPT's attn_impl triton); a kernel the device has no rates for is an "
            "error.",
        ),
    ] = AttentionKernel.auto,
    fusion: Annotated[
        Fusion, typer.Option("--fusion", help="Kernel fusion: Megatron-LM's fused kernels, or eager.")
    ] = Fusion.megatron,
    overlap_grad_reduce: Annotated[
        bool,
        typer.Option(
            "--overlap-grad-reduce/--no-overlap-grad-reduce",
            help="Overlap DP gradient reduction with backward.",
        ),
    ] = True,
    overlap_param_gather: Annotated[
        bool | None,
        typer.Option(
            "--overlap-param-gather/--no-overlap-param-gather",
            help="ZeRO 1/2: overlap the parameter all-gather with the next step's forward "
            "\\[default: on with --zero 1 or 2, as Megatron-Core recipes pair it with the distributed "
            "optimizer].",
            show_default=False,
        ),
    ] = None,
    tp_comm_overlap: Annotated[
        bool | None,
        typer.Option(
            "--tp-comm-overlap/--no-tp-comm-overlap",
            help="Overlap tensor-parallel collectives with the GEMMs (Transformer Engine userbuffers) "
            "\\[default: on with --sequence-parallel and --tp > 1 on Hopper or newer GPUs, as NVIDIA's "
            "recipes run them; off otherwise].",
            show_default=False,
        ),
    ] = None,
    async_tp: Annotated[
        bool,
        typer.Option(
            "--async-tp",
            help="Overlap tensor-parallel collectives as PyTorch's async TP does (torchtitan "
            "enable_async_tensor_parallel: the pairs Inductor's micro-pipeline pass fuses; needs "
            "--sequence-parallel; instead of userbuffers).",
        ),
    ] = False,
    fused_rmsnorm: Annotated[
        bool,
        typer.Option(
            "--fused-rmsnorm",
            help="RMSNorm runs as one fused kernel each way keeping its input and row statistics, "
            "not the normalized tensor (torchtitan's norm_type fused_rmsnorm).",
        ),
    ] = False,
    attention_unpad: Annotated[
        bool,
        typer.Option(
            "--attention-unpad",
            help="Eager attention through flash-attn's variable-length kernel, its inputs unpadded "
            "and its output padded back around each call (llm-foundry's attn_impl flash).",
        ),
    ] = False,
    tp_overlap_cfg: Annotated[
        Path | None,
        typer.Option(
            "--tp-overlap-cfg",
            help="A recipe's userbuffers settings (NeMo's ub_cfg_*.yaml, or the same as JSON: slot -> "
            "method, num_sm, num_splits, set_sm_margin) \\[default: Transformer Engine's].",
            show_default=False,
        ),
    ] = None,
    overlap_p2p: Annotated[
        bool,
        typer.Option(
            "--overlap-p2p/--no-overlap-p2p",
            help="Interleaved pipelines: overlap stage sends with the next chunk's compute.",
        ),
    ] = True,
    grad_reduce_fp32: Annotated[
        bool,
        typer.Option(
            "--grad-reduce-fp32/--grad-reduce-16bit",
            help="Keep and reduce gradients in fp32 (Megatron's default under bf16) or in 16 bits.",
        ),
    ] = True,
    fp8_params: Annotated[
        bool,
        typer.Option(
            "--fp8-params",
            help="With --dtype fp8: fp8 primary weights (NeMo fp8_params, Megatron --fp8-param-gather): "
            "no 16-bit copy of block weights, parameter all-gathers in fp8.",
        ),
    ] = False,
    fp8_scaling: Annotated[
        Fp8Scaling,
        typer.Option(
            "--fp8-scaling",
            help="With --dtype fp8: one scale per tensor (Transformer Engine, torchao tensorwise) or "
            "per row (torchao rowwise: casts along both axes, rescaled backward GEMMs, 16-bit TP gathers).",
        ),
    ] = Fp8Scaling.tensorwise,
    zero3_gather: Annotated[
        Zero3Gather | None,
        typer.Option(
            "--zero3-gather",
            help="How ZeRO-3 issues its all-gathers and reduce-scatters: one per layer (FSDP), one per "
            "module owning parameters (DeepSpeed), or one per parameter tensor with a tensor per rank "
            "for PyTorch to copy (DeepSpeed before v0.5.6) \\[default: the stack's].",
            show_default=False,
        ),
    ] = None,
    grad_accumulation: Annotated[
        GradAccumulation | None,
        typer.Option(
            "--grad-accumulation",
            help="How gradients accumulate over microbatches where no ZeRO stage shards them: inside "
            "the weight-gradient GEMMs (Megatron), by autograd into 16-bit or fp32 .grad, or copied "
            "into fp32 buffers (DeepSpeed's BF16_Optimizer) \\[default: the stack's].",
            show_default=False,
        ),
    ] = None,
    optimizer: Annotated[
        Optimizer | None,
        typer.Option(
            "--optimizer",
            help="How AdamW's update runs: one fused multi-tensor kernel (fused=True, Apex and "
            "Transformer Engine FusedAdam), PyTorch's foreach kernels (its default on CUDA) or its "
            "per-parameter loop (foreach=False, or a PyTorch before 2.0) \\[default: the stack's].",
            show_default=False,
        ),
    ] = None,
    fsdp_shard: Annotated[
        int | None,
        typer.Option(
            "--fsdp-shard",
            help="With FSDP units (a PyTorch stack's --zero 2/3): shard within groups of N data-parallel "
            "GPUs and replicate across them (FSDP's HYBRID_SHARD, torchtitan's data_parallel_shard_degree "
            "beside data_parallel_replicate_degree) \\[default: shard over every data-parallel GPU].",
            show_default=False,
        ),
    ] = None,
    fsdp_pipeline: Annotated[
        FsdpPipeline | None,
        typer.Option(
            "--fsdp-pipeline",
            help="Under pipeline parallelism, FSDP's units gathered and reduced every microbatch, or "
            "kept gathered through the step with gradients accumulated unsharded and reduced once "
            "after the stage's last backward (torchtitan) \\[default: the stack's].",
            show_default=False,
        ),
    ] = None,
    cp_exchange: Annotated[
        CpExchange | None,
        typer.Option(
            "--cp-exchange",
            help="How context parallelism exchanges keys and values: Transformer Engine's ring of "
            "point-to-point transfers, or PyTorch's context_parallel (torchtitan): one all-gather, "
            "fp32 merges and fp32 key/value gradients \\[default: the stack's].",
            show_default=False,
        ),
    ] = None,
    pp_send: Annotated[
        PpSend | None,
        typer.Option(
            "--pp-send",
            help="How a pipeline stage sends on under tensor parallelism: Megatron-LM's scatter-gather "
            "(each TP rank 1/t, all-gathered over NVLink), or the whole activation from every TP rank "
            "and the causal mask beside it (DeepSpeed's pipeline engine) \\[default: the stack's].",
            show_default=False,
        ),
    ] = None,
    eager_loss_cast: Annotated[
        LossCast | None,
        typer.Option(
            "--eager-loss-cast",
            help="Where the loss runs eager, how the 16-bit logits reach it: the model's .float() "
            "(torchtitan), F.cross_entropy under autocast (a 16-bit log-softmax, an fp32 cast for "
            "nll_loss), the loss in 16 bits, a fused cross-entropy kernel, or .float() then DTensor's "
            "loss_parallel over vocabulary shards \\[default: the stack's].",
            show_default=False,
        ),
    ] = None,
    compile_: CompileOpt = None,
    launch_blocking: Annotated[
        bool,
        typer.Option(
            "--launch-blocking",
            help="Kernel launches synchronous (CUDA_LAUNCH_BLOCKING=1): each adds the host's issue "
            "time of an eager op in series.",
        ),
    ] = False,
    zero3_overlap: Annotated[
        bool,
        typer.Option(
            "--zero3-overlap/--no-zero3-overlap",
            help="ZeRO-3/FSDP collectives prefetched behind compute (off: each one waits, as DeepSpeed "
            "before v0.5.6 synchronized the device before every gather).",
        ),
    ] = True,
    nccl_ub: Annotated[
        bool,
        typer.Option(
            "--nccl-ub",
            help="Data-parallel buffers registered with NCCL (Megatron-Core ddp_config.nccl_ub): its "
            "collectives hold fewer SMs beside the compute they overlap.",
        ),
    ] = False,
    activation_fusion: Annotated[
        bool,
        typer.Option(
            "--activation-fusion/--no-activation-fusion",
            help="The MLP activation as Megatron's fused kernels, or op by op in eager PyTorch "
            "(NeMo 2.x's squared ReLU).",
        ),
    ] = True,
    loss_fusion: Annotated[
        LossFusion,
        typer.Option("--loss-fusion", help="Megatron's cross-entropy kernels: unfused, native or te."),
    ] = LossFusion.none,
    dp_bucket_params: Annotated[
        int | None,
        typer.Option(
            "--dp-bucket-params",
            min=1,
            help="Parameters per DP gradient bucket (Megatron --ddp-bucket-size) \\[default: "
            "Megatron-Core's max(4e7, 1e6 x dp)].",
            show_default=False,
        ),
    ] = None,
    dp_bucket_scope: Annotated[
        BucketScope,
        typer.Option(
            "--dp-bucket-scope",
            help="How gradients are bucketed: Megatron-Core's rule (pipeline stage 0's first chunk, "
            "with --overlap-grad-reduce), all (every chunk: PyTorch DDP), padded (every layer opens "
            "whole buckets: Apex distributed Adam in NeMo) or none (one collective per chunk).",
        ),
    ] = BucketScope.megatron_core,
    stage_layers: Annotated[
        str | None,
        typer.Option(
            "--stage-layers",
            help="Layers per pipeline stage (per virtual stage with --vpp), comma-separated, "
            "e.g. 3,4,4,5 \\[default: an even split].",
        ),
    ] = None,
    hidden_dropout: Annotated[
        float | None,
        typer.Option(
            "--hidden-dropout",
            help=r"Dropout on the residual branches (Megatron's --hidden-dropout) \[default: the model's].",
        ),
    ] = None,
    attention_dropout: Annotated[
        float | None,
        typer.Option(
            "--attention-dropout",
            help="Dropout on the attention probabilities (Megatron's --attention-dropout) "
            r"\[default: the model's].",
        ),
    ] = None,
    kernels: Annotated[
        int,
        typer.Option(
            "--kernels",
            help="List the N most expensive kernels of the slowest pipeline stage (one microbatch).",
            show_default=False,
        ),
    ] = 0,
    stack: StackOpt = None,
    stack_file: StackFileOpt = None,
    history: RecordHistoryOpt = False,
    db: RecordDbOpt = None,
    json: JsonOpt = False,
) -> None:
    """Predict step time, per-GPU memory and MFU of one training configuration."""
    from coplan.cost import ConfigError, CostModel, TrainingConfig
    from coplan.cost.config import degrees, production_overlaps
    from coplan.errors import SpecError
    from coplan.hardware import load_cluster
    from coplan.models.spec import load_model_spec

    positive("--gpus", gpus)
    for name, value in (
        ("--tp", tp),
        ("--pp", pp),
        ("--cp", cp),
        ("--vpp", vpp),
        ("--microbatch", microbatch),
    ):
        positive(name, value)
    positive("--dp", dp, optional=True)
    positive("--global-batch", global_batch, optional=True)
    positive("--seq", seq, optional=True)
    if kernels < 0:
        raise ConfigError("kernels", f"--kernels must be 0 or more, got {kernels}")
    if zero not in (0, 1, 2, 3):
        raise ConfigError("zero", f"--zero must be 0, 1, 2 or 3, got {zero}")
    record_db = recording_to(history, db)
    per_op = recompute is Recompute.selective_op
    if per_op and recompute_layers is not None:
        raise ConfigError(
            "recompute_layers", "--recompute-layers counts fully recomputed blocks: needs --recompute full"
        )
    named = resolve_stack(stack, stack_file)
    # the stack as it runs the step: its compiled preset where --compile turns torch.compile on
    the_stack = compiled_stack(named, compile_)
    spec = load_model_spec(model)
    # the run's dropout, where it differs from the model's (Megatron's GPT runs use 0.1); the spec
    # checks the values, and its error names the flag that set them
    try:
        spec = replace(
            spec,
            hidden_dropout=spec.hidden_dropout if hidden_dropout is None else hidden_dropout,
            attention_dropout=spec.attention_dropout if attention_dropout is None else attention_dropout,
        )
    except SpecError as e:
        raise ConfigError(e.field, f"--{(e.field or '').replace('_', '-')} {e.reason}") from None
    hw = load_cluster(cluster, gpus)
    n = hw.num_devices
    if dp is None:
        if n % (tp * cp * pp):
            raise ConfigError("dp", f"{degrees(tp, cp, pp)} = {tp * cp * pp} does not divide the {n} GPUs")
        dp = n // (tp * cp * pp)
    # what the user left unsaid, a production Megatron-Core stack decides (``production_overlaps``)
    auto = production_overlaps(hw.devices, tp, sequence_parallel, zero)
    if tp_comm_overlap is None:
        tp_comm_overlap = auto["tp_comm_overlap"] and the_stack.tp_comm_overlap and not async_tp
    if overlap_param_gather is None:
        overlap_param_gather = auto["overlap_param_gather"]
    config = TrainingConfig(
        tp=tp,
        pp=pp,
        dp=dp,
        cp=cp,
        vpp=vpp,
        microbatch=microbatch,
        global_batch=global_batch if global_batch is not None else default_global_batch(microbatch * dp),
        seq=seq,
        sequence_parallel=sequence_parallel,
        recompute="none" if per_op else recompute.value,
        recompute_layers=recompute_layers,
        zero=zero,
        dtype=dtype.value,
        flash_attention=flash_attention,
        attention_kernel=attention_kernel.value,
        fusion=fusion.value,
        overlap_grad_reduce=overlap_grad_reduce,
        overlap_param_gather=overlap_param_gather,
        tp_comm_overlap=tp_comm_overlap,
        async_tp=async_tp,
        fused_rmsnorm=fused_rmsnorm,
        attention_unpad=attention_unpad,
        tp_overlap_cfg=_ub_cfg(tp_overlap_cfg),
        overlap_p2p=overlap_p2p,
        grad_reduce_fp32=grad_reduce_fp32,
        fp8_params=fp8_params,
        fp8_scaling=fp8_scaling.value,
        nccl_ub=nccl_ub,
        activation_fusion=activation_fusion,
        loss_fusion=loss_fusion.value,
        stage_layers=_stage_layers(stage_layers),
        dp_bucket_params=dp_bucket_params,
        dp_bucket_scope=dp_bucket_scope.value,
    )
    # what the stack decides: its kernels, attention kernel and sharding units (``StackSpec.configure``)
    config = the_stack.configure(config)
    if config.stage_layers is None:
        # a pipeline whose chunks do not divide the blocks, split as the stack splits it
        split = the_stack.stage_split(spec.n_layers, config.pp, config.vpp)
        if split is not None:
            config = config.with_(stage_layers=split)
    if zero3_gather is not None:
        config = config.with_(zero3_gather=zero3_gather.value)
    if grad_accumulation is not None:
        config = config.with_(grad_accumulation=grad_accumulation.value)
    if optimizer is not None:
        config = config.with_(optimizer=optimizer.value)
    if fsdp_shard is not None:
        if not (config.fsdp_units and config.zero >= 2):
            raise ConfigError(
                "fsdp_shard", "--fsdp-shard shards FSDP units: needs a stack with them and --zero 2 or 3"
            )
        config = config.with_(fsdp_shard=fsdp_shard)
    if fsdp_pipeline is not None:
        config = config.with_(fsdp_pipeline=fsdp_pipeline.value)
    if cp_exchange is not None:
        config = config.with_(cp_exchange=cp_exchange.value)
    if pp_send is not None:
        config = config.with_(pp_send=pp_send.value)
    if eager_loss_cast is not None:
        config = config.with_(eager_loss_cast=eager_loss_cast.value)
    if not zero3_overlap:
        config = config.with_(overlap_zero=False)
    if launch_blocking:
        config = config.with_(launch_blocking=True)
    cm = CostModel(spec=spec)
    if per_op:
        # the policy's saved set over this step's graph (its kernels decide what a block writes)
        config = config.with_(recompute=cm.selective_op_set(config))
    est = cm.estimate(hw, config)
    # what PyTorch's caching allocator reserves for it (None on a CPU)
    reserved = cm.reserved(hw, est, the_stack)
    listed = _kernels(cm, hw, est, kernels) if kernels else None
    from coplan.cost.envelope import validated

    # torchtitan's per-op policy, priced as its set over this step's graph, is judged as its runs
    per_op_set = (
        {config.recompute: "selective-op"} if per_op and isinstance(config.recompute, frozenset) else None
    )
    trust = validated(est, spec, the_stack.name, policies=per_op_set)
    from coplan.plan.capabilities import config_problems

    # what of the configuration the named stack cannot run: priced as asked, and said
    unrunnable = config_problems(the_stack, config)
    if per_op and "selective-op" not in the_stack.checkpointing:
        policies = ", ".join(the_stack.checkpointing)
        unrunnable.append(
            f"stack {the_stack.name!r} cannot recompute 'selective-op' (its policies: {policies})"
        )
    record_id = None
    if json or record_db is not None:
        out = est.to_dict()
        out["validated"] = trust.to_dict()
        if trust.cautions:
            out["cautions"] = list(trust.cautions)
        out["model"] = spec.name
        out["seq"] = spec.resolve_seq(seq)
        out["stack"] = named.name
        if named.compile_preset or named.kernels == "inductor":
            # as plan --json says it: whether the step runs under torch.compile
            out["compile"] = the_stack.kernels == "inductor"
        out["stack_problems"] = unrunnable
        if reserved is not None:
            out["memory"].update(reserved.to_dict())
        if listed is not None:
            out["kernels"] = {"stage": listed[0], "rows": [row.to_dict() for row in listed[1]]}
    if record_db is not None:
        from coplan.inspect.history import command_record

        # an estimate runs nothing: no device, nothing measured; the hardware is the cluster priced
        entry = command_record(
            "estimate",
            model=spec.name,
            batch=config.global_batch,
            seq=out["seq"],
            device=None,
            hardware=hw.name,
            fingerprint=None,
            predicted_step_s=est.step_time_s,
            measured=None,
            payload=dict(out),
        )
        out["record_id"] = record_id = record(record_db, entry)
    if json:
        print_json(out)
        return
    render(est, f"{spec.name} on {hw.summary()}", reserved)
    show_trust(stdout(), trust)
    for why in unrunnable:
        stdout().print(f"note: {why}: priced as asked", soft_wrap=True)
    if listed is not None:
        render_kernels(est, *listed)
    say_recorded(record_id, record_db)


def _kernels(cm: CostModel, hw: ClusterSpec, est: Estimate, top: int) -> tuple[int, list[KernelCost]]:
    """(stage, its ``top`` most expensive kernels): the stage with the longest microbatch."""
    from coplan.cost.explain import kernel_costs

    c = est.config
    stage = max(est.stages, key=lambda st: st.microbatch_s).index
    return stage, list(kernel_costs(cm.profile_for(c), hw, c, stage)[:top])


def render_kernels(est: Estimate, stage: int, rows: list[KernelCost]) -> None:
    st = est.stages[stage]
    compute = st.forward_s + st.backward_s
    table = Table(
        title=f"stage {stage}: most expensive kernels of one microbatch ({compute * 1e3:.4g} ms of compute)",
        box=box.SIMPLE_HEAD,
    )
    table.add_column("kernel", overflow="fold")
    table.add_column("pass", no_wrap=True)
    table.add_column("x", justify="right", no_wrap=True)
    table.add_column("GEMM MxNxK", no_wrap=True)
    table.add_column("ms", justify="right", no_wrap=True)
    table.add_column("share", justify="right", no_wrap=True)
    table.add_column("bound", no_wrap=True)
    for r in rows:
        table.add_row(
            r.name if r.kind != "fp8 casts" else f"{r.part}: {r.name}",
            "fwd" if r.phase == "forward" else "bwd",
            f"{r.count:g}",
            r.dims.replace(" ", ""),
            f"{r.total_s * 1e3:.4g}",
            f"{r.total_s / compute:.1%}" if compute else "-",
            r.bound,
        )
    stdout().print(table)
    stdout().print(
        "ms: all launches of the kernel on the stage; GEMM sizes as one GPU runs them", soft_wrap=True
    )


def _ub_cfg(path: Path | None) -> tuple[tuple[str, str, int, int, bool], ...]:
    """``--tp-overlap-cfg FILE``: a YAML or JSON mapping of userbuffers slots, checked."""
    from coplan.cost import ConfigError
    from coplan.cost.tp_overlap import read_ub_cfg
    from coplan.errors import SpecError
    from coplan.fileio import read_text

    if path is None:
        return ()
    where = f"--tp-overlap-cfg {path}"
    try:
        text = read_text(path, where)
    except SpecError as exc:
        raise ConfigError("tp_overlap_cfg", str(exc)) from None
    try:
        data = _parse(text, path.suffix == ".json")
    except ValueError as exc:
        raise ConfigError("tp_overlap_cfg", f"{where}: {exc}") from None
    try:
        return read_ub_cfg(data)
    except ValueError as exc:
        raise ConfigError("tp_overlap_cfg", f"{where}: {exc}") from None


def _parse(text: str, is_json: bool) -> object:
    """JSON, or YAML (NeMo's format) where PyYAML is installed; ValueError with one line if not."""
    import json as _json

    if is_json:
        try:
            return _json.loads(text)
        except _json.JSONDecodeError as exc:
            raise ValueError(f"not valid JSON: {exc}") from None
    try:
        import yaml
    except ImportError:
        raise ValueError("reading YAML needs PyYAML (pip install pyyaml); or give a .json file") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"not valid YAML: {str(exc).splitlines()[0]}") from None


def _stage_layers(text: str | None) -> tuple[int, ...] | None:
    """``--stage-layers 3,4,4,5`` as a tuple (the cost model checks it against the layout)."""
    from coplan.cost import ConfigError

    if text is None:
        return None
    try:
        layers = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ConfigError(
            "stage_layers", f"--stage-layers must be comma-separated integers, got {text!r}"
        ) from None
    return layers


def render(est: Estimate, title: str, reserved: ReservedMemory | None = None) -> None:
    """The estimate as Rich tables: headline figures, time breakdown, memory of the loaded GPU
    (with what the caching allocator reserves, where ``reserved`` says)."""
    console = stdout()
    c = est.config
    console.print(f"[bold]{title}[/bold]", soft_wrap=True)
    rec = c.recompute if isinstance(c.recompute, str) else f"{len(c.recompute)} tensors of each block"
    if c.recompute_layers is not None:
        rec += f" (first {c.recompute_layers} blocks of each chunk)"
    cp_text = f" cp={c.cp}" if c.cp > 1 else ""
    if c.cp > 1 and c.cp_exchange != "p2p":
        cp_text += f" ({c.cp_exchange})"
    # an uneven pipeline: the blocks of each chunk, as given or as the stack splits them
    split = f" layers={'/'.join(map(str, c.stage_layers))}" if c.stage_layers is not None else ""
    fsdp = " (FSDP gathered through the step)" if c.fsdp_per_step else ""
    if c.hybrid_group is not None:
        fsdp += f" (HSDP: sharded in groups of {c.hybrid_group})"
    console.print(
        f"tp={c.tp} pp={c.pp}{split} dp={c.dp}{cp_text} vpp={c.vpp} microbatch={c.microbatch} "
        f"global batch={c.global_batch} "
        f"({c.num_microbatches} microbatches) recompute={rec} sp={'on' if c.sequence_parallel else 'off'} "
        f"zero={c.zero}{fsdp} dtype={c.dtype}{' (fp8 params)' if c.fp8_params else ''}"
        f"{' (rowwise)' if c.fp8_scaling == 'rowwise' and c.dtype == 'fp8' else ''} "
        f"flash={'on' if c.flash_attention else 'off'}"
        f"{'' if c.attention_kernel == 'auto' else f' ({c.attention_kernel})'} fusion={c.fusion}",
        soft_wrap=True,
    )
    # the overlaps decide much of the communication's price, and their defaults follow the hardware
    overlaps = {
        "grad-reduce": c.overlap_grad_reduce,
        "param-gather": c.overlap_param_gather,
        "tp-comm": c.tp_comm_overlap,
        "p2p": c.overlap_p2p,
    }
    shown = {k: "on" if v else "off" for k, v in overlaps.items()}
    if c.tp_comm_overlap and c.tp > 1:
        n = len(c.tp_overlap_cfg)
        tuned = f"{n} userbuffers slot{'s' if n != 1 else ''} tuned, the rest TE's defaults"
        shown["tp-comm"] = "on (" + (tuned if n else "TE's userbuffers defaults") + ")"
    if c.async_tp and c.tp > 1:
        shown["tp-comm"] = "async TP (the pairs PyTorch's micro-pipeline pass fuses)"
    console.print("overlaps: " + " ".join(f"{k}={v}" for k, v in shown.items()), soft_wrap=True)
    head = Table(box=box.SIMPLE_HEAD, show_header=False)
    head.add_column(style="bold")
    head.add_column(justify="right")
    head.add_row("step time", f"{est.step_time_s:.4g} s")
    head.add_row("tokens/s", f"{est.tokens_per_s:,.0f}")
    head.add_row("model TFLOP/s per GPU", f"{est.model_tflops_per_gpu:.1f}")
    head.add_row("MFU", mfu_words(est))
    fits = "[green]yes[/green]" if est.fits else "[red]no[/red]"
    head.add_row(
        "fits in memory",
        f"{fits} ({human_bytes(est.memory.peak_bytes)} of {human_bytes(est.memory.capacity_bytes)})",
    )
    head.add_row(
        "kernels per step", f"{est.kernels_per_step:,} ({est.launch_overhead_s:.3g} s launch overhead)"
    )
    console.print(head)
    for note in est.notes:
        console.print(f"note: {note}", soft_wrap=True)
    times = Table(title="step time breakdown", box=box.SIMPLE_HEAD)
    times.add_column("component")
    times.add_column("seconds", justify="right")
    times.add_column("share", justify="right")
    for key, value in est.breakdown_s.items():
        times.add_row(key, f"{value:.4g}", f"{value / est.step_time_s:.1%}")
    mem = Table(title=f"memory of the most loaded GPU (stage {est.memory.stage})", box=box.SIMPLE_HEAD)
    mem.add_column("part")
    mem.add_column("bytes", justify="right")
    m = est.memory
    # autograd makes the gradients during backward; DDP's buckets hold a copy (``stages.peak_of``)
    grads = "gradients"
    if m.grads_bytes and m.peak_grads_bytes == 0:
        grads = "gradients (made by backward, after the peak)"
    elif m.grads_bytes and m.peak_grads_bytes > 1.5 * m.grads_bytes:
        grads = "gradients (twice at the peak: DDP's buckets beside .grad)"
    for key, value in (
        ("parameters", m.params_bytes),
        (grads, m.grads_bytes),
        ("optimizer state", m.optimizer_bytes),
        ("activations (in flight)", m.activations_bytes),
        ("transient working set", m.transient_bytes),
        ("peak", m.peak_bytes),
    ):
        mem.add_row(key, human_bytes(value))
    if reserved is not None:
        mem.add_row(
            "reserved by the caching allocator"
            + (" (expandable segments)" if reserved.expandable_segments else ""),
            human_bytes(reserved.reserved_bytes),
        )
    console.print(times)
    console.print(mem)
    if reserved is not None and reserved.releases_cache:
        console.print(
            "note: the caching allocator would reserve "
            f"{human_bytes(reserved.allocated_bytes + reserved.overhead_bytes)}, more than the device: "
            "it frees its cached segments and retries (slower steps)",
            soft_wrap=True,
        )
    if not est.fits:
        console.print("[red]does not fit:[/red] the peak exceeds the device memory", soft_wrap=True)
