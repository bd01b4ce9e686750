"""One run of a plan, end to end: validate, predict, train (in this process or ``nproc`` spawned
ones), and put measured and predicted side by side (the object ``coplan run --json`` prints)."""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from coplan.apply.dist import from_torchrun, launch
from coplan.apply.fusion import as_run, honoured_total, not_honoured, optimizer_record
from coplan.apply.predict import (
    Prediction,
    baseline_plan,
    make_context,
    mode_stack,
    predict,
    refuse,
    run_cluster,
)
from coplan.apply.step import MODES, Job, RankResult, pads_head, step_time, tolerance_of
from coplan.apply.train import run_rank
from coplan.errors import CoplanError, SpecError
from coplan.hardware.allocator import HOST_ALLOCATORS
from coplan.hardware.cluster import ClusterSpec
from coplan.models.spec import ModelSpec
from coplan.plan.context import PlanContext
from coplan.plan.types import Plan, PlanError


class RunError(CoplanError):
    """A run that failed in a worker process for a reason the user can act on."""


class RunFailed(CoplanError):
    """A run that trained to the end but whose numbers say it went wrong (``failure``): reported
    after the run's output, with exit code 1 (a failed run, not bad input)."""

    exit_code = 1


def failure(out: Mapping[str, Any]) -> str | None:
    """What went wrong in a finished run's report (``run_plan``'s object), in one line, or None:
    a loss that is not a finite number at some step, or gradients that the eager fp32 check does not
    match within its tolerance. A script must not take such a run for a good one (exit code 0)."""
    problems = []
    losses = list(out.get("loss") or [])
    bad = [i for i, v in enumerate(losses) if not _finite(v)]
    if bad:
        problems.append(f"the loss is not finite at step {bad[0]} ({len(bad)} of {len(losses)} steps)")
    check = out.get("grad_check") or {}
    if not check.get("ok", False):
        err, tol = check.get("max_rel_err"), check.get("tolerance")
        shown = f"{err:.2e}" if isinstance(err, int | float) else "not computed"
        limit = f" (tolerance {tol:.0e})" if isinstance(tol, int | float) else ""
        problems.append(f"the gradient check failed: max relative error {shown}{limit}")
    return "run failed: " + "; ".join(problems) if problems else None


def _finite(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True, slots=True)
class RunRequest:
    plan: Plan
    spec: ModelSpec
    steps: int
    nproc: int
    global_batch: int
    seq: int
    cluster: ClusterSpec
    device: str = "cpu"
    threads: int = 0
    seed: int = 0
    mode: str = "plan"  # or a baseline: "compile" (torch.compile defaults), "eager" (``Job.mode``)
    host_allocator: str = "pinned"  # or "default" (``Job.host_allocator``, ``coplan.hardware.allocator``)
    # mode "compile": torch.compile with PyTorch's memory-budgeted partitioner at this fraction
    # (``Job.activation_budget``); the prediction keeps the plan's recompute set, the cost model's
    # stand-in for what the partitioner recomputes to meet the plan's memory
    activation_budget: float | None = None


def runner_optimizer(plan: Plan, ctx: PlanContext, mode: str, device: str) -> str:
    """How the runner's AdamW runs (``train.adamw_form``), for the cost model
    (``TrainingConfig.optimizer``): on a GPU, PyTorch's multi-tensor form for a baseline, the
    fused kernel where the plan groups optimizer ops (priced as its groups say), else the
    per-parameter loop (always under pipelining). On a CPU the plan's kernels price it, as the CPU
    profile was fitted."""
    if device == "cpu":
        return ""
    if mode != "plan":
        return "foreach"
    if plan.parallel.pp > 1:
        return "for-loop"  # a pipeline stage's AdamW fuses nothing (``pipeline.py``)
    # the test ``train`` makes before it builds fused AdamW
    fused = optimizer_record(plan, ctx.index.graph, True) is not None
    return "" if fused else "for-loop"


def _validate(req: RunRequest) -> None:
    if req.mode not in MODES:
        raise PlanError("mode", f"must be one of {', '.join(MODES)}, got {req.mode!r}", "run")
    if req.host_allocator not in HOST_ALLOCATORS:
        got = req.host_allocator
        raise SpecError("--host-allocator", None, f"must be one of {', '.join(HOST_ALLOCATORS)}, got {got!r}")
    if req.activation_budget is not None:
        if req.mode != "compile":
            raise PlanError("mode", f"an activation budget needs mode 'compile', got {req.mode!r}", "run")
        if not 0.0 <= req.activation_budget <= 1.0:
            raise PlanError(
                "activation_budget", f"must be between 0 and 1, got {req.activation_budget}", "run"
            )


def priced_request(
    req: RunRequest, *, optimizer: str | None = None
) -> tuple[PlanContext, Plan, Prediction, list[str]]:
    """(the run's context, what it executes as a plan, the cost model's prediction of that, notes):
    ``req`` validated (``PlanError`` when the plan was made for another model, world size, batch
    or sequence) and priced on ``req.cluster``, as ``run_plan`` runs it; a calibrated profile as
    the cluster prices the same run on the device as measured. ``optimizer`` prices another AdamW
    form (``TrainingConfig.optimizer``) than this runner builds: a recorded run's own."""
    cluster = run_cluster(req.cluster, req.nproc, req.device)
    ctx = make_context(req.spec, cluster, req.global_batch, req.seq, req.device)
    # torch.compile's own path runs Inductor's joint-graph passes, which pad unaligned GEMMs
    # (``shape_padding``); eager PyTorch runs the shapes as they are; a plan pads its LM head
    # where the runner does (``train.pads_head``)
    pads = req.mode == "compile" or (ctx.stack.gemm_padding and pads_head(req.mode, req.plan.parallel.tp))
    if pads != ctx.stack.gemm_padding:
        ctx.stack = replace(ctx.stack, gemm_padding=pads)
    ctx.stack = mode_stack(ctx.stack, req.mode, req.device)
    if optimizer is None:
        optimizer = runner_optimizer(req.plan, ctx, req.mode, req.device)
    if optimizer != ctx.stack.optimizer:
        ctx.stack = replace(ctx.stack, optimizer=optimizer)
    notes = refuse(req.plan, ctx, req.nproc)
    _validate(req)
    ran = baseline_plan(req.plan, ctx, req.mode, keep_recompute=req.activation_budget is not None)
    if req.mode != "plan":
        recomputing = (
            f"the plan's {len(ran.remat.recompute)} recomputed tensors for activation budget "
            f"{req.activation_budget:g}"
            if req.activation_budget is not None
            else f"{len(ran.remat.recompute)} tensors recomputed by the min-cut partitioner's default"
            if ran.remat.recompute
            else "no recomputation"
        )
        notes.append(
            f"baseline {req.mode!r}: the plan's layout and batch only; predicted for "
            f"{ran.fusion.label} kernels, {recomputing}, {ran.precision.compute} autocast"
        )
    return ctx, ran, predict(ran, ctx), notes


def run_plan(req: RunRequest) -> dict[str, Any]:
    """Validate ``req.plan`` for this run (``PlanError`` when it was made for another model, world
    size, batch or sequence), price it, train, and return the report."""
    ctx, ran, pred, notes = priced_request(req)
    cluster = ctx.cluster
    threads = req.threads
    if not threads and req.device == "cpu":
        threads = max(1, (os.cpu_count() or 1) // req.nproc)  # processes share the machine's cores
    job = Job(
        plan=req.plan.to_dict(),
        spec=req.spec,
        global_batch=req.global_batch,
        seq=req.seq,
        steps=req.steps,
        device=req.device,
        threads=threads,
        seed=req.seed,
        mode=req.mode,
        host_allocator=req.host_allocator,
        activation_budget=req.activation_budget,
    )
    res = execute(job, req.nproc)
    out = report(req, cluster, pred.figures(), pred.breakdown_s, res, notes)
    # the AdamW form built and priced (``runner_optimizer``; "": the plan's own kernels)
    out["run"]["optimizer"] = ctx.stack.optimizer
    if req.mode == "plan" and out["fusion"]["groups_planned"] > out["fusion"]["groups_honoured"]:
        # the compiler left some of the plan's kernels apart: the price of what it ran beside the
        # price of what was planned, so a prediction's error is not the compiler's
        ran_as = as_run(ran, ctx.index.graph, res.fusion)
        if ran_as is not None:
            out["predicted_as_run"] = {
                **predict(ran_as, ctx).figures(),
                "groups": len(ran_as.fusion.groups),
                "groups_planned": len(ran.fusion.groups),
            }
    return out


def execute(job: Job, nproc: int) -> RankResult:
    """Run ``job`` here (one process, or a rank of a torchrun job) or in ``nproc`` spawned processes."""
    env = from_torchrun()
    if env is not None:
        rank, world = env
        if world != nproc:
            raise RunError(f"torchrun started {world} processes, --nproc is {nproc}")
        res = run_rank(rank, world, job)
        if res is None:
            raise SystemExit(0)  # only the main rank reports
        return res
    if nproc == 1:
        res = run_rank(0, 1, job)
        assert res is not None
        return res
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        job = replace(job, result=str(out))
        try:
            launch(run_rank, nproc, (job,))
        except Exception as e:  # a worker's traceback: keep the user's error line if it wrote one
            if out.exists():
                data = json.loads(out.read_text())
                if "error" in data:
                    raise RunError(data["error"]) from None
            raise RunError(f"a worker process failed: {str(e).strip().splitlines()[-1]}") from e
        data = json.loads(out.read_text())
    if "error" in data:
        raise RunError(data["error"])
    return RankResult(**data)


def report(
    req: RunRequest,
    cluster: ClusterSpec,
    predicted: dict[str, float],
    breakdown: dict[str, float],
    res: RankResult,
    notes: list[str],
) -> dict[str, Any]:
    tol = tolerance_of(req.plan, req.spec.n_layers)
    err = res.max_rel_err
    # groups of every block (the plan names the reference block's): one per fused kernel asked for
    planned, honoured = honoured_total(res.fusion)
    p = req.plan
    return {
        "measured": {
            "step_time_s": step_time(res),
            "saved_activation_bytes": res.saved["activation"],
            "peak_bytes": res.peak_bytes,
        },
        # what autograd kept in the first microbatch, by shape and dtype, largest first
        "saved_by_shape": res.saved_by_shape,
        "predicted": predicted,
        "loss": res.loss,
        "grad_check": {"max_rel_err": err, "tolerance": tol, "ok": bool(err <= tol)},
        "fusion": {
            "groups_planned": planned,
            "groups_honoured": honoured,
            "not_honoured": not_honoured(res.fusion),
        },
        "run": {
            "model": req.spec.name,
            "plan": p.fingerprint,
            "device": req.device,
            "device_name": device_name(req.device),
            "mode": req.mode,
            "activation_budget": req.activation_budget,
            "nproc": req.nproc,
            "cluster": cluster.name,
            "global_batch": req.global_batch,
            "seq": req.seq,
            "steps": req.steps,
            "layout": p.parallel.describe(),
            "precision": p.precision.compute,
            "recomputed": res.recomputed,
            "not_found": res.missing,
            "step_times_s": res.step_times_s,
            "timed_steps": res.timed_steps,
            "saved_other_bytes": {"param": res.saved["param"], "input": res.saved["input"]},
            "worst_param": res.worst_param,
            "compiled_regions": res.regions,
            "predicted_breakdown_s": breakdown,
            "fusion_detail": res.fusion,
            "notes": notes + res.notes,
        },
    }


DEVICES = ("auto", "cpu", "cuda")


def resolve_device(device: str) -> str:
    """``auto`` -> cuda when a CUDA device is visible, else cpu; cuda without one is an error."""
    import torch

    if device not in DEVICES:
        raise SpecError("--device", None, f"must be one of {', '.join(DEVICES)}, got {device!r}")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise SpecError("--device", None, "cuda was asked for, but no CUDA device is visible")
    return device


def device_name(device: str) -> str:
    """The device a run measured on, as its driver names it (reports must name the hardware)."""
    import platform

    import torch

    if device == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return platform.processor() or platform.machine()
