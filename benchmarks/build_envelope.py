"""Builds the validated envelope (``coplan/cost/envelope.json``) from the published runs and their results.

    python benchmarks/build_envelope.py [--check]

Reads the Megatron-stack runs (``data/published_runs.json``, priced by ``bench_published.py`` into
``results/published.json``) and the other stacks' runs (``data/published_stack_runs.json``, priced
by ``bench_stacks.py`` into ``results/published_stacks.json``, which also prices the runs of other
stacks kept with Megatron's, MT-NLG's Megatron-DeepSpeed, with their own preset: they enter so). A
stack is validated on a device where at least ``MIN_RUNS`` (10) of its runs there are priced within
the accuracy bar (``BAR``: mean absolute step-time error at most 10%). The runs of those (stack,
device) pairs bound the envelope: devices, dtypes per device, the largest TP / PP / VPP / CP / DP /
GPU count, each ZeRO stage with the largest GPU count it was run at, the highest predicted MFU
(16-bit dense peak) per dtype, the sequence and model-size ranges, whether any ran FSDP's hybrid
sharding (HSDP), the recompute modes and the kernels (fusion) they were priced with; a run of such a
pair priced more than ``WORST`` (20%) off bounds nothing. Every run is kept, compactly, for the
nearest-run search of ``coplan.cost.envelope``. ``--check`` exits 1 when the committed file differs
from what this script builds (the unit tests check the same).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

from coplan.cost import TrainingConfig
from coplan.hardware import load_cluster
from coplan.models.spec import ModelSpec

ROOT = Path(__file__).resolve().parent
OUT = ROOT.parent / "coplan" / "cost" / "envelope.json"
#: The accuracy bar a (stack, device) pair's published runs must meet to count as validated.
BAR = 0.10
#: Fewer runs than this on a (stack, device) pair validate nothing, whatever their error: two or four
#: runs of one recipe can land within the bar by chance (torchtitan-compile's 2 H200 runs do, at 9%,
#: while its 27 H100 runs average 26%).
MIN_RUNS = 10
#: A run priced further than this from its measurement extends no bound of a validated stack: what
#: it reached (a sequence, a CP degree, a scale) is where the model was checked and found wrong, not
#: validated. It still counts in its pair's mean error and is kept for the nearest-run search.
WORST = 0.20
#: The data's stack names as ``--stack`` presets name them (published_runs.json says "megatron-lm").
STACK_NAMES = {"megatron-lm": "megatron"}


def _device(cluster: str, gpus: int) -> str:
    devices = sorted({d.name for d in load_cluster(cluster, gpus).devices})
    return "+".join(devices)


def _fusion_default() -> str:
    """The kernels bench_published.py prices every run with: TrainingConfig's default fusion."""
    return next(f.default for f in fields(TrainingConfig) if f.name == "fusion")


def _run_row(run: dict, stack: str, mfu: float | None, error: float) -> dict[str, Any]:
    model = {k: v for k, v in run["model"].items() if v is not None}
    spec = ModelSpec(**model)
    return {
        "id": run["id"],
        "stack": stack,
        "device": _device(run["cluster"], run["gpus"]),
        "dtype": run["dtype"],
        "gpus": run["gpus"],
        "params": spec.param_count(),
        "moe": spec.is_moe,
        "seq": run["seq"],
        "tp": run["tp"],
        "pp": run["pp"],
        "vpp": run["vpp"],
        "cp": run.get("cp", 1),
        "dp": run["gpus"] // (run["tp"] * run.get("cp", 1) * run["pp"]),
        "zero": run["zero"],
        "recompute": run["recompute"],
        # FSDP's hybrid sharding (sharded within a node, replicated across): only where a run used it
        **({"hsdp": True} if run.get("stack_settings", {}).get("sharding") == "HYBRID_SHARD" else {}),
        "mfu": None if mfu is None else round(mfu, 4),
        "error": round(error, 4),
    }


def _rows() -> list[dict[str, Any]]:
    megatron = json.loads((ROOT / "data" / "published_runs.json").read_text())["runs"]
    priced = {r["id"]: r for r in json.loads((ROOT / "results" / "published.json").read_text())["rows"]}
    results = {
        r["id"]: r for r in json.loads((ROOT / "results" / "published_stacks.json").read_text())["runs"]
    }
    rows = []
    for run in megatron:
        if run["id"] in results:
            continue  # another stack's run kept with Megatron's (MT-NLG): priced with its preset, below
        res = priced[run["id"]]
        stack = STACK_NAMES.get(res["stack"], res["stack"])
        rows.append(_run_row(run, stack, res["mfu"], res["error"]))
    others = json.loads((ROOT / "data" / "published_stack_runs.json").read_text())["runs"]
    others += [run for run in megatron if run["id"] in results]
    for run in others:
        res = results[run["id"]]
        # the stack as coplan prices it (the preset, compiled or not), not the data's family name
        rows.append(_run_row(run, res["preset"], res["priced"].get("mfu"), res["priced"]["error"]))
    return sorted(rows, key=lambda r: r["id"])


def _pairs(rows: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Each stack's accuracy per device: runs, mean absolute error, signed error range, validated."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for stack in sorted({r["stack"] for r in rows}):
        out[stack] = {}
        for device in sorted({r["device"] for r in rows if r["stack"] == stack}):
            errs = [r["error"] for r in rows if r["stack"] == stack and r["device"] == device]
            mean_abs = statistics.fmean(abs(e) for e in errs)
            out[stack][device] = {
                "runs": len(errs),
                "mean_abs_error": round(mean_abs, 4),
                "error_range": [min(errs), max(errs)],
                "validated": mean_abs <= BAR and len(errs) >= MIN_RUNS,
            }
    return out


def build() -> dict[str, Any]:
    rows = _rows()
    pairs = _pairs(rows)
    inside = [r for r in rows if pairs[r["stack"]][r["device"]]["validated"] and abs(r["error"]) <= WORST]
    stacks = sorted({r["stack"] for r in inside})
    return {
        "about": (
            "The configurations coplan's cost model was checked on: published runs whose (stack, device) "
            f"pair has at least {MIN_RUNS} runs priced within mean absolute step-time error {BAR:.0%}, "
            f"bounded by those of its runs priced within {WORST:.0%}. "
            "Built by "
            "benchmarks/build_envelope.py from benchmarks/data/published_runs.json, "
            "benchmarks/data/published_stack_runs.json and their results; do not edit."
        ),
        "bar_mean_abs_error": BAR,
        "min_runs": MIN_RUNS,
        "stacks": pairs,
        # every validated run's bounds (what a stack with no validated runs is compared with), and
        # each validated stack's own
        "envelope": _bounds(inside),
        "by_stack": {s: _bounds([r for r in inside if r["stack"] == s]) for s in stacks},
        "scale_trend": _scale_trend(),
        "runs": rows,
    }


def _scale_trend() -> dict[str, Any]:
    """How the Megatron-LM runs' error moves per doubling of the GPUs within a series
    (``bench_published.scale_trend``, in ``results/published.json``): a caution for plans far above
    the validated runs' scale (``coplan.cost.envelope``)."""
    t = json.loads((ROOT / "results" / "published.json").read_text())["scale_trend"]
    return {
        "per_doubling": round(t["mean_slope"], 4),
        "series": t["series"],
        "runs": t["runs"],
        "more_negative": t["negative"],
    }


def _bounds(inside: list[dict[str, Any]]) -> dict[str, Any]:
    """What the runs ``inside`` reach, dimension by dimension."""
    stacks = sorted({r["stack"] for r in inside})
    zero: dict[str, int] = {}
    mfu: dict[str, float] = {}
    dtypes: dict[str, list[str]] = {}
    for r in inside:
        zero[str(r["zero"])] = max(zero.get(str(r["zero"]), 0), r["gpus"])
        if r["mfu"] is not None:
            mfu[r["dtype"]] = max(mfu.get(r["dtype"], 0.0), r["mfu"])
        dtypes.setdefault(r["device"], [])
        if r["dtype"] not in dtypes[r["device"]]:
            dtypes[r["device"]].append(r["dtype"])
    return {
        "stacks": stacks,
        "devices": sorted(dtypes),
        "dtypes": {d: sorted(v) for d, v in sorted(dtypes.items())},
        "max": {k: max(r[k] for r in inside) for k in ("tp", "pp", "vpp", "cp", "dp", "gpus")},
        "zero": dict(sorted(zero.items())),
        "mfu_max": dict(sorted(mfu.items())),
        "seq": [min(r["seq"] for r in inside), max(r["seq"] for r in inside)],
        "params": [min(r["params"] for r in inside), max(r["params"] for r in inside)],
        "moe": any(r["moe"] for r in inside),
        "hsdp": any(r.get("hsdp", False) for r in inside),
        "recompute": sorted({r["recompute"] for r in inside}),
        "fusion": [_fusion_default()],
        "runs": len(inside),
    }


def render(data: dict[str, Any]) -> str:
    """The file's text: indented, one run per line (the runs are most of it)."""
    head = json.dumps({k: v for k, v in data.items() if k != "runs"}, indent=1)
    runs = ",\n".join("  " + json.dumps(r) for r in data["runs"])
    return head[:-2] + ',\n "runs": [\n' + runs + "\n ]\n}\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the committed file is stale")
    args = ap.parse_args()
    text = render(build())
    if args.check:
        if OUT.read_text() != text:
            print(f"{OUT} is stale: run python benchmarks/build_envelope.py", file=sys.stderr)
            sys.exit(1)
        return
    OUT.write_text(text)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
