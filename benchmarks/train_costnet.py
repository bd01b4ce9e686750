"""Train the learned cost model on a dataset and add it to a policy file (``coplan.learn.costnet``).

    python benchmarks/train_costnet.py [--data /tmp/coplan-learn] [--policy coplan/learn/policy.pt]
        [--per-job 8] [--epochs 10] [--results benchmarks/results/learned.json]

Plans are sampled around each job of the train split (the teacher's, the baseline's and
``--per-job`` random valid ones) and priced by the analytic cost model; the network is fitted to
the logs of their step time and peak memory, then reported against the analytic model on plans
sampled the same way around the held-out jobs (Kendall's tau per job, top-1 regret, MAPE). The
policy file is rewritten carrying it, and the figures are added to ``--results`` under
``"cost_model"``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from coplan.learn.costnet import rank_report, train_costnet  # noqa: E402
from coplan.learn.dataset import open_dataset  # noqa: E402
from coplan.learn.samples import cost_examples  # noqa: E402
from coplan.learn.train import attach_cost, load_policy, save_policy  # noqa: E402


def _say(done: int, total: int, what: str) -> None:
    if done == total or done % 50 == 0:
        print(f"  [{done}/{total}] {what}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=Path("/tmp/coplan-learn"))
    ap.add_argument("--policy", type=Path, default=ROOT / "coplan" / "learn" / "policy.pt")
    ap.add_argument("--per-job", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--train-limit", type=int, default=400)
    ap.add_argument("--eval-limit", type=int, default=100)
    ap.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results" / "learned.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    ds = open_dataset(args.data)
    net, meta = load_policy(args.policy)
    train_recs = [r for r in ds.records("train") if "error" not in r][: args.train_limit]
    print(f"pricing plans around {len(train_recs)} train jobs", flush=True)
    data = cost_examples(train_recs, args.per_job, seed=0, progress=_say)
    t1 = time.perf_counter()
    cost, loss = train_costnet(
        data, epochs=args.epochs, hidden=net.config.hidden, layers=net.config.layers, progress=_say
    )
    t_train = time.perf_counter() - t1
    report = {"train": rank_report(cost, data), "train_plans": len(data), "epochs": args.epochs, "loss": loss}
    for split in ("heldout", "heldout_family"):
        recs = [r for r in ds.records(split) if "error" not in r][: args.eval_limit]
        held = cost_examples(recs, args.per_job, seed=1)
        report[split] = rank_report(cost, held) | {"jobs": len(recs), "plans": len(held)}
        print(split, report[split], flush=True)
    meta = meta | {"cost_model": report}
    save_policy(attach_cost(net, cost), args.policy, meta)
    report["seconds"] = time.perf_counter() - t0
    report["train_seconds"] = t_train
    results = json.loads(args.results.read_text()) if args.results.exists() else {}
    results["cost_model"] = report
    results["policy_bytes"] = args.policy.stat().st_size
    args.results.write_text(json.dumps(results, indent=1) + "\n")
    print(f"cost model added to {args.policy}; figures in {args.results} ({report['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
