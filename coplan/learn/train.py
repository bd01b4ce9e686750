"""Training the policy by imitation of the teacher's plans (``coplan learn train``).

Each record of the dataset becomes an ``Example``: the job's graph, the layouts its search space
offers (every parallel layout x compute precision ``SearchSpace`` enumerates, as the joint
search starts from), which of them the teacher chose, and the teacher's per-op decisions. The loss
is the sum of a cross-entropy over the job's layouts, binary cross-entropies over the fusion
edges and over the saved ops' recompute decisions (each op weighted by the blocks its decision
applies to), and a cross-entropy over the dtype classes. Jobs whose teacher plan does not fit
teach no per-op decisions and no layout (nothing fits: there is no right answer to imitate).

A model file holds the format version, the network's config, its weights and what it was trained
on (the dataset's seed, jobs and split counts, epochs, the final losses); ``load_policy`` refuses
another format or version, or a file that is not one, in one line (``PolicyError``, exit 2).
"""

from __future__ import annotations

import copy
import math
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from coplan.errors import CoplanError
from coplan.learn.dataset import Dataset
from coplan.learn.features import (
    JobGraph,
    Labels,
    _layout_key,
    job_graph,
    layout_candidates,
    layout_matrix,
    plan_labels,
)
from coplan.learn.jobs import Job
from coplan.learn.policy import POLICY_VERSION, PolicyConfig, PolicyNet
from coplan.plan.types import Plan

__all__ = [
    "Example",
    "PolicyError",
    "attach_cost",
    "examples",
    "layout_candidates",
    "load_policy",
    "save_policy",
    "train",
]

POLICY_FORMAT = "coplan-learn-policy"


class PolicyError(CoplanError):
    """A policy file that cannot be used (exit 2)."""

    def __init__(self, where: Path | str, message: str) -> None:
        super().__init__(f"policy {where}: {message}")


@dataclass(frozen=True, slots=True)
class Example:
    job: Job
    graph: JobGraph
    layouts: torch.Tensor  # (L, LAYOUT_DIM)
    target: int  # the teacher's layout among them (-1: not among them or no fitting teacher)
    labels: Labels | None  # the teacher's per-op decisions (None: no fitting teacher)
    per_op: bool = True  # the job's stack compiles per-op kernels (else fusion is the stack's)


def example(record: dict[str, Any]) -> Example:
    job = Job.from_dict(record["job"])
    teacher = record.get("labels", {}).get("teacher")
    fitting = bool(teacher) and bool(teacher["fits"])
    return example_of(job, Plan.from_dict(teacher["plan"]) if fitting else None)


def example_of(job: Job, plan: Plan | None, ctx: Any = None) -> Example:
    """``job`` with ``plan`` as its label (None: no plan fits the job), on ``ctx`` where the caller
    holds the job's planning context already."""
    ctx = ctx if ctx is not None else job.context()
    jg = job_graph(ctx, anchors="epilogue" in ctx.stack.fusion)
    cands = layout_candidates(ctx)
    layouts = layout_matrix(ctx, cands)
    per_op = "greedy" in ctx.stack.fusion
    if plan is None:
        return Example(job, jg, layouts, -1, None, per_op)
    want = _layout_key(plan.parallel, plan.precision)
    target = next((i for i, (p, q) in enumerate(cands) if _layout_key(p, q) == want), -1)
    return Example(job, jg, layouts, target, plan_labels(jg, plan), per_op)


def examples(
    ds: Dataset, split: str, progress: Callable[[int, int, str], None] | None = None
) -> list[Example]:
    records = [r for r in ds.records(split) if "error" not in r]
    out = []
    for i, r in enumerate(records):
        out.append(example(r))
        if progress:
            progress(i + 1, len(records), r["job"]["spec"]["name"])
    return out


def _losses(net: PolicyNet, ex: Example) -> dict[str, torch.Tensor]:
    chosen = ex.target if ex.target >= 0 else 0
    out = net(ex.graph, ex.layouts, chosen)
    zero = out.layout.sum() * 0.0
    losses = {"layout": zero, "fuse": zero, "recompute": zero, "dtype": zero}
    if ex.target >= 0:
        losses["layout"] = nn.functional.cross_entropy(out.layout.unsqueeze(0), torch.tensor([ex.target]))
    if ex.labels is not None:
        lab = ex.labels
        if lab.fuse.numel() and ex.per_op:  # a stack with its own kernels teaches no fusion
            src = ex.graph.edge_index[0, : ex.graph.n_data]
            w = ex.graph.weight[src]
            losses["fuse"] = (
                nn.functional.binary_cross_entropy_with_logits(out.fuse, lab.fuse, reduction="none") * w
            ).sum() / w.sum()
        mask = ex.graph.saved
        if mask.any():
            w = ex.graph.weight[mask]
            losses["recompute"] = (
                nn.functional.binary_cross_entropy_with_logits(
                    out.recompute[mask], lab.recompute[mask], reduction="none"
                )
                * w
            ).sum() / w.sum()
        losses["dtype"] = nn.functional.cross_entropy(out.dtype, lab.dtype)
    return losses


def _batches(items: list[Example], rng: random.Random) -> Iterator[Example]:
    order = list(range(len(items)))
    rng.shuffle(order)
    for i in order:
        yield items[i]


def train(
    data: list[Example],
    *,
    epochs: int = 30,
    seed: int = 0,
    config: PolicyConfig | None = None,
    lr: float = 3e-3,
    progress: Callable[[int, int, str], None] | None = None,
    start: PolicyNet | None = None,
) -> tuple[PolicyNet, dict[str, float]]:
    """A policy trained on ``data`` (Adam, one job per step, cosine learning rate): the network
    and its mean losses over the last epoch. ``start``: fine-tune a copy of that network instead
    of a fresh one (its configuration wins over ``config``; its learned cost model is kept)."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    if start is not None:
        net = copy.deepcopy(start)
        net.train()
    else:
        net = PolicyNet(config)
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    steps = max(1, epochs * len(data))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
    )
    last: dict[str, float] = {}
    for epoch in range(epochs):
        sums: dict[str, float] = {}
        for ex in _batches(data, rng):
            losses = _losses(net, ex)
            total = sum(losses.values(), torch.zeros(()))
            opt.zero_grad()
            total.backward()
            nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            opt.step()
            sched.step()
            for k, v in losses.items():
                sums[k] = sums.get(k, 0.0) + float(v.detach())
        last = {k: v / max(1, len(data)) for k, v in sums.items()}
        if progress:
            progress(epoch + 1, epochs, " ".join(f"{k} {v:.3f}" for k, v in last.items()))
    net.eval()
    return net, last


def attach_cost(net: PolicyNet, cost: nn.Module) -> PolicyNet:
    """``net`` carrying the learned cost model ``cost`` (of the same width and depth)."""
    from dataclasses import replace

    out = PolicyNet(replace(net.config, cost=True))
    missing, unexpected = out.load_state_dict(net.state_dict(), strict=False)
    if unexpected or any(not k.startswith("cost.") for k in missing):
        raise ValueError(f"policy weights do not fit: missing {missing[:3]}, unexpected {unexpected[:3]}")
    assert out.cost is not None
    out.cost.load_state_dict(cost.state_dict())
    out.eval()
    return out


def save_policy(net: PolicyNet, path: Path, meta: dict[str, Any]) -> None:
    """Write ``net`` to ``path`` atomically (a temporary file renamed over it)."""
    import os
    import tempfile

    blob = {
        "format": POLICY_FORMAT,
        "version": POLICY_VERSION,
        "config": {"hidden": net.config.hidden, "layers": net.config.layers, "cost": net.config.cost},
        "state": net.state_dict(),
        "meta": meta,
    }
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    mask = os.umask(0)
    os.umask(mask)
    try:
        torch.save(blob, tmp)
        os.chmod(tmp, 0o666 & ~mask)  # as ``open`` would make it (mkstemp's file is private)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load_policy(path: Path) -> tuple[PolicyNet, dict[str, Any]]:
    """The network in ``path`` and what it was trained on (``PolicyError`` if it is not a policy
    file of this version)."""
    if not path.is_file():
        raise PolicyError(path, "does not exist" if not path.exists() else "is not a file")
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises many kinds for a file that is not its own
        raise PolicyError(path, f"is not a coplan policy file ({type(err).__name__})") from None
    if not isinstance(blob, dict) or blob.get("format") != POLICY_FORMAT:
        raise PolicyError(path, "is not a coplan policy file")
    if blob.get("version") != POLICY_VERSION:
        raise PolicyError(
            path,
            f"policy version {blob.get('version')!r}; this coplan reads version {POLICY_VERSION}: "
            "train it again",
        )
    try:
        net = PolicyNet(PolicyConfig(**blob["config"]))
        net.load_state_dict(blob["state"])
    except (KeyError, TypeError, ValueError, RuntimeError) as err:
        raise PolicyError(path, f"holds weights that do not fit the network: {str(err)[:120]}") from None
    net.eval()
    return net, dict(blob.get("meta", {}))


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    return fn(), time.perf_counter() - t0
