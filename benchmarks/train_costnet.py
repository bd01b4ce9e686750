"""Train the learned cost model on a dataset and add it to a policy file (``coplan.learn.costnet``).

    python benchmarks/train_costnet.py [--data /tmp/coplan-learn] [--policy coplan/learn/policy.pt]
        [--per-job 8] [--epochs 10] [--results benchmarks/results/learned.json] [--eval-only]

Plans are sampled around each job of the train split (the teacher's, the baseline's and
``--per-job`` random valid ones) and priced by the analytic cost model; the network is fitted to
the logs of their step time and peak memory, then reported against the analytic model on plans
sampled the same way around the held-out jobs (Kendall's tau per job, top-1 regret, MAPE). The
policy file is rewritten carrying it, and the figures are added to ``--results`` under
``"cost_model"``. ``--eval-only`` reports the cost model the policy file carries on every held-out
split, changing nothing but the figures.
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
from coplan.learn.jobs import SPLITS  # noqa: E402
from coplan.learn.samples import cost_examples  # noqa: E402
from coplan.learn.train import attach_cost, load_policy, save_policy  # noqa: E402


def _say(done: int, total: int, what: str) -> None:
    if done == total or done % 50 == 0:
        print(f"  [{done}/{total}] {what}", flush=True)


#: the splits never trained on: held-out widths and each held-out family
HELDOUT = tuple(s for s in SPLITS if s.startswith("heldout"))


def _held_report(ds: object, cost: torch.nn.Module, split: str, args: argparse.Namespace) -> dict:
    recs = [r for r in ds.records(split) if "error" not in r][: args.eval_limit]  # type: ignore[attr-defined]
    held = cost_examples(recs, args.per_job, seed=1)
    return rank_report(cost, held) | {"jobs": len(recs), "plans": len(held)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=Path("/tmp/coplan-learn"))
    ap.add_argument("--policy", type=Path, default=ROOT / "coplan" / "learn" / "policy.pt")
    ap.add_argument("--per-job", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--train-limit", type=int, default=400)
    ap.add_argument("--eval-limit", type=int, default=100)
    ap.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results" / "learned.json")
    ap.add_argument("--eval-only", action="store_true", help="report the policy file's cost model only")
    args = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    ds = open_dataset(args.data)
    net, meta = load_policy(args.policy)
    if args.eval_only:
        if net.cost is None:
            raise SystemExit(f"error: {args.policy} carries no cost model")
        results = json.loads(args.results.read_text()) if args.results.exists() else {}
        # the figures of its training: in the results, or in the policy file's own record of it
        report = dict(results.get("cost_model") or meta.get("cost_model", {}))
        for split in HELDOUT:
            report[split] = _held_report(ds, net.cost, split, args)
            print(split, report[split], flush=True)
        results["cost_model"] = report
        args.results.write_text(json.dumps(results, indent=1) + "\n")
        return
    train_recs = [r for r in ds.records("train") if "error" not in r][: args.train_limit]
    print(f"pricing plans around {len(train_recs)} train jobs", flush=True)
    data = cost_examples(train_recs, args.per_job, seed=0, progress=_say)
    t1 = time.perf_counter()
    cost, loss = train_costnet(
        data, epochs=args.epochs, hidden=net.config.hidden, layers=net.config.layers, progress=_say
    )
    t_train = time.perf_counter() - t1
    report = {"train": rank_report(cost, data), "train_plans": len(data), "epochs": args.epochs, "loss": loss}
    for split in HELDOUT:
        report[split] = _held_report(ds, cost, split, args)
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
