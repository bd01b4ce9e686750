"""Train N steps under a plan and measure them next to the cost model's prediction.

One ``Job`` (plain, picklable data) runs in every process (``run_rank``). Each step is
``global_batch / (dp * microbatch)`` microbatches of forward and backward (gradients accumulated;
DDP reduces on the last one), an optimizer step (AdamW, fp32 state), and for fp16 dynamic loss
scaling. What is measured, and how:

- ``saved_activation_bytes``: the storages autograd saved for backward in the forward of the first
  microbatch of the first step (``saved_tensors_hooks``, each storage once: compiled regions and
  any part that ran eagerly), activations only (parameters, the 16-bit copies the compiled
  forward reported and the batch excluded, as the cost model counts them elsewhere), on the most
  loaded rank;
- ``grad_check``: the gradients of the first step (initial weights, first batch, before any
  update) against an eager fp32 reference of the same model on the same global batch, as the
  largest relative error ``||g - g_ref|| / ||g_ref||`` over parameters;
- ``peak_bytes``: the largest live memory of a training step: CUDA's allocator peak, or on a CPU
  every tensor storage alive (``measure.LiveBytes``) over the second step;
- ``step_time_s``: the median wall time of the steps after those two (the first compiles, the
  second runs under the tracker), the slowest rank's per step.
"""

from __future__ import annotations

import copy
import json
import math
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from coplan.apply.dist import Rank, apply_dp, apply_tp, init, mesh
from coplan.apply.fusion import optimizer_record
from coplan.apply.measure import SavedBytes
from coplan.apply.precision import LossScaler, compute_dtype, model_dtype
from coplan.apply.step import (
    Job,
    RankResult,
    adamw_form,
    all_max,
    all_mean,
    autocast_for,
    batches,
    build,
    compile_for,
    head_pad,
    peak_tracker,
    reference_chunk,
    reference_grads,
    rel_errors,
    sync,
)
from coplan.errors import CoplanError
from coplan.hardware.allocator import pin_host_allocator
from coplan.plan.types import Plan, PlanError


def run_rank(rank: int, world: int, job: Job) -> RankResult | None:
    """Train ``job`` as process ``rank`` of ``world``; the main rank returns (and, for spawned
    runs, writes) the result, the others None. A ``CoplanError`` is written as ``{"error": ...}``."""
    pinned = None
    if job.device == "cpu" and job.host_allocator == "pinned":
        pinned = pin_host_allocator()  # before the model exists, so every step sees the same heap
    try:
        if job.activation_budget is None:
            res = _run(rank, world, job)
        else:
            from torch._functorch import config as functorch_config

            with functorch_config.patch(activation_memory_budget=job.activation_budget):
                res = _run(rank, world, job)
    except CoplanError as e:
        if job.result and rank == 0:
            Path(job.result).write_text(json.dumps({"error": str(e), "exit_code": e.exit_code}))
        raise
    if res is not None and pinned is not None:
        res.notes.append(pinned)
    if res is not None and job.result:
        Path(job.result).write_text(json.dumps(res.to_dict()))
    return res


def _run(rank: int, world: int, job: Job) -> RankResult | None:
    plan = Plan.from_dict(job.plan)
    par = plan.parallel
    if par.pp > 1:
        from coplan.apply.pipeline import run_pipeline

        return run_pipeline(rank, world, job)
    if job.threads:
        torch.set_num_threads(job.threads)
    r: Rank = init(rank, world, job.device, par)
    spec = job.spec
    micro = par.microbatch
    per_rank = job.global_batch // par.dp
    if job.global_batch % (par.dp * micro):
        raise PlanError(
            "parallel.microbatch",
            f"global batch {job.global_batch} is not a multiple of dp x microbatch = {par.dp} x {micro}",
        )
    n_micro = per_rank // micro
    data = batches(spec, job.global_batch, job.seq, job.steps, job.seed)

    base = build(spec, job.seed, head_pad(job, r.device, par.tp))
    reference = copy.deepcopy(base)  # fp32 eager, unparallelized
    # baselines keep fp32 weights and run 16-bit plans under autocast
    base = base.to(model_dtype(plan.precision) if job.mode == "plan" else torch.float32).to(r.device)
    perms: dict[str, torch.Tensor] = {}
    dev_mesh: Any = mesh(r, par) if world > 1 else None
    if par.tp > 1:
        perms = apply_tp(base, dev_mesh["tp"], par.tp)
    wrapped: torch.nn.Module = base
    if par.dp > 1:
        wrapped = apply_dp(base, dev_mesh["dp"], par, compute_dtype(plan.precision))
    compiled, be = compile_for(wrapped, plan, spec, job.mode)
    amp = autocast_for(plan, r.device, be)
    params = [p for p in base.parameters()]
    # a plan fusing optimizer ops gets the fused AdamW kernel (one launch updates every tensor)
    fused_opt = be is not None and optimizer_record(plan, be.ir, True) is not None
    opt = torch.optim.AdamW(
        params, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, **adamw_form(job.mode, fused_opt)
    )
    scaler = LossScaler(plan.precision.loss_scaling)
    ddp_sync = getattr(wrapped, "no_sync", None)

    def step(i: int, first: bool) -> tuple[float, float, bool]:
        idx, tgt = data[i]
        lo = r.dp_rank * per_rank
        total = 0.0
        for m in range(n_micro):
            a, b = lo + m * micro, lo + (m + 1) * micro
            x, y = idx[a:b].to(r.device), tgt[a:b].to(r.device)
            if first and m == 0 and be is not None:
                be.reset_saved()
            last = m == n_micro - 1
            ctx = ddp_sync() if ddp_sync is not None and not last else nullcontext()
            with ctx:
                if first and m == 0:
                    with SavedBytes(exclude=(x, y)) as sb, amp():
                        loss = compiled(x, y)
                    if be is not None:
                        saved.update(be.last_saved)
                        saved["compiled_activation"] = saved.pop("activation")
                    other = be.other_storages if be is not None else set()
                    saved["activation"] = sb.activation_bytes(other)
                    by_shape[:] = sb.by_shape(other)
                else:
                    with amp():
                        loss = compiled(x, y)
                scaler.scaled(loss / n_micro).backward()
            total += float(loss.detach()) / n_micro
        ok = scaler.unscale(params)
        err = math.nan
        if first:
            chunk = reference_chunk(micro, job.seq, r.device)
            try:
                ref = reference_grads(reference, data[0][0], data[0][1], r.device, chunk)
            except torch.cuda.OutOfMemoryError as e:  # say it is the check, not the plan, that ran out
                raise torch.cuda.OutOfMemoryError(
                    f"the fp32 reference for the gradient check ({chunk} sequences at a time): {e}"
                ) from None
            err_name = rel_errors(base, ref, perms)
            err = err_name[0]
            worst.append(err_name[1])
        if ok:
            opt.step()
        opt.zero_grad(set_to_none=True)
        return total, err, ok

    saved: dict[str, int] = {}
    by_shape: list[dict[str, Any]] = []
    worst: list[str] = []
    losses: list[float] = []
    times: list[float] = []
    peak = 0.0
    max_err = math.nan
    for i in range(job.steps):
        sync(r.device)
        t0 = time.perf_counter()
        if i == 1:
            with peak_tracker(r.device, base, opt) as got:
                loss, err, _ = step(i, False)
            peak = got[0]
        else:
            loss, err, _ = step(i, i == 0)
        sync(r.device)
        times.append(time.perf_counter() - t0)
        losses.append(loss)
        if i == 0:
            max_err = err
    if job.steps == 1:
        # no second step to track: the memory of a step past compilation is unknown
        peak = math.nan
    times = all_max(times, world)
    losses = all_mean(losses, world)
    figures = all_max([float(saved.get("activation", 0)), peak, max_err], world)
    timed = list(range(2, job.steps)) or list(range(1, job.steps)) or [0]
    notes = []
    if job.steps < 3:
        notes.append(
            f"{job.steps} step(s): the timed step{'s' if len(timed) > 1 else ''} {timed} "
            "include compilation or memory tracking; run at least 3 steps for a clean time"
        )
    if scaler.skipped:
        notes.append(f"loss scaling skipped {scaler.skipped} step(s) with non-finite gradients")
    fusion = list(be.report.fusion) if be is not None else []
    opt_record = optimizer_record(plan, be.ir, fused_opt) if be is not None else None
    if opt_record is not None:
        fusion.append(opt_record)
    if rank != 0:
        return None
    cuts = be.report.cuts if be is not None else []
    return RankResult(
        loss=losses,
        step_times_s=times,
        timed_steps=timed,
        saved={
            "activation": int(figures[0]),
            "compiled_activation": saved.get("compiled_activation", 0),
            "param": saved.get("param", 0),
            "input": saved.get("input", 0),
        },
        peak_bytes=figures[1],
        max_rel_err=figures[2],
        worst_param=worst[0] if worst else "",
        regions=be.report.regions if be is not None else 0,
        recomputed=sorted({n for c in cuts for n in c.recomputed}),
        missing=list(be.report.missing) if be is not None else [],
        fusion=fusion,
        skipped_steps=scaler.skipped,
        notes=notes,
        saved_by_shape=by_shape,
    )
