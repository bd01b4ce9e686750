"""Search distillation of the learned planner on jobs beyond its imitation data, and its effect.

    python benchmarks/distill_policy.py [--data /tmp/coplan-learn] [--policy coplan/learn/policy.pt]
        [--out /tmp/policy-distilled.pt] [--n-large 48] [--rounds 2] [--seconds 20] [--replay 200]
        [--heldout 40] [--epochs 8] [--lr 1e-3] [--repeat 4] [--results benchmarks/results/distill.json]

1. ``--n-large`` large jobs (``distill.sample_large_job``: GPT and LLaMA of 20B to 80B on 64 to
   1,024 GPUs, real and hypothetical devices, three stacks), split into the ones fine-tuned on and
   the ones held out;
2. ``--rounds`` rounds of expert iteration (``distill.distill``): each train job planned by the
   policy and improved by the policy-guided local search under the cost model, the policy
   fine-tuned on the improved plans with ``--replay`` imitation examples of the dataset in
   ``--data`` (``train_policy.py`` makes it) replayed beside them;
3. judged, the policy alone (``plan_with_policy``, no search) before and after, and the
   fine-tuned policy guiding the search (the ``learned-search`` strategy): on the held-out
   large jobs and LLaMA-2 70B on 1,024 H100 (``bench_learned.py``'s job) against ``joint``, and on
   ``--heldout`` jobs of the dataset's held-out split against the teacher's plans re-priced by
   today's cost model. Step times are the analytic cost model's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from coplan.cost import CostModel, load_stack  # noqa: E402
from coplan.hardware import load_cluster  # noqa: E402
from coplan.learn.dataset import open_dataset  # noqa: E402
from coplan.learn.decode import LEARNED_K, plan_with_policy  # noqa: E402
from coplan.learn.distill import SEARCH_S, distill, improve, sample_large_job  # noqa: E402
from coplan.learn.jobs import Job  # noqa: E402
from coplan.learn.train import example, load_policy, save_policy  # noqa: E402
from coplan.models.spec import PRESETS  # noqa: E402
from coplan.passes.base import score  # noqa: E402
from coplan.plan import PlanContext  # noqa: E402
from coplan.plan.types import Plan  # noqa: E402
from coplan.search import run_strategy  # noqa: E402


def _say(done: int, total: int, what: str) -> None:
    print(f"  [{done}/{total}] {what}", flush=True)


def _step(ctx: Any, plan: Plan) -> float | None:
    """Step seconds of ``plan`` where it fits, else None."""
    key = score(plan, ctx)
    return key[1] if key[0] == 0 else None


def _q(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))]


def _ratios(rows: list[dict[str, Any]], a: str, b: str) -> dict[str, Any]:
    r = [x[a] / x[b] for x in rows if x.get(a) and x.get(b)]
    return {
        "n": len(r),
        "median": _q(r, 0.5),
        "p90": _q(r, 0.9),
        "better": sum(1 for x in r if x < 0.995),
        "worse": sum(1 for x in r if x > 1.005),
    }


def _judge_large(ctxs: list[tuple[str, Any]], base: Any, tuned: Any) -> list[dict[str, Any]]:
    rows = []
    for name, ctx in ctxs:
        row: dict[str, Any] = {"job": name}
        for label, net in (("before", base), ("after", tuned)):
            t0 = time.perf_counter()
            plan, _, _ = plan_with_policy(ctx, net, LEARNED_K)
            row[f"{label}_s"] = time.perf_counter() - t0
            row[label] = _step(ctx, plan)
        t0 = time.perf_counter()
        got = improve(ctx, tuned, LEARNED_K, SEARCH_S)  # the learned-search strategy
        row["search_s"] = time.perf_counter() - t0
        row["search"] = _step(ctx, got.plan)
        t0 = time.perf_counter()
        res = run_strategy("joint", ctx)
        row["joint_plan_s"] = time.perf_counter() - t0
        row["joint"] = res.estimate.step_time_s if res.fits else None
        print(
            f"  {name:40s} before {row['before']}  after {row['after']}  search {row['search']}  "
            f"joint {row['joint']}",
            flush=True,
        )
        rows.append(row)
    return rows


def _judge_small(records: list[dict[str, Any]], base: Any, tuned: Any) -> list[dict[str, Any]]:
    rows = []
    for r in records:
        job = Job.from_dict(r["job"])
        ctx = job.context()
        row: dict[str, Any] = {"job": r["id"]}
        for label, net in (("before", base), ("after", tuned)):
            plan, _, _ = plan_with_policy(ctx, net, LEARNED_K)
            row[label] = _step(ctx, plan)
        teacher = r["labels"]["teacher"]
        row["teacher"] = _step(ctx, Plan.from_dict(teacher["plan"])) if teacher["fits"] else None
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=Path("/tmp/coplan-learn"))
    ap.add_argument("--policy", type=Path, default=ROOT / "coplan" / "learn" / "policy.pt")
    ap.add_argument("--out", type=Path, default=Path("/tmp/policy-distilled.pt"))
    ap.add_argument("--n-large", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=20.0, help="search budget per job")
    ap.add_argument("--replay", type=int, default=200, help="imitation examples replayed")
    ap.add_argument("--heldout", type=int, default=40, help="held-out dataset jobs judged")
    ap.add_argument("--epochs", type=int, default=8, help="fine-tuning epochs per round")
    ap.add_argument("--lr", type=float, default=1e-3, help="fine-tuning learning rate")
    ap.add_argument("--repeat", type=int, default=4, help="times each improved plan is seen per epoch")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results" / "distill.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    base, meta = load_policy(args.policy)
    ds = open_dataset(args.data)
    train_records = [r for r in ds.records("train") if "error" not in r][: args.replay]
    replay = [example(r) for r in train_records]
    jobs = [sample_large_job(args.seed, i) for i in range(args.n_large)]
    fit_on = [j for j in jobs if j.split == "large_train"]
    held = [j for j in jobs if j.split == "large_heldout"]
    print(f"{len(fit_on)} large jobs to distil on, {len(held)} held out, {len(replay)} replayed", flush=True)
    net = base
    rounds = []
    for k in range(args.rounds):
        net, rep = distill(
            net,
            fit_on,
            replay,
            seconds=args.seconds,
            epochs=args.epochs,
            lr=args.lr,
            repeat=args.repeat,
            seed=args.seed + k,
            progress=_say,
        )
        rounds.append(rep.to_dict())
        print(f"round {k + 1}: {rep.to_dict()}", flush=True)
    save_policy(
        net,
        args.out,
        {**meta, "distilled": {"from": str(args.policy), "large_jobs": len(fit_on), "rounds": rounds}},
    )
    big = PlanContext(
        CostModel(spec=PRESETS["llama2-70b"]),
        load_cluster("dgx-h100", 1024),
        1024,
        4096,
        stack=load_stack("megatron"),
    )
    large_ctxs = [(f"{j.spec.name} x{j.cluster.num_devices} {j.stack}", j.context()) for j in held]
    large_ctxs.append(("llama2-70b x1024 megatron", big))
    print("held-out large jobs, policy alone before / after distillation, and joint:", flush=True)
    large = _judge_large(large_ctxs, base, net)
    small_records = [r for r in ds.records("heldout") if "error" not in r][: args.heldout]
    small = _judge_small(small_records, base, net)
    out = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__},
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "rounds": rounds,
        "large_heldout": {
            "after_vs_before": _ratios(large, "after", "before"),
            "before_vs_joint": _ratios(large, "before", "joint"),
            "after_vs_joint": _ratios(large, "after", "joint"),
            "search_vs_joint": _ratios(large, "search", "joint"),
            "plan_time_s": {
                "policy": statistics.median(r["after_s"] for r in large),
                "learned_search": statistics.median(r["search_s"] for r in large),
                "joint": statistics.median(r["joint_plan_s"] for r in large),
            },
            "jobs": large,
        },
        "small_heldout": {
            "after_vs_before": _ratios(small, "after", "before"),
            "before_vs_teacher": _ratios(small, "before", "teacher"),
            "after_vs_teacher": _ratios(small, "after", "teacher"),
            "jobs": small,
        },
        "seconds": time.perf_counter() - t0,
    }
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(out, indent=1) + "\n")
    for part in ("large_heldout", "small_heldout"):
        print(part, {k: v for k, v in out[part].items() if k != "jobs"}, flush=True)
    print(f"results -> {args.results} ({out['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
