"""Pipeline parallelism through ``torch.distributed.pipelining`` (``pp > 1``, one model chunk per
stage, no data or tensor parallelism alongside yet).

The model is cut into ``pp`` stages as the cost model cuts it (``ParallelPlan.stage_layers``, else
``layers / pp`` each): the first stage holds the embedding, the last the final norm and the LM
head; with tied embeddings the last stage holds its own copy of the word embedding as the LM
head, and the two copies' gradients are summed across the stages after backward (Megatron's
embedding group), so the copies stay equal. Each stage is compiled with the plan's backend (the
partitioner matches the modules a stage holds); the loss runs on the last stage in fp32 outside
the compiled region (the schedule's ``loss_fn``).

The schedule is 1F1B (``Schedule1F1B``: Megatron's non-interleaved schedule, which the cost model
prices: stage ``i`` of ``p`` holds ``p - i`` microbatches in flight); with fewer microbatches than
stages every microbatch is in flight either way and GPipe runs them.

What is measured per stage: the saved activations live at their peak during the first step
(``measure.SavedPeak``: the microbatches in flight, as the cost model's ``activations_bytes``
counts them on its most loaded stage), the step time of the slowest stage, and the gradients
of the first step against the eager fp32 reference (the largest error over all stages).
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from coplan.apply.dist import LayoutError
from coplan.models.spec import ModelSpec
from coplan.models.transformer import Head, Transformer
from coplan.plan.types import ParallelPlan


def stage_layers(p: ParallelPlan, n_layers: int) -> list[int]:
    """Blocks per stage: the plan's, else as even as the cost model splits them."""
    if p.stage_layers is not None:
        if len(p.stage_layers) != p.pp or sum(p.stage_layers) != n_layers:
            raise LayoutError(
                f"stage_layers {list(p.stage_layers)} do not split {n_layers} layers into {p.pp}"
            )
        return list(p.stage_layers)
    if n_layers % p.pp:
        raise LayoutError(f"pp={p.pp} does not divide the {n_layers} layers (give stage_layers)")
    return [n_layers // p.pp] * p.pp


class Stage(nn.Module):
    """Blocks ``[lo, hi)`` of ``model`` (module paths as in the whole model: ``h.<i>``), the
    embedding on the first stage and the final norm and LM head on the last. ``forward`` mirrors
    ``Transformer.forward`` cut at the stage boundaries (a change there must be made here too: the
    pipeline gradient check fails)."""

    tied: bool = False  # the first and last stages each hold a copy of a tied embedding

    def __init__(self, model: Transformer, lo: int, hi: int, first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.wte, self.wpe = model.wte, model.wpe
        self.h = nn.ModuleDict({str(i): model.h[i] for i in range(lo, hi)})
        if last:
            self.ln_f, self.lm_head = model.ln_f, model.lm_head
            if model.lm_head.weight is model.wte.weight and not first:
                self.lm_head = Head(model.spec.d_model, model.spec.vocab_size, bias=False)
                self.lm_head.pad_to = model.lm_head.pad_to
                with torch.no_grad():
                    self.lm_head.weight.copy_(model.wte.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            t = x.shape[1]
            x = self.wte(x)
            if self.wpe is not None:
                x = x + self.wpe(torch.arange(t, device=x.device))
        for block in self.h.values():
            x = block(x)
        if self.last:
            x = self.lm_head(self.ln_f(x))
        return x


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The last stage's loss: mean cross-entropy on fp32 logits (as the plan's loss path runs)."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), target.reshape(-1))


def tied_copy(stage: Stage) -> torch.Tensor | None:
    """This stage's copy of a tied word embedding / LM head that another stage holds too."""
    if not getattr(stage, "tied", False):
        return None
    return stage.wte.weight if stage.first else stage.lm_head.weight if stage.last else None


def build_stage(model: Transformer, p: ParallelPlan, rank: int) -> Stage:
    layers = stage_layers(p, model.spec.n_layers)
    lo = sum(layers[:rank])
    stage = Stage(model, lo, lo + layers[rank], rank == 0, rank == p.pp - 1)
    stage.tied = model.spec.tied_embeddings and p.pp > 1
    return stage


def reference_name(name: str, spec: ModelSpec) -> str:
    """A stage parameter's name in the whole model (the untied LM head copy is the embedding's)."""
    if name == "lm_head.weight" and spec.tied_embeddings:
        return "wte.weight"
    return name


def grad_error(stage: Stage, ref: dict[str, torch.Tensor], spec: ModelSpec) -> tuple[float, str]:
    """(largest relative gradient error of the stage's parameters, its name); a parameter
    without a gradient is wrong (error 1), not skipped."""
    err, worst = 0.0, ""
    for name, p in stage.named_parameters():
        want = ref[reference_name(name, spec)].to(p.device)
        got = p.grad.float() if p.grad is not None else torch.zeros_like(want)
        e = float((got - want).norm() / want.norm().clamp(min=1e-30))
        e = e if math.isfinite(e) else math.inf
        if e > err or not worst:
            err, worst = e, name
    return err, worst


def run_pipeline(rank: int, world: int, job: Any) -> Any:
    """Train ``job`` (a ``train.Job`` whose plan has ``pp == world``) as stage ``rank``."""
    import copy

    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from coplan.apply.dist import init
    from coplan.apply.measure import SavedPeak
    from coplan.apply.precision import compute_dtype, model_dtype
    from coplan.apply.step import (
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
        sync,
    )
    from coplan.plan.types import Plan, PlanError

    plan = Plan.from_dict(job.plan)
    par = plan.parallel
    if job.threads:
        torch.set_num_threads(job.threads)
    r = init(rank, world, job.device, par)
    spec = job.spec
    micro = par.microbatch
    if job.global_batch % micro:
        raise PlanError(
            "parallel.microbatch", f"global batch {job.global_batch} is not a multiple of {micro}"
        )
    n_micro = job.global_batch // micro
    data = batches(spec, job.global_batch, job.seq, job.steps, job.seed)
    whole = build(spec, job.seed, head_pad(job, r.device, par.tp))
    reference = copy.deepcopy(whole)
    stage_mod = build_stage(whole, par, rank).to(model_dtype(plan.precision)).to(r.device)
    tied = tied_copy(stage_mod)
    compiled, be = compile_for(stage_mod, plan, spec, job.mode)
    act = compute_dtype(plan.precision) if job.mode == "plan" else torch.float32
    first, last = rank == 0, rank == par.pp - 1
    d, v = spec.d_model, spec.vocab_size
    meta = torch.device("meta")
    # the stage's input and output as metadata (no shape inference pass); a received activation
    # must say it requires grad, or the stage sends no gradient back
    inp = (
        torch.empty(micro, job.seq, dtype=torch.long, device=meta)
        if first
        else torch.empty(micro, job.seq, d, dtype=act, device=meta, requires_grad=True)
    )
    out = torch.empty(micro, job.seq, v if last else d, dtype=act, device=meta, requires_grad=True)
    pstage = PipelineStage(compiled, rank, par.pp, r.device, input_args=(inp,), output_args=(out,))
    sched_cls = Schedule1F1B if n_micro >= par.pp else ScheduleGPipe
    # every stage gets the loss function: a schedule without one runs no backward on that stage
    schedule = sched_cls(pstage, n_micro, loss_fn=loss_fn)
    params = list(stage_mod.parameters())
    # the per-parameter loop for a plan (a stage fuses no optimizer kernel), PyTorch's default for a
    # baseline, as ``train.adamw_form`` builds them and ``run.runner_optimizer`` prices them
    opt = torch.optim.AdamW(
        params, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, **adamw_form(job.mode, False)
    )
    # every rank creates every group (a collective call), the two ends use it
    embedding_group = torch.distributed.new_group([0, par.pp - 1]) if stage_mod.tied else None
    amp = autocast_for(plan, r.device, be)

    def step(i: int) -> float:
        idx, tgt = data[i]
        losses: list[torch.Tensor] = []
        with amp():
            # no outputs kept for the caller: the last stage would hold every microbatch's logits
            if first:
                schedule.step(idx.to(r.device), return_outputs=False)
            elif last:
                schedule.step(target=tgt.to(r.device), losses=losses, return_outputs=False)
            else:
                schedule.step(return_outputs=False)
        if tied is not None and embedding_group is not None:
            if tied.grad is None:
                tied.grad = torch.zeros_like(tied)
            torch.distributed.all_reduce(tied.grad, group=embedding_group)
        loss = torch.tensor(
            [float(torch.stack([x.detach().float() for x in losses]).mean()) if losses else 0.0]
        )
        torch.distributed.broadcast(loss, src=par.pp - 1)
        return float(loss)

    losses_out: list[float] = []
    times: list[float] = []
    peak = math.nan
    err, worst = 0.0, ""
    saved_peak = 0
    for i in range(job.steps):
        sync(r.device)
        t0 = time.perf_counter()
        if i == 0:
            with SavedPeak(exclude=(data[0][0], data[0][1], *stage_mod.parameters())) as sp:
                hook = compiled.register_forward_hook(lambda _m, _i, o: sp.hold(o)) if not last else None
                loss = step(i)
                if hook is not None:
                    hook.remove()
            saved_peak = sp.peak_bytes(be.other_storages if be is not None else set())
            ref = reference_grads(
                reference, data[0][0], data[0][1], r.device, reference_chunk(micro, job.seq, r.device)
            )
            err, worst = grad_error(stage_mod, ref, spec)
        elif i == 1:
            with peak_tracker(r.device, stage_mod, opt) as got:
                loss = step(i)
            peak = got[0]
        else:
            loss = step(i)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(r.device)
        times.append(time.perf_counter() - t0)
        losses_out.append(loss)
    per_stage: list[Any] = [None] * world
    torch.distributed.all_gather_object(per_stage, int(saved_peak))
    times = all_max(times, world)
    figures = all_max([float(saved_peak), peak, err], world)
    losses_out = all_mean(losses_out, world)
    # the worst parameter's name, from the rank that has it
    worst_of: list[Any] = [None] * world
    torch.distributed.all_gather_object(worst_of, (err, worst))
    worst = max((w for w in worst_of if w is not None), key=lambda w: w[0])[1]
    timed = list(range(2, job.steps)) or list(range(1, job.steps)) or [0]
    notes = [
        f"pipeline: {sched_cls.__name__}, {n_micro} microbatches over {par.pp} stages; saved "
        f"activations at their peak per stage: {', '.join(str(b) for b in per_stage)} bytes"
    ]
    if job.steps < 3:
        notes.append(f"{job.steps} step(s): the timed steps include compilation or memory tracking")
    # a plan name is missing when no stage's compiled regions hold it
    report = (
        (set(be.report.missing), {n for c in be.report.cuts for n in c.recomputed}) if be else (set(), set())
    )
    reports: list[Any] = [None] * world
    torch.distributed.all_gather_object(reports, report)
    missing = set.intersection(*(m for m, _ in reports))
    recomputed = set.union(*(rc for _, rc in reports))
    if rank != 0:
        return None
    return RankResult(
        loss=losses_out,
        step_times_s=times,
        timed_steps=timed,
        saved={
            "activation": int(figures[0]),
            "compiled_activation": 0,
            "param": 0,
            "input": 0,
        },
        peak_bytes=figures[1],
        max_rel_err=figures[2],
        worst_param=worst,
        regions=be.report.regions if be is not None else 0,
        recomputed=sorted(recomputed),
        missing=sorted(missing),
        fusion=be.report.fusion if be is not None else [],
        notes=notes,
    )
