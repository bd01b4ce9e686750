"""Step time and per-GPU memory of a training configuration: the cost model's entry point.

``estimate(profile, cluster, config)`` prices one configuration of a profiled graph. The step is
modelled as Megatron-LM runs it:

- each pipeline stage holds ``layers / pp`` layers (``/ vpp`` per chunk); the first also holds the
  embedding, the last the final norm, LM head and loss;
- per microbatch a stage runs its forward and backward kernels (``kernels.py``), the recomputation
  its recompute mode asks for, the tensor-parallel collectives on the boundaries between sharded
  and replicated ops, and its point-to-point sends;
- the pipeline (1F1B, or interleaved with ``vpp`` chunks) takes ``m * t_max + (p - 1) / v * t_mean``
  for ``m`` microbatches and per-microbatch stage times ``t``: the slowest stage sets the pace and
  the warm-up/drain bubble costs ``(p - 1) / v`` average microbatch-stage times;
- then gradients are reduced over data-parallel ranks (overlapped with the last microbatch's
  backward when configured), ZeRO gathers parameters, and the optimizer updates its shard.

Memory of a stage: parameters, gradients and optimizer state (sharded by ZeRO stage), the saved
activations of its in-flight microbatches (1F1B: ``p - i`` on stage ``i``; interleaved: Megatron's
warm-up count) and the largest transient working set found by liveness over the part's ops.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from coplan.cost.buckets import StageBuckets, queued_exposure, serial_time
from coplan.cost.checkpoint import selective_op_correction, selective_op_names
from coplan.cost.comm import Group, p2p_time
from coplan.cost.config import TrainingConfig
from coplan.cost.contention import slowdown, sm_share
from coplan.cost.context import kv_elements, ring_exposed, torch_ring
from coplan.cost.eager import repeat_kv_saved, unpad_saved
from coplan.cost.fp8 import runs_fp8
from coplan.cost.kernels import Rates, Scale, matmul_dtype, precision_notes
from coplan.cost.optimizer import accumulation_s
from coplan.cost.partcost import PartCost, rematerialised, saved_under
from coplan.cost.parts import (
    ACT,
    F32,
    FIX,
    NV,
    REPL,
    TP,
    ZERO,
    GraphProfile,
    Part,
    Vec,
    part_dtype,
    vadd,
    vdot,
)
from coplan.cost.profile import tensor_vec
from coplan.cost.remat import inductor_recomputes
from coplan.cost.results import BREAKDOWN_KEYS, Estimate, MemoryEstimate, StageEstimate
from coplan.cost.stages import (
    boundary_held,
    chunk_blocks,
    chunk_in_flight,
    devices_of_stage,
    drops_output,
    in_flight,
    peak_of,
    per_stage,
    stage_blocks,
    stage_devices,
    stage_layout,
    stage_parts,
    static_bytes,
)
from coplan.cost.zero import (
    UnitCollectives,
    fsdp_comm,
    fsdp_copies,
    fsdp_step,
    fsdp_transient,
    recompute_regathered,
    zero3_exposed,
    zero3_transient,
)
from coplan.hardware.cluster import ClusterSpec
from coplan.hardware.device import DeviceSpec
from coplan.ir.types import OpKind, Phase


def estimate(profile: GraphProfile, cluster: ClusterSpec, config: TrainingConfig) -> Estimate:
    """Price ``config`` for the profiled graph on ``cluster``.

    The graph must be the step of one microbatch (``profile.batch == config.microbatch``) at the
    configuration's sequence length; divisibility against the model is the caller's check
    (``check_against``), cluster size is checked here.
    """
    if profile.batch != config.microbatch:
        raise ValueError(f"graph built for microbatch {profile.batch}, config asks {config.microbatch}")
    if config.gpus != cluster.num_devices:
        raise ValueError(f"config uses {config.gpus} GPUs, cluster has {cluster.num_devices}")
    # ``d``: the ranks holding the same parameters, data- and context-parallel together
    t, p, d, v, m = config.tp, config.pp, config.dp_cp, config.vpp, config.num_microbatches
    ab = config.act_bytes
    scale = Scale.of(config)
    weights = scale.weights
    f32 = weights[F32 * 2 + TP] * t  # bytes of an fp32-class value (``Scale.of``)
    devices = stage_devices(cluster, config)
    layout = stage_layout(profile, config)
    layers = layout[1]
    # layers of each stage: its chunks s, s + p, ... (``stage_blocks``)
    per_stage_layers = per_stage(layers, p, v)
    net = cluster.groups[0].device.efficiency_of("network")
    per_node = cluster.groups[0].devices_per_node
    tp_group = Group.of(cluster, t, 1, net)
    dp_group = Group.of(cluster, d, t, net)
    # the context-parallel ring: neighbours ``t`` ranks apart, inside a node while t x cp fits one
    cp_cross = t * config.cp > per_node and cluster.num_nodes > 1

    def ring_transfer(bytes_: float) -> float:
        return p2p_time(cluster, bytes_, cp_cross, net)

    pp_cross = t * d >= per_node and cluster.num_nodes > 1
    # the activation a pipeline stage sends on, per microbatch (elements, before any sharding)
    boundary_elems = max((tp_.boundary for tp_ in profile.templates), default=0.0)
    stages = []
    launch_total = 0.0
    kernels_total = 0
    costs: dict[tuple[DeviceSpec, str], PartCost] = {}

    def cost_of(device: DeviceSpec, dtype: str) -> PartCost:
        """Prices for the parts that run in ``dtype`` on ``device`` (``part_dtype``)."""
        got = costs.get((device, dtype))
        if got is None:
            rates = Rates.of(device, dtype, config.attention_kernel)
            got = costs[device, dtype] = PartCost(rates, scale, config, tp_group, profile, device)
        return got

    def sum_parts(
        device: DeviceSpec, rec: Any, parts: list[tuple[Part, float]], ckpt: dict[int, int] | None = None
    ) -> _Sums:
        """One microbatch's time, kernels, parameters and memory of ``parts`` on ``device`` under
        recompute ``rec`` (``ckpt``: how many blocks of each template run under it, the others
        under none; None: all). Interior pipeline stages usually run the same parts on the same
        device: each distinct (device, recompute, parts) is priced once per estimate."""
        ck = None if ckpt is None else tuple(sorted(ckpt.items()))
        key = (device, rec, tuple((id(part), n) for part, n in parts), ck)
        got = sums.get(key)
        if got is not None:
            return got
        fwd = bwd = recompute = tp_comm = cp_comm = opt = 0.0
        kern = 0
        params = [0.0, 0.0]
        saved: Vec = (0.0,) * NV  # type: ignore[assignment]
        saved_head: Vec = (0.0,) * NV  # type: ignore[assignment]
        transient = pre_transient = 0.0
        weight_cache = 0.0
        block_local = 0.0  # this GPU's parameters in the stage's blocks
        regathered = 0.0  # of them, gathered again after a DeepSpeed recompute (``zero.py``)
        tensors = modules = 0  # parameter tensors, and the modules owning them
        for part, n in parts:
            pc = cost_of(device, part_dtype(part, config.dtype)).of(part)
            # (with the microbatch's share of the fp8 weights' casts, which no recompute re-runs)
            fwd += n * (pc.forward + pc.weight_cast)
            bwd += n * pc.backward
            opt_part = pc.optimizer
            opt += n * opt_part
            kern += int(n * pc.kernels)
            params[REPL] += n * part.params[REPL]
            params[TP] += n * part.params[TP]
            tensors += round(n) * part.param_tensors
            modules += round(n) * part.param_modules
            if part is profile.post and any(q is profile.pre for q, _ in parts):
                params[REPL] -= profile.shared_params[REPL]
                params[TP] -= profile.shared_params[TP]
                tensors -= profile.shared_tensors[0]
                modules -= profile.shared_tensors[1]
            weight_cache += n * pc.weight_cache
            is_block = bool(part.blocks)
            if is_block:
                block_local += n * (part.params[REPL] + part.params[TP] / t)
                # blocks under the stage's mode, and with ``recompute_layers`` the rest of a
                # chunk's blocks, which save what autograd saves
                got_k = n if ckpt is None else float(ckpt.get(id(part), 0))
                for mode, k in ((rec, got_k), ("none", n - got_k)):
                    if k <= 0:
                        continue
                    recompute += k * pc.recompute(part, mode)
                    if mode == "full":
                        sizes = [a + b / t for a, b in part.param_module_sizes]
                        regathered += k * recompute_regathered(sizes)
                    fwd -= k * pc.unwritten(part, mode)
                    if isinstance(mode, frozenset) and mode and drops_output(profile, part, mode):
                        # every block's input is gone: block j of a chunk re-runs the j - 1 before it
                        # first (the chunk's input is kept by the schedule), (k/v - 1)/2 on average
                        recompute += k * max(0.0, k / v - 1) / 2 * pc.forward
                    tp_comm += k * pc.tp_comm(part, mode)
                    if config.cp > 1:
                        cp_comm += k * _cp_ring(pc, part, mode, profile, ab, t, ring_transfer)
                    sv = saved_under(profile, part, mode, per_op=config.kernels != "megatron")
                    if config.kernels in ("eager", "inductor") and _is_selective_op(profile, part, mode):
                        # torchtitan's per-op policy as PyTorch keeps it (``selective_op_correction``)
                        sv = vadd(sv, _selective_op_correction(profile, part, config.kernels == "eager"))
                    if config.kernels == "inductor" and mode == "none":
                        # what Inductor's min-cut partitioner recomputes without being asked
                        sv = vadd(sv, tuple(-x for x in _inductor_recomputed(profile, part)))
                    if config.attention_unpad and config.kernels == "eager" and _keeps_attention_out(mode):
                        sv = vadd(
                            sv, _unpad_saved(profile, part)
                        )  # flash-attn's unpadded output (``eager.py``)
                    if config.kernels in ("eager", "inductor") and _keeps_repeated_kv(mode):
                        # SDPA's repeated K/V (``eager.py``): a generated graph saves the copies too, as
                        # SDPA's backward reads them ("materialized in backward" for the partitioner)
                        sv = vadd(sv, _repeat_kv_saved(profile, part))
                    if config.fused_rmsnorm:
                        sv = vadd(
                            sv, tuple(-x for x in _normed_saved(profile, part, mode))
                        )  # fused: x, rstd kept
                    if runs_fp8(config.dtype, device) and mode in ("none", "selective"):
                        sv = vadd(sv, part.fp8_saved)  # GEMM inputs kept in fp8 (``fp8.py``)
                    saved = vadd(saved, tuple(x * k for x in sv))
                    if not config.flash_attention and mode not in ("full", "selective"):
                        # unfused attention keeps the softmax probabilities (batch x heads x s x s)
                        # instead of the fused kernel's output and logsumexp (full and selective
                        # recompute keep neither); with dropout on them also the dropped copy (AV's
                        # input) and the one-byte mask: Korthikanti et al. 2022 (arXiv 2205.05198,
                        # Sec. 4.1) count 2 + 2 + 1 = 5 bytes per score element in 16 bits
                        probs = (part.scores + part.scores_dropout) * k
                        masks = part.scores_dropout * k
                        add = {ACT * 2 + TP: probs, FIX * 2 + TP: masks}
                        if config.kernels == "eager" and config.mixed:
                            # eager PyTorch under autocast: the fp32 softmax keeps its own output for
                            # its gradient beside the 16-bit copy the second GEMM keeps
                            # (``kernels.eager_scores``)
                            add[F32 * 2 + TP] = part.scores * k
                        saved = tuple(saved[i] - k * part.flash_saved[i] + add.get(i, 0.0) for i in range(NV))  # type: ignore[assignment]
                    tr = pc.transient(part)
                    if mode == "full":
                        tr += vdot(part.saved["none"], weights)  # the block's recomputed activations
                    elif isinstance(mode, frozenset) and mode:
                        # what the block's backward re-materialises: the dropped tensors, less those
                        # recomputed inside the backward kernel reading them (never stored)
                        tr += vdot(rematerialised(profile, part, mode, config.recompute_fused), weights)
                    transient = max(transient, tr)
            else:
                tp_comm += n * pc.tp_comm(part, "none")
                saved_head = vadd(saved_head, pc.saved)
                if part is profile.pre:
                    pre_transient = max(pre_transient, pc.transient(part))
                else:
                    transient = max(transient, pc.transient(part))
        got = sums[key] = _Sums(
            fwd=fwd, bwd=bwd, recompute=recompute, tp_comm=tp_comm, cp_comm=cp_comm, opt=opt, kern=kern,
            params=params, saved=saved, saved_head=saved_head, transient=transient,
            pre_transient=pre_transient, weight_cache=weight_cache, block_local=block_local,
            tensors=tensors, modules=modules, regathered=regathered,
        )  # fmt: skip
        return got

    sums: dict[Any, _Sums] = {}
    dp_memo: dict[Any, tuple[float, float]] = {}
    for s in range(p):
        device = devices[s]
        cost = cost_of(device, config.dtype)
        rates = cost.r
        rec = config.recompute_of(s)
        # this stage's layers (all chunks of the stage), and its parts by template
        mine = stage_blocks(profile, config, s, layout)
        parts = stage_parts(profile, config, s, mine)
        chunks = [mine]
        ckpt: dict[int, int] | None = None
        if rec == "full" and config.recompute_layers is not None:
            # the first ``recompute_layers`` blocks of each chunk recompute (``TrainingConfig``)
            chunks = chunk_blocks(profile, config, s, layout)
            ckpt = {}
            for blocks in chunks:
                for part in blocks[: config.recompute_layers]:
                    ckpt[id(part)] = ckpt.get(id(part), 0) + 1
        ps = sum_parts(device, rec, parts, ckpt)
        fwd, bwd, recompute, opt, kern = ps.fwd, ps.bwd, ps.recompute, ps.opt, ps.kern
        tp_comm, cp_comm, params = ps.tp_comm, ps.cp_comm, ps.params
        saved, saved_head = ps.saved, ps.saved_head
        weight_cache, block_local = ps.weight_cache, ps.block_local
        # the embedding's working set comes before a microbatch's blocks run forward and after
        # their backward: that microbatch's block activations are not held beside it
        transient = max(ps.transient, ps.pre_transient - vdot(saved, weights) / v)
        # gradients accumulated over microbatches outside the GEMMs, where no ZeRO stage shards
        # them between microbatches (``TrainingConfig.grad_accumulation``): one memory-bound pass
        # over this GPU's parameters after each backward, averaged over the microbatches
        if config.zero <= 1 or config.fsdp_per_step:
            bwd += accumulation_s(
                "fsdp-unsharded" if config.fsdp_per_step else config.grad_accumulation,
                params[REPL] + params[TP] / t,
                m,
                device.memory_bandwidth * device.efficiency_of("memory"),
            )
        # pipeline sends: the block output, forward and backward, once per chunk boundary
        pp_comm = 0.0
        if p > 1:
            # Megatron's scatter-gather (Narayanan et al. 2021, arXiv 2104.04473, Sec. 4.1): each
            # TP rank sends 1/t of the replicated activation and the receivers all-gather it over
            # NVLink; DeepSpeed's engine sends it whole from every rank, the causal mask beside it
            split = t > 1 and not config.sequence_parallel and config.pp_send == "scatter-gather"
            boundary = boundary_elems * ab / (t if t > 1 and (split or config.sequence_parallel) else 1)
            forward_sends = 0 if s == p - 1 and v == 1 else 1
            sends = forward_sends + (0 if s == 0 and v == 1 else 1)
            one = p2p_time(cluster, boundary, pp_cross, net)
            one += tp_group.all_gather(boundary * t) if split else 0.0
            if v > 1 and config.overlap_p2p:
                # the interleaved schedule overlaps sends with the next chunk's compute (Megatron-Core
                # overlaps p2p communication whenever vpp > 1): only what compute cannot cover shows
                chunk = (fwd + bwd) / v
                pp_comm = v * sends * max(one - chunk / 2, cluster_latency(cluster, pp_cross))
            else:  # 1F1B's sends, and interleaved ones without overlap, block the stage
                pp_comm = v * sends * one
            if config.pp_send == "whole":  # the causal mask rides with each forward activation
                pp_comm += v * forward_sends * p2p_time(cluster, 2.0 * profile.seq**2, pp_cross, net)
        # ZeRO-3: gather parameters for forward and backward, reduce-scatter gradients, each
        # microbatch; prefetching hides what compute can cover
        p_local = params[REPL] + params[TP] / t
        zero_comm = 0.0
        # (first forward's wait for gathers, gradient reduction) once a step, where FSDP's units
        # stay gathered through the pipeline step
        per_step: tuple[float, float] | None = None
        param_bytes = float(ab)  # parameters travel in the kernels' precision
        if config.fp8_params and p_local:
            # fp8 primary weights: the block GEMMs' weights (half the cache's bytes) travel in fp8
            param_bytes -= (ab - 1) * (weight_cache / 2) / p_local
        # gradients are reduced in fp32 under mixed precision, or in 16 bits where the stack does
        grad_bytes = float(f32 if config.grad_reduce_fp32 else ab)
        if config.gathers_per_unit:
            # per-unit gathers and reduce-scatters, prefetched behind compute (``zero.py``); the
            # units are the stage's layers (the embedding and head ride with the first and last).
            # Only ZeRO-3 gathers again for backward (FSDP2 keeps the unit gathered otherwise)
            units = max(1, per_stage_layers[s])
            # a tensor list's gathers each wait for the device first (``zero.py``): nothing hides
            overlaps = config.overlap_zero and config.zero3_gather != "tensor-list"
            hide = fwd + bwd + recompute if overlaps else 0.0
            gathers = 2 if config.zero == 3 else 1
            again = 0.0
            if config.zero == 3 and config.zero3_gather != "unit" and p_local > 0:
                # DeepSpeed's module hooks gather a checkpointed block's modules for its recompute
                # and, where the block is large, again for its backward (``zero.recompute_regathered``)
                again = ps.regathered / p_local
            # collectives per microbatch of each kind: a layer's, a module's or a tensor's
            # parameters each (``zero.py``; FSDP's are its units)
            calls = {"unit": units, "module": ps.modules, "tensor-list": ps.tensors}
            pieces = max(units, calls[config.zero3_gather])
            # FSDP's root unit: every parameter no block owns (embedding, final norm, head)
            root = p_local - block_local
            if config.fsdp_units:
                coll = UnitCollectives.of(
                    cluster, config, net, device, block_local, root, units, param_bytes, grad_bytes
                )
            if config.fsdp_per_step:
                # the units stay gathered through the pipeline step (``TrainingConfig.fsdp_pipeline``):
                # nothing per microbatch; the first forward's gathers and the reduction after the
                # last backward are the step's (below)
                per_step = fsdp_step(coll, units, fwd if overlaps else 0.0)
            elif config.fsdp_units and config.overlap_zero:
                zero_comm = fsdp_comm(coll, units, fwd, bwd + recompute, gathers)
            else:
                share = sm_share(dp_group, device, config.nccl_ub) if overlaps else 0.0
                # a tensor list: each rank's piece copied in or out by a launch of its own
                lists = config.zero3_gather == "tensor-list"
                copy_s = dp_group.size * device.kernel_launch_s if lists else 0.0
                hbm = device.memory_bandwidth * device.efficiency_of("memory") if lists else 0.0
                zero_comm = zero3_exposed(
                    dp_group,
                    p_local,
                    pieces,
                    param_bytes,
                    grad_bytes,
                    hide,
                    gathers + again,
                    share,
                    copy_s,
                    hbm,
                )
            if config.gather_copies and config.fsdp_units:
                # FSDP2 copies each gathered unit out of, and its gradients into, the collectives'
                # buffers on the compute stream (``zero.fsdp_copies``): each microbatch, or once a
                # step from the accumulated gradients where the units stay gathered
                hbm_rate = device.memory_bandwidth * device.efficiency_of("memory")
                copies = fsdp_copies(
                    block_local, root, units, 1 if per_step else gathers, param_bytes,
                    grad_bytes if per_step else float(ab), grad_bytes, hbm_rate, device.kernel_launch_s,
                )  # fmt: skip
                if per_step:
                    per_step = (per_step[0], per_step[1] + copies)
                else:
                    zero_comm += copies
            if per_step:
                # what is gathered stays (counted with the parameters, below): beyond it, one
                # unit's gradient in the parameter dtype before it is cast and accumulated
                transient += block_local / units * param_bytes
            elif config.fsdp_units:
                # FSDP's units: one per block and the root (embedding, final norm, head), which
                # stays gathered from the start of forward to the end of backward
                # FSDP1's flat parameters (no copies around its collectives) free late (``zero.py``)
                flat = not config.gather_copies
                transient += fsdp_transient(block_local, root, units, param_bytes, grad_bytes, flat)
            else:
                # the pieces gathered at once: a layer, or (on average) a module or a tensor
                transient += zero3_transient(p_local, pieces, param_bytes, grad_bytes)
        # data-parallel gradient reduction, once per step, bucket by bucket (``buckets.py``)
        dp_comm = param_gather = 0.0
        if d > 1 and not config.gathers_per_unit:
            # chunk 0 holds its share of the stage's layers, and the embedding on stage 0 (the
            # head sits in the last chunk of the last stage); the other chunks share the rest
            layer_params = block_local / max(1, per_stage_layers[s])
            extra = p_local - block_local
            first_layers = float(layers[s])
            first_extra = extra if s == 0 or v == 1 else 0.0
            other = (
                ((per_stage_layers[s] - first_layers) / (v - 1), (extra - first_extra) / (v - 1))
                if v > 1
                else (0.0, 0.0)
            )
            back = (bwd + recompute) / v
            ahead = fwd / v
            key = (s == 0, first_layers, first_extra, other, layer_params, back, ahead, device)
            got = dp_memo.get(key)
            if got is None:
                got = dp_memo[key] = _dp_exposure(
                    config, dp_group, device, s, (first_layers, first_extra), other, layer_params,
                    back, ahead, grad_bytes, param_bytes,
                )  # fmt: skip
            per_mb, param_gather = got
            # stage s ends its backward s chunk-backwards before stage 0 does, and starts its
            # first forward s chunk-forwards later, which its collectives may use
            dp_comm = max(0.0, per_mb - s * back) if config.overlap_grad_reduce else per_mb
            if config.zero == 2 and m > 1:
                # ZeRO-2 keeps only this rank's shard of the gradients (its memory is priced so),
                # so it cannot accumulate whole gradients over microbatches: every microbatch's
                # backward reduce-scatters its buckets (DeepSpeed deepspeed/runtime/zero/
                # stage_1_and_2.py reduces the ipg buckets in every backward and waits for them at
                # its end; Megatron-FSDP's optim_grads likewise), where ZeRO-1 and Megatron's
                # distributed optimizer reduce once per step. The last microbatch's reduction is
                # the tail above; the other m - 1 each show what their own backward cannot hide,
                # spread over the m microbatches the pipeline times
                zero_comm += per_mb * (m - 1) / m
            if config.zero >= 1 and config.overlap_param_gather:
                param_gather = max(0.0, param_gather - s * ahead)
        if per_step:
            first, reduce = per_step
            # a stage's first forward waits for its gathers on the pipeline's fill, which passes
            # through every stage's first forward once; the reduction runs after a chunk's last
            # backward with the compute stream waiting on it: chunk 0's, the rank's last, hides in
            # the s chunk-backwards by which stage s ends earlier, the other chunks' block the rank
            # (``TrainingConfig.fsdp_pipeline``; ``zero.pipelined_fsdp``)
            param_gather = p * first
            back = (bwd + recompute) / v
            dp_comm = reduce * (v - 1) / v + max(0.0, reduce / v - s * back)
        opt_div = config.shard_ranks if config.zero >= 1 else 1
        opt /= opt_div
        # memory
        held = in_flight(s, p, v, m)
        # ``saved`` covers all v chunks of the stage; with v > 1 in-flight counts chunk-microbatches
        act_stored = vdot(saved, weights) * held / v
        # the embedding lives in chunk 0 of stage 0, the head in the last chunk of the last stage:
        # each holds only the microbatches of its own chunk in flight
        head_chunk = 0 if s == 0 else v - 1
        act_stored += vdot(saved_head, weights) * chunk_in_flight(s, p, v, m, head_chunk)
        saves_last = None
        if rec == "full" and mine:
            # Megatron's full recompute keeps each layer's input and, outside the checkpoints,
            # the final norm's input. The blocks count their inputs, so the embedding output
            # (block 0's input, also saved by the embedding side) is counted once, and the last
            # block's output (read by the final norm) is added on the last stage
            inp = vdot(mine[0].saved["full"], weights)
            if ckpt is not None:
                # a block saving what autograd saves counts what it makes (its output too) and
                # not its input: where a chunk's recomputed blocks end, the last one's output is
                # counted by neither, so it is added once per chunk
                saves_last = [len(b) > config.recompute_layers for b in chunks]  # type: ignore[operator]
                for c, last in enumerate(saves_last):
                    if last and config.recompute_layers:
                        act_stored += inp * chunk_in_flight(s, p, v, m, c)
            if s == 0:
                act_stored -= inp * chunk_in_flight(s, p, v, m, 0)
            if s == p - 1 and not (saves_last and saves_last[-1]):
                act_stored += inp * chunk_in_flight(s, p, v, m, v - 1)
        if p > 1:
            act_stored += boundary_held(
                profile, mine, rec, config, s, p, v, m, ab, t, boundary_elems, saves_last
            )
        static = static_bytes(p_local, config, config.shard_ranks)
        if per_step:
            # the stage's parameters gathered in their dtype, and its gradients accumulated
            # unsharded in the reduce dtype, from the first microbatch to the reduction
            static = (static[0] + p_local * param_bytes, static[1] + p_local * grad_bytes, static[2])
        if not config.gathers_per_unit and not config.fp8_params:
            # TE's fp8 weight copies, kept through the step beside the 16-bit weights (under ZeRO-3 a
            # layer's gathered weights, and their casts, are transient instead; with fp8 primary
            # weights the fp8 copy and its transpose replace the 16-bit weight)
            static = (static[0] + weight_cache, static[1], static[2])
        capacity = float(min(dev.memory_bytes for dev in devices_of_stage(cluster, config, s)))
        peak, peak_grads = peak_of(static, act_stored, transient, config, p_local, per_step is not None)
        mem = MemoryEstimate(
            params_bytes=static[0],
            grads_bytes=static[1],
            optimizer_bytes=static[2],
            activations_bytes=act_stored,
            transient_bytes=transient,
            peak_bytes=peak,
            capacity_bytes=capacity,
            stage=s,
            peak_grads_bytes=peak_grads,
        )
        launch_total += m * kern * rates.launch_s
        kernels_total += m * kern
        stages.append(
            StageEstimate(
                index=s,
                layers=per_stage_layers[s],
                device=device.name,
                forward_s=fwd,
                backward_s=bwd,
                recompute_s=recompute,
                tp_comm_s=tp_comm,
                cp_comm_s=cp_comm,
                pp_comm_s=pp_comm,
                zero_comm_s=zero_comm,
                dp_comm_s=dp_comm,
                param_gather_s=param_gather,
                optimizer_s=opt,
                in_flight=held,
                kernels=kern,
                memory=mem,
            )
        )
    times = [st.microbatch_s for st in stages]
    slow = max(range(p), key=lambda i: times[i])
    pipeline = m * times[slow] + (p - 1) / v * (sum(times) / p)
    tail_stage = max(range(p), key=lambda i: stages[i].tail_s)
    step = pipeline + stages[tail_stage].tail_s
    k, tl = stages[slow], stages[tail_stage]
    breakdown = {
        "compute": m * (k.forward_s + k.backward_s),
        "recompute": m * k.recompute_s,
        "tp_comm": m * k.tp_comm_s,
        "cp_comm": m * k.cp_comm_s,
        "pp_comm": m * k.pp_comm_s,
        "pipeline_bubble": pipeline - m * times[slow],
        "dp_comm": tl.dp_comm_s,
        "zero_comm": m * k.zero_comm_s + tl.param_gather_s,
        "optimizer": tl.optimizer_s,
    }
    # a context-parallel rank's graph holds 1/cp of each sequence (its attention every key)
    seq = profile.seq * config.cp
    tokens = config.global_batch * seq
    model_flops = profile.model_flops * config.cp * config.global_batch / profile.batch
    per_gpu = model_flops / step / config.gpus
    # MFU against the 16-bit dense peak, and beside it against the peak of the precision each device
    # really runs (fp8 on an A100: bf16's); the slowest device's, which sets the pace of a mixed one
    peak16, dtype16 = _lowest_peak(cluster, "bf16")
    peak, dtype_run = _lowest_peak(cluster, config.dtype)
    loaded = max(stages, key=lambda st: st.memory.peak_bytes / st.memory.capacity_bytes)
    return Estimate(
        step_time_s=step,
        tokens_per_s=tokens / step,
        model_tflops_per_gpu=per_gpu / 1e12,
        mfu=per_gpu / peak16,
        mfu_dtype_peak=per_gpu / peak,
        memory=loaded.memory,
        breakdown_s=breakdown,
        stages=tuple(stages),
        config=config,
        cluster=cluster.name,
        gpus=config.gpus,
        peak_flops=peak,
        peak_flops_16bit=peak16,
        peak_dtype=dtype_run,
        peak_dtype_16bit=dtype16,
        launch_overhead_s=launch_total / p,
        kernels_per_step=kernels_total,
        notes=precision_notes(cluster.devices, config.dtype, config.fp8_params),
    )


def _lowest_peak(cluster: ClusterSpec, dtype: str) -> tuple[float, str]:
    """The lowest dense matrix peak among ``cluster``'s devices for ``dtype`` as each runs it
    (``matmul_dtype``: bf16 on a device without bf16 is fp16), and that precision."""
    runs = [matmul_dtype(dev, dtype) for dev in cluster.devices]
    return min((dev.peak(d), d) for dev, d in zip(cluster.devices, runs, strict=True))


def cluster_latency(cluster: ClusterSpec, cross_node: bool) -> float:
    lvl = (
        cluster.inter_node if cross_node and cluster.inter_node is not None else cluster.groups[0].intra_node
    )
    return lvl.latency_s


__all__ = ["BREAKDOWN_KEYS", "Estimate", "MemoryEstimate", "StageEstimate", "estimate"]


def _dp_exposure(
    config: TrainingConfig,
    dp_group: Group,
    device: DeviceSpec,
    stage: int,
    first: tuple[float, float],
    other: tuple[float, float],
    layer_params: float,
    back: float,
    ahead: float,
    grad_bytes: float,
    param_bytes: float,
) -> tuple[float, float]:
    """A stage's data-parallel gradient reduction and parameter gather per microbatch, as stage 0
    would see them: (what the last microbatch's backward leaves exposed of the reduction, or all of
    it without overlap; what the first forward waits for of the gather, 0 without ZeRO). Stage
    ``s`` subtracts the ``s`` chunk-steps it ends earlier or starts later."""
    p, v = config.pp, config.vpp
    bk = StageBuckets.of(
        stage,
        v,
        first,
        other,
        layer_params,
        config.bucket_params,
        config.dp_bucket_scope,
        config.overlap_grad_reduce,
    )
    reduce = dp_group.all_reduce if config.zero == 0 else dp_group.reduce_scatter
    # chunk 0's buckets under its last microbatch's backward, the other chunks' reductions
    # ahead of them, chunk k's k p chunk-backwards before the end (the interleaved cooldown)
    share = sm_share(dp_group, device, config.nccl_ub)
    if config.overlap_grad_reduce:
        per_mb = queued_exposure(bk, reduce, grad_bytes, back, p * back)
        # the hidden reductions slow the backward they run beside (``contention.py``)
        per_mb += slowdown(back, serial_time(bk, reduce, grad_bytes) - per_mb, share)
    else:
        per_mb = serial_time(bk, reduce, grad_bytes)
    param_gather = 0.0
    if config.zero >= 1:
        gather = dp_group.all_gather
        if config.overlap_param_gather:
            # the mirror image: chunk 0's first forward needs its buckets one by one, chunk k's
            # first forward starts k p chunk-forwards later
            param_gather = queued_exposure(bk, gather, param_bytes, ahead, p * ahead)
            hidden = serial_time(bk, gather, param_bytes) - param_gather
            param_gather += slowdown(ahead, hidden, share)
        else:
            param_gather = serial_time(bk, gather, param_bytes)
    return per_mb, param_gather


def _keeps_attention_out(mode: str | frozenset[str]) -> bool:
    """Whether a block under recompute ``mode`` keeps attention's output for backward."""
    if isinstance(mode, str):
        return mode not in ("full", "selective")
    return not any(name.endswith(".attn.out") for name in mode)


def _unpad_saved(profile: GraphProfile, part: Part) -> Vec:
    return part.memo("unpad_saved", lambda: unpad_saved(profile.graph, part.op_ids))


def _keeps_repeated_kv(mode: str | frozenset[str]) -> bool:
    """Whether a block under recompute ``mode`` keeps attention's inputs for backward: not under
    full recompute, nor where the set recomputes the rotated keys (and so their repeats)."""
    if isinstance(mode, str):
        return mode != "full"
    return not any(name.endswith(".attn.k") for name in mode)


class _Sums(NamedTuple):
    """One microbatch of a pipeline stage's parts on one device (``estimate``'s ``sum_parts``):
    seconds forward, backward, recomputing, in TP and CP collectives and in the optimizer; kernels
    launched; parameters (replicated, TP-sharded); saved activations of the blocks and of the parts
    outside them; the largest transient working set, the embedding's apart; fp8 weight-cache bytes;
    this GPU's block parameters; the parameter tensors and the modules owning them; the block
    parameter elements DeepSpeed gathers a third time after a recompute
    (``zero.recompute_regathered``)."""

    fwd: float
    bwd: float
    recompute: float
    tp_comm: float
    cp_comm: float
    opt: float
    kern: int
    params: list[float]
    saved: Vec
    saved_head: Vec
    transient: float
    pre_transient: float
    weight_cache: float
    block_local: float
    tensors: int
    modules: int
    regathered: float


def _cp_ring(
    pc: Any,
    part: Part,
    mode: str | frozenset[str],
    profile: GraphProfile,
    act_bytes: float,
    tp: int,
    transfer: Callable[[float], float],
) -> float:
    """Seconds a block's context-parallel ring adds to one microbatch (``coplan.cost.context``):
    forward passes this tensor-parallel rank's keys and values (its share of the key/value heads,
    one head where there are fewer heads than ranks), backward the keys, values and their
    gradients, and a recompute mode that re-runs attention (full, selective, or a set naming its
    output) passes them again."""
    c = pc.cost.c
    cp = c.cp
    fwd_s, bwd_s = pc.attention_s(part)
    g = profile.graph
    # each forward attention: (key plus value elements, key/value heads, output elements)
    got = part.memo(
        "cp_qkv",
        lambda: tuple(
            (*kv_elements(g, op), float(g.tensors[op.outputs[0]].numel))
            for i in part.op_ids
            if (op := g.ops[i]).kind is OpKind.ATTENTION and op.phase is Phase.FORWARD
        ),
    )
    kv_local = sum(n / min(tp, heads) for n, heads, _ in got)
    chunk = kv_local * act_bytes
    again = mode in ("full", "selective") or (
        isinstance(mode, frozenset) and any(n.endswith(".attn.out") for n in mode)
    )
    if c.cp_exchange == "allgather":
        # PyTorch's context_parallel (``TrainingConfig.cp_exchange``, ``context.torch_ring``)
        q_local = sum(q for _, _, q in got) / tp
        if c.kernels in ("eager", "inductor"):
            # the ring exchanges what SDPA reads, and these stacks repeat the key/value heads
            # before it (torchtitan's ``repeat_kv``, ``eager.repeat_kv_saved``): every query
            # head's keys and values travel and are merged, not the key/value heads'
            kv_local = max(kv_local, 2.0 * q_local)
            chunk = kv_local * act_bytes
        bw = pc.cost.r.bandwidth
        forward, backward = torch_ring(
            (fwd_s, bwd_s), transfer, chunk, act_bytes, q_local, kv_local, bw, cp, c.kernels == "inductor"
        )
        return forward * (2 if again else 1) + backward
    forward = ring_exposed(fwd_s, transfer(chunk), cp)
    return forward * (2 if again else 1) + ring_exposed(bwd_s, transfer(2 * chunk), cp)


def _normed_saved(profile: GraphProfile, part: Part, mode: str | frozenset[str]) -> Vec:
    """What a Python RMSNorm keeps for backward and a fused one does not
    (``TrainingConfig.fused_rmsnorm``): its normalized tensor ``x * rstd``, where ``mode`` keeps it
    (full recompute keeps none; a recompute set naming it has dropped it already)."""
    if mode == "full":
        return ZERO
    g = profile.graph
    items = part.memo(
        "normed_saved",
        lambda: tuple(
            (name, vec)
            for tid, name, vec in part.saved_items
            if (op := g.tensors[tid].producer) is not None
            and g.ops[op].target == "rms_norm"
            and g.ops[op].outputs.index(tid) == 1
        ),
    )
    out = ZERO
    for name, vec in items:
        if not (isinstance(mode, frozenset) and name in mode):
            out = vadd(out, vec)
    return out


def _block_of(profile: GraphProfile, part: Part) -> int | None:
    return next((b for i in part.op_ids if (b := profile.graph.ops[i].block) is not None), None)


def _is_selective_op(profile: GraphProfile, part: Part, mode: str | frozenset[str]) -> bool:
    """Whether ``mode`` is torchtitan's per-op policy's set for ``part``'s block."""
    if not isinstance(mode, frozenset) or not mode:
        return False

    def names() -> frozenset[str]:
        block = _block_of(profile, part)
        return selective_op_names(profile.graph, block) if block is not None else frozenset()

    return bool(mode == part.memo("selective_op", names))


def _selective_op_correction(profile: GraphProfile, part: Part, eager: bool) -> Vec:
    def correction() -> Vec:
        block = _block_of(profile, part)
        if block is None:
            return ZERO
        return selective_op_correction(profile.graph, block, tensor_vec(profile.graph), eager)

    return part.memo(("selective_op_correction", eager), correction)


def _inductor_recomputed(profile: GraphProfile, part: Part) -> Vec:
    return part.memo("inductor_recomputed", lambda: inductor_recomputes(profile.graph, part)[1])


def _repeat_kv_saved(profile: GraphProfile, part: Part) -> Vec:
    return part.memo("repeat_kv_saved", lambda: repeat_kv_saved(profile.graph, part.op_ids))
