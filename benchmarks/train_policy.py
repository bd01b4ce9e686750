"""Make the policy that ships with coplan, and measure it (Claim 2).

    python benchmarks/train_policy.py [--n 800] [--seed 0] [--epochs 30] [--jobs 2]
        [--data /tmp/coplan-learn] [--out coplan/learn/policy.pt]
        [--results benchmarks/results/learned.json]

1. ``coplan learn dataset``: ``--n`` jobs sampled from ``--seed`` and labelled by ``joint-exact``
   (the teacher) and ``sequential`` (the baseline), in ``--data`` (resumable: run again after an
   interruption and only the missing shards are labelled);
2. ``coplan learn train``: the policy trained by imitation on the train split, written to
   ``--out``;
3. ``coplan learn eval`` on every split (train, val, held-out widths of the trained families, the
   held-out MoE family), written to ``--results`` with the dataset's and the training's figures.

Everything is generated here from the seed; nothing is downloaded. On the 2-core development
machine the whole run takes well under an hour at the defaults (the times are in the results).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from coplan import procs  # noqa: E402
from coplan.learn.dataset import open_dataset, write_dataset  # noqa: E402
from coplan.learn.evaluate import evaluate  # noqa: E402
from coplan.learn.jobs import SPLITS  # noqa: E402
from coplan.learn.train import examples, load_policy, save_policy, train  # noqa: E402


def _say(done: int, total: int, what: str) -> None:
    if done == total or done % 25 == 0:
        print(f"  [{done}/{total}] {what}", flush=True)


def _evaluate(data: Path, policy: Path, split: str, limit: int | None) -> dict[str, object]:
    torch.set_num_threads(1)
    net, _ = load_policy(policy)
    t0 = time.perf_counter()
    res = evaluate(open_dataset(data), net, split, limit=limit)
    res["seconds"] = time.perf_counter() - t0
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=800)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--data", type=Path, default=Path("/tmp/coplan-learn"))
    ap.add_argument("--out", type=Path, default=ROOT / "coplan" / "learn" / "policy.pt")
    ap.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results" / "learned.json")
    ap.add_argument("--eval-limit", type=int, default=None, help="jobs per split to evaluate")
    ap.add_argument(
        "--eval-only", action="store_true", help="evaluate the policy in --out on the dataset in --data"
    )
    args = ap.parse_args()

    t0 = time.perf_counter()
    print(f"dataset: {args.n} jobs, seed {args.seed}, into {args.data}", flush=True)
    made = write_dataset(args.data, args.n, args.seed, jobs=args.jobs, progress=_say)
    t_data = time.perf_counter() - t0
    ds = open_dataset(args.data)

    torch.set_num_threads(1)
    if args.eval_only:
        net, meta = load_policy(args.out)
    else:
        t1 = time.perf_counter()
        items = examples(ds, "train")
        net, losses = train(items, epochs=args.epochs, seed=args.seed, progress=_say)
        t_train = time.perf_counter() - t1
        meta = {
            "dataset": {k: ds.manifest[k] for k in ("seed", "n", "teacher", "baseline", "counts")},
            "train_jobs": len(items),
            "epochs": args.epochs,
            "seed": args.seed,
            "losses": losses,
            "seconds": t_train,
        }
        save_policy(net, args.out, meta)
        print(
            f"policy: {len(items)} train jobs, {args.epochs} epochs, {t_train:.0f} s -> {args.out}",
            flush=True,
        )

    # the splits in parallel, one per worker process
    order = ["train", *[s for s in SPLITS if s != "train"]]
    with procs.Pool(max(1, min(args.jobs, len(order)))) as pool:
        futures = {s: pool.submit(_evaluate, args.data, args.out, s, args.eval_limit) for s in order}
        splits = {s: f.result() for s, f in futures.items()}
    for split, res in splits.items():
        s, j = res["vs_sequential"], res["vs_joint"]
        print(
            f"{split:15s} n={res['n']:4d}  vs sequential median {s['median_ratio']}  wins {s['wins']} "
            f"losses {s['losses']}  vs joint-exact median {j['median_ratio']} p90 {j['p90_ratio']}  "
            f"feasible {res['feasible_rate']}  vs random {res['vs_random']}  verdict {res['verdict']}",
            flush=True,
        )
    out = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__},
        "dataset": made.to_dict() | {"seconds": t_data},
        "training": meta,
        "policy_bytes": args.out.stat().st_size,
        "splits": splits,
        "seconds": time.perf_counter() - t0,
    }
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(out, indent=1) + "\n")
    print(f"results -> {args.results} ({out['seconds']:.0f} s in all)")


if __name__ == "__main__":
    main()
