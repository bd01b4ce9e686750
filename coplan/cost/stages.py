"""What a pipeline stage holds: its layers and devices, microbatches in flight under 1F1B and
Megatron's interleaved schedule, the boundary activations between stages, and the static memory
(weights, gradients, optimizer state) of one GPU. Pure functions of the configuration, used by
``estimate`` and ``explain``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from coplan.cost.config import TrainingConfig
from coplan.cost.kernels import matmul_dtype
from coplan.cost.parts import GraphProfile, Part
from coplan.hardware.cluster import ClusterSpec
from coplan.hardware.device import DeviceSpec


def drops_output(profile: GraphProfile, part: Part, names: frozenset[str]) -> bool:
    from coplan.cost.remat import drops_output as rule

    return bool(part.memo(("drops_output", names), lambda: rule(profile.graph, part, names)))


def in_flight(stage: int, p: int, v: int, m: int) -> float:
    """Microbatches (v == 1) or chunk-microbatches (v > 1) whose activations stage ``stage`` holds
    at its peak under 1F1B / Megatron's interleaved schedule."""
    if v == 1:
        return float(min(p - stage, m))
    warmup = (p - stage - 1) * 2 + (v - 1) * p
    return float(min(warmup + 1, m * v))


def boundary_held(
    profile: GraphProfile,
    mine: list[Part],
    rec: str | frozenset[str],
    config: TrainingConfig,
    s: int,
    p: int,
    v: int,
    m: int,
    ab: int,
    t: int,
    elems: float,
    saves_last: Sequence[bool] | None = None,
) -> float:
    """Bytes of pipeline boundary activations stage ``s`` holds beyond what its parts count;
    ``elems`` is one boundary activation's elements per microbatch (``Part.boundary``).

    The parts count a saved tensor on the stage that produces it, so a chunk's output (the next
    block's input, saved by that block's first norm) is charged to the sending chunk and the
    received input to nobody. What the stages really hold: the receiving chunk keeps its input
    for its backward, once per microbatch in flight, on every chunk but the model's first (whose
    input, the embedding output, its own side counts); the sending chunk drops its output after
    the send where the stack frees it (Megatron-LM's ``deallocate_pipeline_outputs``,
    megatron/core/pipeline_parallel/schedules.py ``deallocate_output_tensor``), and keeps it where
    the stack holds it for the backward it runs through autograd (torch.distributed.pipelining,
    ``config.pipeline_keeps_outputs``). Under full recomputation the blocks count their inputs
    (received inputs included) and not their outputs. A remat set that drops the block output
    leaves the chunk's input held by the schedule, uncounted by the parts. ``saves_last``: per
    chunk, whether its last block saves what autograd saves under full recomputation of only the
    chunk's first blocks (``TrainingConfig.recompute_layers``); that block counts its output."""
    if elems <= 0 or not mine:
        return 0.0
    one = elems * ab / (t if config.sequence_parallel and t > 1 else 1)
    if rec == "full":
        counts_in, counts_out = True, False
    elif isinstance(rec, frozenset) and rec and drops_output(profile, mine[-1], rec):
        counts_in = counts_out = False
    else:
        counts_in, counts_out = False, True
    held = 0.0
    for c in range(v):
        n = chunk_in_flight(s, p, v, m, c)
        receives = not (s == 0 and c == 0)
        sends = not (s == p - 1 and c == v - 1)
        if saves_last is not None:
            counts_out = saves_last[c]
        if receives and not counts_in:
            held += n * one
        if sends:
            if counts_out and not config.pipeline_keeps_outputs:
                held -= n * one
            elif not counts_out and config.pipeline_keeps_outputs:
                held += n * one
    return held


def chunk_in_flight(stage: int, p: int, v: int, m: int, chunk: int) -> float:
    """Microbatches of model chunk ``chunk`` whose activations stage ``stage`` holds at its peak.

    Megatron's interleaved schedule runs the warm-up forwards (``in_flight``) in groups of ``p``
    microbatches per chunk, chunk after chunk (megatron/core/pipeline_parallel/schedules.py,
    ``get_model_chunk_id``), so the peak holds ``min(p, left)`` microbatches of each group of
    that chunk. On the last stage the last chunk runs one forward then its backward (its warm-up
    covers the other chunks only): one microbatch, which is where the loss's logits live."""
    if v == 1:
        return float(min(p - stage, m))
    n = int(in_flight(stage, p, v, m))
    held = 0
    g = 0
    while g * p < n:
        if g % v == chunk:
            held += min(p, n - g * p)
        g += 1
    return float(min(held, m))


def fsdp_fp32_shard(config: TrainingConfig) -> bool:
    """PyTorch FSDP shards the parameters under a mixed-precision policy: each shard is kept once,
    in fp32, as the parameter and the master weight at once (``static_bytes``)."""
    return config.mixed and config.master_weights and config.fsdp_units and config.zero >= 3


def static_bytes(p_local: float, config: TrainingConfig, d: int) -> tuple[float, float, float]:
    """Parameters, gradients and optimizer state on one GPU. Megatron mixed precision: 16-bit
    weights, fp32 main gradients, fp32 master weights and Adam moments (2 + 4 + 12 bytes); fp32:
    4 + 4 + 8; pure 16-bit without master weights: 2 + 2 + 4. ZeRO shards them.

    PyTorch FSDP (``fsdp_units``) sharding parameters under a mixed-precision policy keeps one
    copy of each shard, in fp32: the optimizer steps it as its master weight, and the 16-bit
    parameters exist only as the gathered units (``coplan.cost.zero.fsdp_transient``). Its sharded
    gradient is cast back to that dtype after the reduce-scatter whatever the reduce dtype
    (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py ``foreach_reduce``:
    ``_to_dtype_if_needed(reduce_output, orig_dtype)``; FSDP1 ``_cast_grad_to_param_dtype``,
    torch/distributed/fsdp/_runtime_utils.py, at v2.13.0): 4 + 4 + 8, the fp32 shard counted as
    the parameters."""
    master = config.mixed and config.master_weights
    wide = 4 if (master or not config.mixed) else config.act_bytes
    fsdp_master = fsdp_fp32_shard(config)
    w = p_local * (4 if fsdp_master else config.act_bytes)
    g = p_local * (wide if config.grad_reduce_fp32 or not config.mixed or fsdp_master else config.act_bytes)
    o = p_local * (8 if fsdp_master else 12 if master else 2 * wide)
    if config.zero >= 1:
        o /= d
    if config.zero >= 2:
        g /= d
    if config.zero >= 3:
        w /= d
    return w, g, o


def peak_of(
    static: tuple[float, float, float],
    activations: float,
    transient: float,
    config: TrainingConfig,
    p_local: float,
    per_step: bool = False,
) -> tuple[float, float]:
    """(peak bytes, gradient bytes held at it) of a GPU holding ``static`` (parameters,
    gradients, optimizer state), ``activations`` saved for backward and a ``transient`` working set.

    Where the gradients are autograd's (``TrainingConfig.grad_storage``) a step's backward makes
    them: FSDP's sharded gradients by each unit's reduce-scatter after its backward, a process's
    ``.grad`` as each weight's gradient is computed, and ``zero_grad(set_to_none=True)``
    (PyTorch's default since 2.0, what torchtitan, Composer, nanoGPT and coplan's runner call)
    drops them after the step. With one microbatch a step the forward and the loss hold none, and
    as backward makes a block's gradients it frees that block's activations: the start of backward
    holds every activation and no gradient, its end every gradient and no activation, so the larger
    of the two sets the peak. Several microbatches hold the first one's gradients through the rest,
    as do FSDP's units gathered through a pipeline step (``per_step``); buffers
    (``"buffer"``: Megatron's, DeepSpeed's) are held throughout; PyTorch DDP (``"ddp"`` at ZeRO 0
    over several data-parallel ranks) holds its buckets, one more copy of every gradient, beside
    ``.grad``. PyTorch's multi-tensor AdamW (``optimizer="foreach"``) adds one fp32 list the size of
    a moment while it steps (``_foreach_sqrt`` of the second moments, torch/optim/adamw.py), beside
    every gradient."""
    w, g, o = static
    mode = config.grad_storage
    buckets = g if mode == "ddp" and config.zero == 0 and config.dp_cp > 1 else 0.0
    if mode == "buffer" or per_step:
        peak, held = w + g + o + activations + transient, g
    elif config.num_microbatches > 1:
        peak, held = w + o + buckets + g + activations + transient, buckets + g
    else:
        peak = w + o + buckets + transient + max(activations, g)
        held = buckets + (g if g > activations else 0.0)
    if config.optimizer == "foreach":
        moment = 4.0 * p_local / (config.shard_ranks if config.zero >= 1 else 1)
        if w + g + o + buckets + moment > peak:
            peak, held = w + g + o + buckets + moment, g + buckets
    return peak, held


# --- layout: which layers and devices each stage has ------------------------------------------------


def split_layers(n_layers: int, chunks: int, stage_layers: Sequence[int] | None = None) -> list[int]:
    """Layers of each of ``chunks`` model chunks (virtual stages), in model order: ``stage_layers``
    where given, else an even split (the first chunks take one more where the layers do not
    divide)."""
    if stage_layers is not None:
        return list(stage_layers)
    base, extra = divmod(n_layers, chunks)
    return [base + (1 if i < extra else 0) for i in range(chunks)]


#: How a stack splits a model's blocks over a pipeline's chunks where no split is given
#: (``StackSpec.pipeline_split``): ``even`` needs the chunks to divide the blocks (Megatron-LM's
#: default; its ``--decoder-first/last-pipeline-num-layers`` are a split given); ``weighted``
#: counts the embedding and the final norm + output as a block each and spreads the blocks and
#: them as evenly as it can (``weighted_split``)
PIPELINE_SPLITS: tuple[str, ...] = ("even", "weighted")


def weighted_split(n_layers: int, chunks: int, first: int = 1, last: int = 1) -> tuple[int, ...] | None:
    """Blocks of each of ``chunks`` model chunks, in model order, where the embedding counts as
    ``first`` blocks on the first chunk and the final norm + output as ``last`` on the last, and
    ``n_layers + first + last`` are spread as evenly as they go, the first chunks taking one more
    where they do not divide: torchtitan's default split
    (torchtitan/distributed/pipeline_parallel.py ``generate_llm_fqn_per_model_part``, weights
    ``pipeline_parallel_first_stage_less_layers`` / ``..._last_stage_less_layers``, 1 each).
    None where it cannot (a chunk with nothing, or a weight above a chunk's share), as torchtitan
    refuses those."""
    if chunks <= 1:
        return (n_layers,)
    total = n_layers + first + last
    base, extra = divmod(total, chunks)
    if base == 0 or first > base or last > base:
        return None
    share = [base + (1 if i < extra else 0) for i in range(chunks)]
    share[0] -= first
    share[-1] -= last
    if any(n < 0 for n in share) or sum(share) != n_layers:
        return None
    return tuple(share)


def per_stage(chunk_layers: Sequence[int], pp: int, vpp: int) -> list[int]:
    """Layers of each pipeline stage from its chunks' (stage ``s`` holds chunks ``s``, ``s + pp``,
    ...)."""
    return [sum(chunk_layers[c * pp + s] for c in range(vpp)) for s in range(pp)]


def chunk_layers(profile: GraphProfile, config: TrainingConfig) -> list[int]:
    """Layers of each model chunk of ``config``'s layout (``split_layers``)."""
    return split_layers(profile.n_layers, config.pp * config.vpp, config.stage_layers)


#: (layer templates in model order, layers per chunk, first layer of each chunk)
Layout = tuple[tuple[Part, ...], list[int], list[int]]


def stage_layout(profile: GraphProfile, config: TrainingConfig) -> Layout:
    """What ``stage_blocks`` reads, computed once for all stages of an estimate."""
    layers = chunk_layers(profile, config)
    starts = [0]
    for n in layers[:-1]:
        starts.append(starts[-1] + n)
    return profile.layer_templates, layers, starts


def chunk_blocks(
    profile: GraphProfile, config: TrainingConfig, stage: int, layout: Layout | None = None
) -> list[list[Part]]:
    """The block templates of each model chunk pipeline stage ``stage`` runs, chunks ``stage,
    stage + p, stage + 2p, ...`` of the layer sequence (with ``vpp == 1`` the one contiguous
    chunk), one per layer."""
    templates, layers, starts = layout or stage_layout(profile, config)
    out: list[list[Part]] = []
    for c in range(config.vpp):
        i = c * config.pp + stage
        out.append(list(templates[starts[i] : starts[i] + layers[i]]))
    return out


def stage_blocks(
    profile: GraphProfile, config: TrainingConfig, stage: int, layout: Layout | None = None
) -> list[Part]:
    """The block templates of pipeline stage ``stage``, one per layer, its chunks in order
    (``chunk_blocks``)."""
    return [part for blocks in chunk_blocks(profile, config, stage, layout) for part in blocks]


def stage_parts(
    profile: GraphProfile, config: TrainingConfig, stage: int, blocks: list[Part] | None = None
) -> list[tuple[Part, float]]:
    """(part, how many times one microbatch runs it) on pipeline stage ``stage``: its block
    templates by count (``blocks``: its ``stage_blocks``, where known), the embedding side on the
    first stage and the loss side on the last."""
    counts: dict[int, list[Any]] = {}
    for part in stage_blocks(profile, config, stage) if blocks is None else blocks:
        entry = counts.setdefault(id(part), [part, 0.0])
        entry[1] += 1.0
    out = [(e[0], e[1]) for e in counts.values()]
    if stage == 0:
        out.append((profile.pre, 1.0))
    if stage == config.pp - 1:
        out.append((profile.post, 1.0))
    return out


def _rank_devices(cluster: ClusterSpec) -> list[DeviceSpec]:
    out: list[DeviceSpec] = []
    for g in cluster.groups:
        out.extend([g.device] * g.num_devices)
    return out


def devices_of_stage(cluster: ClusterSpec, config: TrainingConfig, stage: int) -> list[DeviceSpec]:
    """The devices of pipeline stage ``stage`` (Megatron's rank order: tensor, context, data, then
    pipeline)."""
    if len(cluster.groups) == 1:
        return [cluster.groups[0].device]
    ranks = _rank_devices(cluster)
    width = config.tp * config.cp * config.dp
    return ranks[stage * width : (stage + 1) * width] or ranks[:1]


def stage_devices(cluster: ClusterSpec, config: TrainingConfig) -> list[DeviceSpec]:
    """The device pacing each stage: the slowest (lowest peak of the precision each device really
    runs, then least memory bandwidth) among its ranks."""
    if len(cluster.groups) == 1:
        return [cluster.groups[0].device] * config.pp
    out = []
    for s in range(config.pp):
        devs = devices_of_stage(cluster, config, s)
        out.append(min(devs, key=lambda dv: (dv.peak(matmul_dtype(dv, config.dtype)), dv.memory_bandwidth)))
    return out
