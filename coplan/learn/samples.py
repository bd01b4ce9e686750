"""Plans sampled around a job, priced by the analytic cost model: the learned cost model's
training examples (``cost_examples``) and random search's proposals (``randsearch``).

``sample_plans`` draws valid plans of a job: a random layout x precision of its search space, a
random recompute set (each recomputable saved tensor with one probability drawn per plan) and
random kernels (random fusion decisions, decoded legally by ``decode.decode``; under a stack with
its own kernels, one of the kernel sets it offers).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import torch

from coplan.learn.costnet import CostExample
from coplan.learn.decode import decode
from coplan.learn.features import (
    DTYPE_CLASSES,
    job_graph,
    layout_candidates,
    layout_matrix,
    plan_node_features,
)
from coplan.learn.jobs import Job
from coplan.learn.policy import Outputs
from coplan.plan.types import Plan

__all__ = ["cost_examples", "sample_plans"]


def sample_plans(ctx: Any, seeds: list[Plan], n: int, rng: random.Random) -> list[Plan]:
    """``seeds`` and ``n`` random valid plans of ``ctx``'s job: a random layout of the space, a
    random recompute set (each saved tensor with one probability drawn per plan) and random
    kernels (a random network's fusion decisions, decoded legally)."""
    from coplan.passes.remat import with_remat
    from coplan.plan.checker import is_valid

    jg = job_graph(ctx, anchors="epilogue" in ctx.stack.fusion)
    cands = layout_candidates(ctx)
    out = list(seeds)
    tries = 0
    while len(out) < len(seeds) + n and tries < 4 * n:
        tries += 1
        par, prec = cands[rng.randrange(len(cands))]
        q = rng.random()
        fuse_p = rng.random()
        outputs = Outputs(
            layout=torch.zeros(1),
            fuse=torch.tensor([1.0 if rng.random() < fuse_p else -1.0 for _ in range(jg.n_data)]),
            recompute=torch.tensor([1.0 if rng.random() < q else -1.0 for _ in jg.names]),
            dtype=torch.zeros(len(jg.names), len(DTYPE_CLASSES)),
        )
        p = decode(ctx, outputs, par, prec)
        if "greedy" not in ctx.stack.fusion:
            from coplan.search.space import SearchSpace

            opts = SearchSpace().fusions(ctx, p.precision)
            p = with_remat(p.with_(fusion=opts[rng.randrange(len(opts))]), p.remat.all_names, ctx)
        if is_valid(p, ctx):
            out.append(p)
    return out


def cost_examples(
    records: list[dict[str, Any]],
    per_job: int,
    seed: int = 0,
    progress: Callable[[int, int, str], None] | None = None,
) -> list[CostExample]:
    """Priced plans around each record's job (the teacher's, the baseline's and ``per_job`` random
    ones), labelled by the analytic cost model."""
    rng = random.Random(seed)
    out = []
    for i, r in enumerate(records):
        job = Job.from_dict(r["job"])
        ctx = job.context()
        jg = job_graph(ctx, anchors="epilogue" in ctx.stack.fusion)
        seeds = [Plan.from_dict(lab["plan"]) for lab in r["labels"].values()]
        for p in sample_plans(ctx, seeds, per_job, rng):
            e = ctx.price(p)
            out.append(
                CostExample(
                    job.index,
                    jg,
                    plan_node_features(jg, p),
                    layout_matrix(ctx, [(p.parallel, p.precision)])[0],
                    e.step_time_s,
                    e.memory.peak_bytes,
                )
            )
        if progress:
            progress(i + 1, len(records), job.spec.name)
    return out
