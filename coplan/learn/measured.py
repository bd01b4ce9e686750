"""Measured runs as examples of the learned cost model, and its error against them.

``coplan run --record FILE`` appends one JSON line per run: the model, the plan, the cluster it ran
on, the measured step time and peak memory, and the analytic model's prediction. Each becomes a
``CostExample`` labelled with what was measured (``run_examples``), planned on the context the
runner prices it in (``apply.predict``: coplan's runner stack on the run's own cluster), so the
learned cost model can be judged against real steps beside the analytic model
(``measured_report``) and fine-tuned on them (``costnet.train_costnet(start=...)``). Runs of the
same model, cluster, batch and sequence under different plans form one job: Kendall's tau and
the top-1 regret are taken within a job, as in ``costnet.rank_report``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from coplan.learn.costnet import CostExample, CostNet, predict_steps, rank_accuracy

__all__ = ["accuracy", "measured_report", "read_runs", "run_examples"]


def read_runs(paths: Iterable[Path]) -> list[dict[str, Any]]:
    """The runs recorded in ``paths`` (JSON lines), those whose gradients passed their check."""
    out = []
    for path in paths:
        for line in Path(path).read_text(encoding="utf-8").splitlines():
            if line.strip():
                r = json.loads(line)
                if r.get("grad_check", {}).get("ok", True) and r.get("mode", "plan") == "plan":
                    out.append(r)
    return out


def _job_key(r: dict[str, Any]) -> tuple[Any, ...]:
    return (r["model"]["name"], r["cluster"], r["nproc"], r["global_batch"], r["seq"])


def run_examples(runs: list[dict[str, Any]]) -> tuple[list[CostExample], list[float]]:
    """Each run as a cost example labelled with its measured step time and peak bytes, and the
    analytic model's step time for it today (same order)."""
    from coplan.apply.predict import make_context, run_cluster
    from coplan.hardware.cluster import ClusterSpec
    from coplan.learn.features import job_graph, layout_matrix, plan_node_features
    from coplan.models.spec import ModelSpec
    from coplan.plan.types import Plan

    jobs: dict[tuple[Any, ...], int] = {}
    examples, analytic = [], []
    for r in runs:
        index = jobs.setdefault(_job_key(r), len(jobs))
        cluster = run_cluster(ClusterSpec.from_dict(r["cluster_spec"]), r["nproc"], r["device"])
        spec = ModelSpec(**{k: v for k, v in r["model"].items() if v is not None})
        ctx = make_context(spec, cluster, r["global_batch"], r["seq"], r["device"])
        plan = Plan.from_dict(r["plan"])
        jg = job_graph(ctx, anchors="epilogue" in ctx.stack.fusion)
        layout = layout_matrix(ctx, [(plan.parallel, plan.precision)])[0]
        measured = r["measured"]
        examples.append(
            CostExample(
                index,
                jg,
                plan_node_features(jg, plan),
                layout,
                float(measured["step_time_s"]),
                float(measured.get("peak_bytes") or r["predicted"]["peak_bytes"]),
            )
        )
        analytic.append(ctx.price(plan).step_time_s)
    return examples, analytic


def accuracy(pred: list[float], data: list[CostExample]) -> dict[str, float | None]:
    """Kendall's tau (mean over jobs), top-1 regret and MAPE of the step times ``pred`` against
    the measured ones of ``data`` (``costnet.rank_accuracy``), with the counts of jobs and runs."""
    return rank_accuracy(pred, data) | {
        "jobs": float(len({ex.job_index for ex in data})),
        "runs": float(len(data)),
    }


def measured_report(net: CostNet | None, data: list[CostExample], analytic: list[float]) -> dict[str, Any]:
    """Kendall's tau (mean over jobs), top-1 regret and MAPE against the measured step times: of
    the learned cost model (``net``, where given) and of the analytic model (``analytic``)."""
    out: dict[str, Any] = {"analytic": accuracy(analytic, data)}
    if net is not None:
        out["learned"] = accuracy(predict_steps(net, data), data)
    return out
