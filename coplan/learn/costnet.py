"""The learned cost model: a GNN that predicts a plan's step time and peak memory.

Input: the job's graph (``features.job_graph``) with each op's decisions under the plan added to
its features (in a kernel of several ops, the kernel's size, recomputed, its dtype class), and the
plan's layout (``features.layout_matrix``) beside the job's global features. Output: the log
of the step time and the log of the peak bytes per GPU. Trained on the analytic cost model's
prices of plans sampled around each job (``sample_plans``: the teacher's and the baseline's
plans, and plans of random layouts, random recompute sets and random kernels, each checked and
priced by coplan); measured runs can be added as (job, plan, seconds) examples the same way.

Reported against the analytic model on held-out jobs (``rank_report``): Kendall's tau between
the two rankings of each job's sampled plans (mean over jobs), the top-1 regret (the analytic
step time of the plan the learned model ranks first, over the best, less 1) and the mean absolute
percentage error of the step time.
"""

from __future__ import annotations

import copy
import math
import random
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from coplan.learn.features import (
    GLOBAL_DIM,
    LAYOUT_DIM,
    NODE_DIM,
    PLAN_DIM,
    JobGraph,
)
from coplan.learn.gnn import gine_layers, propagate

__all__ = [
    "COSTNET_VERSION",
    "CostExample",
    "CostNet",
    "kendall_tau",
    "predict_steps",
    "rank_accuracy",
    "rank_report",
    "train_costnet",
]

COSTNET_VERSION = 1


class CostNet(nn.Module):
    def __init__(self, hidden: int = 64, layers: int = 3) -> None:
        super().__init__()
        self.hidden, self.layers = hidden, layers
        h = hidden
        self.glob = nn.Sequential(nn.Linear(GLOBAL_DIM + LAYOUT_DIM, h), nn.ReLU(), nn.Linear(h, h))
        self.embed = nn.Linear(NODE_DIM + PLAN_DIM + h, h)
        self.convs, self.norms = gine_layers(h, layers)
        self.head = nn.Sequential(nn.Linear(3 * h, h), nn.ReLU(), nn.Linear(h, 2))

    def forward(self, jg: JobGraph, plan_x: torch.Tensor, layout: torch.Tensor) -> torch.Tensor:
        """(log step seconds, log peak bytes)."""
        g = self.glob(torch.cat([jg.u, layout]))
        x = self.embed(torch.cat([jg.x, plan_x, g.expand(jg.x.shape[0], -1)], dim=1))
        x = propagate(self.convs, self.norms, x, jg)
        return self.head(torch.cat([x.mean(0), x.max(0).values, g]))


@dataclass(frozen=True, slots=True)
class CostExample:
    job_index: int
    graph: JobGraph
    plan_x: torch.Tensor
    layout: torch.Tensor
    step_s: float
    peak_bytes: float


def train_costnet(
    data: list[CostExample],
    *,
    epochs: int = 20,
    seed: int = 0,
    lr: float = 3e-3,
    hidden: int = 64,
    layers: int = 3,
    progress: Callable[[int, int, str], None] | None = None,
    start: CostNet | None = None,
) -> tuple[CostNet, float]:
    """A cost network fitted to ``data`` (mean squared error of the two logs); the last epoch's
    mean loss. ``start``: fine-tune a copy of that network instead (measured runs on top of the
    analytic labels: ``measured.run_examples``)."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    if start is not None:
        net = copy.deepcopy(start)
        net.train()
    else:
        net = CostNet(hidden, layers)
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    last = 0.0
    for epoch in range(epochs):
        order = list(range(len(data)))
        rng.shuffle(order)
        total = 0.0
        for i in order:
            ex = data[i]
            y = torch.tensor([math.log(ex.step_s), math.log(ex.peak_bytes)])
            loss = nn.functional.mse_loss(net(ex.graph, ex.plan_x, ex.layout), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += float(loss.detach())
        last = total / max(1, len(data))
        if progress:
            progress(epoch + 1, epochs, f"loss {last:.4f}")
    net.eval()
    return net, last


def kendall_tau(a: list[float], b: list[float]) -> float | None:
    """Kendall's tau-b of two rankings (None for fewer than two items)."""
    n = len(a)
    if n < 2:
        return None
    conc = disc = ta = tb = 0
    for i in range(n):
        for j in range(i + 1, n):
            da, db = a[i] - a[j], b[i] - b[j]
            if da == 0 and db == 0:
                continue
            if da == 0:
                ta += 1
            elif db == 0:
                tb += 1
            elif (da > 0) == (db > 0):
                conc += 1
            else:
                disc += 1
    denom = math.sqrt((conc + disc + ta) * (conc + disc + tb))
    return (conc - disc) / denom if denom else None


def rank_accuracy(pred: list[float], data: list[CostExample]) -> dict[str, float | None]:
    """Kendall's tau (mean over jobs), top-1 regret (mean over jobs) and the step time's MAPE of
    the step times ``pred`` against the labels of ``data`` (same order)."""
    by_job: dict[int, list[tuple[float, float]]] = {}
    for p, ex in zip(pred, data, strict=True):
        by_job.setdefault(ex.job_index, []).append((p, ex.step_s))
    taus, regrets = [], []
    for pairs in by_job.values():
        t = kendall_tau([p for p, _ in pairs], [s for _, s in pairs])
        if t is not None:
            taus.append(t)
        best = min(s for _, s in pairs)
        picked = min(pairs)[1]
        regrets.append(picked / best - 1)
    errs = [abs(p - ex.step_s) / ex.step_s for p, ex in zip(pred, data, strict=True)]
    return {
        "kendall_tau": sum(taus) / len(taus) if taus else None,
        "top1_regret": sum(regrets) / len(regrets) if regrets else None,
        "mape": sum(errs) / len(errs) if errs else None,
    }


def predict_steps(net: CostNet, data: list[CostExample]) -> list[float]:
    """``net``'s step seconds for each example."""
    with torch.no_grad():
        return [math.exp(float(net(ex.graph, ex.plan_x, ex.layout)[0])) for ex in data]


def rank_report(net: CostNet, data: list[CostExample]) -> dict[str, float | None]:
    """Kendall's tau (mean over jobs), top-1 regret (mean over jobs) and the step time's MAPE of
    ``net`` against the analytic labels of ``data``."""
    return rank_accuracy(predict_steps(net, data), data)
