"""The learned cost model against measured training steps, and fine-tuned on them.

    python benchmarks/costnet_measured.py [--runs RUNS.jsonl ...]
        [--data /tmp/coplan-learn] [--policy coplan/learn/policy.pt] [--replay 50] [--repeat 8]
        [--epochs 6] [--write] [--results benchmarks/results/costnet_measured.json]

The runs recorded by ``coplan run --record`` (``benchmarks/bench_apply.py`` and
``benchmarks/record_runs.py`` write the default files: real training steps of small GPT and
LLaMA-style models on this machine's CPU) become examples labelled with what was measured
(``coplan.learn.measured``). Reported, each against the measured step times (Kendall's tau within
each job's plans, top-1 regret, MAPE):

- the analytic cost model;
- the learned cost model the policy carries (trained on analytic labels only);
- the learned cost model fine-tuned on the measured runs of the other jobs (leave one job out),
  with ``--replay`` jobs' analytic examples (``samples.cost_examples``) replayed beside them so
  that it keeps what it learned; each measured run seen ``--repeat`` times an epoch.

``--write`` then fine-tunes on every measured run and writes it into the policy file.
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

from coplan.learn.costnet import CostNet, predict_steps, train_costnet  # noqa: E402
from coplan.learn.dataset import open_dataset  # noqa: E402
from coplan.learn.measured import accuracy, measured_report, read_runs, run_examples  # noqa: E402
from coplan.learn.samples import cost_examples  # noqa: E402
from coplan.learn.train import attach_cost, load_policy, save_policy  # noqa: E402

RUNS = (
    ROOT / "benchmarks" / "results" / "apply_runs.jsonl",
    ROOT / "benchmarks" / "results" / "apply_sweep_runs.jsonl",
    ROOT / "benchmarks" / "results" / "llama_runs.jsonl",
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=Path, nargs="+", default=list(RUNS))
    ap.add_argument("--data", type=Path, default=Path("/tmp/coplan-learn"))
    ap.add_argument("--policy", type=Path, default=ROOT / "coplan" / "learn" / "policy.pt")
    ap.add_argument("--replay", type=int, default=50, help="train jobs whose analytic examples are replayed")
    ap.add_argument("--repeat", type=int, default=8, help="times each measured run is seen per epoch")
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--write", action="store_true", help="write the model fine-tuned on every run")
    ap.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results" / "costnet_measured.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    net, meta = load_policy(args.policy)
    if not isinstance(net.cost, CostNet):
        sys.exit(f"error: {args.policy} carries no learned cost model (benchmarks/train_costnet.py adds one)")
    runs = read_runs(args.runs)
    data, analytic = run_examples(runs)
    recs = [r for r in open_dataset(args.data).records("train") if "error" not in r][: args.replay]
    replay = cost_examples(recs, 4, seed=2)
    print(f"{len(data)} measured runs in {len({e.job_index for e in data})} jobs; {len(replay)} replayed")
    before = measured_report(net.cost, data, analytic)
    # leave one job out: fine-tuned on the other jobs' runs, judged on its own
    held: list[float] = [0.0] * len(data)
    for job in sorted({e.job_index for e in data}):
        train = [e for e in data if e.job_index != job]
        tuned, _ = train_costnet(
            train * args.repeat + replay, epochs=args.epochs, lr=1e-3, seed=job, start=net.cost
        )
        idx = [i for i, e in enumerate(data) if e.job_index == job]
        for i, p in zip(idx, predict_steps(tuned, [data[i] for i in idx]), strict=True):
            held[i] = p
        print(f"  job {job}: {len(idx)} runs held out", flush=True)

    out = {
        "runs": [str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p) for p in args.runs],
        "measured_runs": len(data),
        "replayed_examples": len(replay),
        "analytic": before["analytic"],
        "learned": before["learned"],
        "learned_fine_tuned_leave_one_job_out": accuracy(held, data),
        "args": {"repeat": args.repeat, "epochs": args.epochs, "replay": args.replay},
    }
    if args.write:
        tuned, loss = train_costnet(data * args.repeat + replay, epochs=args.epochs, lr=1e-3, start=net.cost)
        cm = dict(meta.get("cost_model", {}))
        cm["measured"] = {"runs": len(data), "loss": loss, "files": out["runs"]}
        save_policy(attach_cost(net, tuned), args.policy, meta | {"cost_model": cm})
        out["written"] = str(args.policy)
    out["seconds"] = time.perf_counter() - t0
    args.results.write_text(json.dumps(out, indent=1) + "\n")
    for k in ("analytic", "learned", "learned_fine_tuned_leave_one_job_out"):
        print(f"{k:40s} {out[k]}")
    print(f"results -> {args.results} ({out['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
