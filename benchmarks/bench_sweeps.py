"""Published sweeps: does the cost model order the layouts and settings of one job as they measured?

    python benchmarks/bench_sweeps.py [--json OUT]

A sweep is a group of published runs of the same job (model, cluster, GPU count, global batch and
sequence) measured under different layouts or settings (TP/PP/microbatch, ZeRO stage, activation
checkpointing, eager or compiled, precision recipe, async TP), from both published-run files
(``benchmarks/data/published_runs.json``, Megatron-LM / NeMo, priced as ``bench_published.py``
does; ``published_stack_runs.json``, the other stacks, each priced with its stack preset as
``bench_stacks.py`` does). For every pair of runs in a group whose measured step times differ by
more than ``TIE`` the predicted order is compared with the measured one; for every group, coplan's
pick (the run it predicts fastest) is compared with the measured fastest: regret is the pick's
measured step time over the best measured one, minus 1.

Prints the share of pairs ordered right, the groups whose pick is the measured fastest, the mean and
worst regret, and each group's rows; writes them to ``benchmarks/results/sweeps.json``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from bench_published import run_one
from bench_stacks import price, stack_of

DATA = Path(__file__).parent / "data"
OUT = Path(__file__).parent / "results" / "sweeps.json"
#: measured step times within this relative difference are a tie: no order to predict
TIE = 0.01


def _key(run: dict) -> tuple:
    m = run["model"]
    return (m["name"], run["cluster"], run["gpus"], run["global_batch"], run["seq"])


#: what describes where a run comes from, not what ran
_PROVENANCE = ("id", "source", "measured", "assumptions", "held_out", "pair")


def _uncited(value: object) -> object:
    """``value`` without its citations (``source``/``sources``/``*_source`` at any depth)."""
    if isinstance(value, dict):
        return {
            k: _uncited(v)
            for k, v in value.items()
            if k not in ("source", "sources") and not k.endswith("_source")
        }
    if isinstance(value, list):
        return [_uncited(v) for v in value]
    return value


def _configuration(run: dict) -> str:
    """What ran, as a comparable string: every field but the provenance and the citations."""
    return json.dumps(_uncited({k: v for k, v in run.items() if k not in _PROVENANCE}), sort_keys=True)


def _row(run: dict, measured: float, predicted: float) -> dict:
    return {
        "id": run["id"],
        "key": _key(run),
        "configuration": _configuration(run),
        "measured_s": measured,
        "predicted_s": predicted,
    }


def _rows() -> list[dict]:
    rows = []
    for run in json.loads((DATA / "published_runs.json").read_text())["runs"]:
        r = run_one(run)
        rows.append(_row(run, r["measured_s"], r["predicted_s"]))
    for run in json.loads((DATA / "published_stack_runs.json").read_text())["runs"]:
        step, *_ = price(run, stack_of(run))
        rows.append(_row(run, run["measured"]["step_time_s"], step))
    return rows


def sweeps(rows: list[dict]) -> list[dict]:
    """The groups of two or more runs of one job, with their pairwise orders and pick."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault(r["key"], []).append(r)
    out = []
    for key, members in sorted(groups.items(), key=lambda kv: str(kv[0])):
        if len(members) < 2:
            continue
        pairs = right = same = 0
        for a, b in itertools.combinations(members, 2):
            if abs(a["measured_s"] / b["measured_s"] - 1) <= TIE:
                continue
            if a["configuration"] == b["configuration"]:
                # one configuration measured twice (on two software releases): no layout or
                # setting differs, so there is no order for the cost model to predict
                same += 1
                continue
            pairs += 1
            # settings the cost model does not tell apart (priced the same) count as ordered wrong
            told = a["predicted_s"] != b["predicted_s"]
            right += told and (a["measured_s"] < b["measured_s"]) == (a["predicted_s"] < b["predicted_s"])
        best = min(members, key=lambda r: r["measured_s"])
        # coplan picks the configuration it predicts fastest; where it prices several the same it
        # cannot tell them apart: the slowest of them measured counts (a configuration measured on
        # several releases counts its best measurement)
        fastest = min(r["predicted_s"] for r in members)
        tied: dict[str, float] = {}
        for r in members:
            if r["predicted_s"] == fastest:
                c = r["configuration"]
                tied[c] = min(tied.get(c, r["measured_s"]), r["measured_s"])
        worst = max(tied.values())
        pick = next(r for r in members if r["predicted_s"] == fastest and tied[r["configuration"]] == worst)
        out.append(
            {
                "job": " ".join(str(k) for k in key),
                "runs": [r["id"] for r in members],
                "pairs": pairs,
                "ordered_right": right,
                "same_configuration": same,
                "measured_fastest": best["id"],
                "predicted_fastest": pick["id"],
                "regret": worst / best["measured_s"] - 1,
            }
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=Path, default=OUT)
    args = ap.parse_args()
    groups = sweeps(_rows())
    pairs = sum(g["pairs"] for g in groups)
    same = sum(g["same_configuration"] for g in groups)
    right = sum(g["ordered_right"] for g in groups)
    regrets = [g["regret"] for g in groups]
    picked = sum(g["measured_fastest"] == g["predicted_fastest"] for g in groups)
    summary = {
        "groups": len(groups),
        "pairs": pairs,
        "ordered_right": right,
        "order_share": right / pairs if pairs else None,
        "picked_fastest": picked,
        "mean_regret": statistics.fmean(regrets) if regrets else None,
        "worst_regret": max(regrets) if regrets else None,
        "same_configuration_pairs": same,
        "tie": TIE,
    }
    for g in groups:
        mark = "" if g["measured_fastest"] == g["predicted_fastest"] else f"  picks {g['predicted_fastest']}"
        print(f"{g['job']:<58} {g['ordered_right']:>3}/{g['pairs']:<3} regret {g['regret']:6.1%}{mark}")
    print(
        f"\n{len(groups)} sweeps, {pairs} measured comparisons: {right} ordered right "
        f"({summary['order_share']:.1%}); the measured fastest picked in {picked}; "
        f"regret mean {summary['mean_regret']:.1%}, worst {summary['worst_regret']:.1%} "
        f"({same} pairs of one configuration measured twice left out)"
    )
    args.json.write_text(json.dumps({"summary": summary, "sweeps": groups}, indent=1) + "\n")


if __name__ == "__main__":
    main()
