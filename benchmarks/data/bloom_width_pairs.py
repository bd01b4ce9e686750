"""The A100's ``bmm_unaligned``, read off BigScience's trials of BLOOM's widths.

    python benchmarks/data/bloom_width_pairs.py

BigScience timed Megatron-DeepSpeed on Jean Zay's A100 80GB nodes at several widths in the same
layout (``bigscience-workshop/bigscience@9e64edec2a train/tr11-176B-ml/chronicles-prequel.md``,
sections "tile and wave quantization" and "NHEADs comparison"; seconds per iteration at iteration 2,
global batch 2,048 of 2,048 tokens). Two pairs differ in whether the head dimension is a multiple of
8 elements: the unfused attention's batched GEMMs then load unaligned operands
(``coplan.cost.kernels``). The cost model prices each pair's other differences itself; this script
prices the pairs at each candidate ``bmm_unaligned`` (the unaligned fraction of these batched GEMMs,
whose misaligned operand is the short head dimension) and prints the squared log error of the two
step-time ratios. The device presets carry the minimiser, rounded.
"""

from __future__ import annotations

import copy
import json
import math
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))

import bench_stacks

RUNS = Path(__file__).parent / "published_stack_runs.json"
#: the run whose recipe the trials share (Megatron-DeepSpeed, bf16, TP 8, MBS 1, full recompute)
BASE = "bloom-prequel-200b-160gpu-bf16"
#: (name, changes to the base run, measured seconds per iteration); pairs below
TRIALS = [
    (
        "14400 / 64 heads, 40 nodes PP10",
        {"d_model": 14400, "n_heads": 64, "gpus": 320, "n_layers": 80},
        221.21,
    ),
    (
        "13824 / 64 heads, 40 nodes PP10",
        {"d_model": 13824, "n_heads": 64, "gpus": 320, "n_layers": 80},
        160.29,
    ),
    (
        "13824 / 128 heads, 48 nodes PP6",
        {"d_model": 13824, "n_heads": 128, "gpus": 384, "pp": 6, "n_layers": 78, "microbatch": 4},
        162.72,
    ),
    (
        "13824 / 64 heads, 48 nodes PP6",
        {"d_model": 13824, "n_heads": 64, "gpus": 384, "pp": 6, "n_layers": 78, "microbatch": 4},
        121.28,
    ),
]
PAIRS = [(0, 1), (2, 3)]


def trial(base: dict, changes: dict) -> dict:
    run = copy.deepcopy(base)
    run.pop("stage_layers", None)  # an even split of the layers, as 'type:transformer' gives
    for key, value in changes.items():
        (run["model"] if key in run["model"] else run)[key] = value
    return run


def priced(unaligned: float) -> list[float]:
    """Seconds per iteration of each trial with the A100's ``bmm_unaligned`` at ``unaligned``."""
    load = bench_stacks.load_cluster

    def with_factor(name: str, gpus: int):  # type: ignore[no-untyped-def]
        cluster = load(name, gpus)
        groups = []
        for g in cluster.groups:
            eff = dict(g.device.efficiency, bmm_unaligned=unaligned)
            groups.append(replace(g, device=replace(g.device, efficiency=eff)))
        return replace(cluster, groups=tuple(groups))

    base = next(r for r in json.loads(RUNS.read_text())["runs"] if r["id"] == BASE)
    bench_stacks.load_cluster = with_factor
    try:
        return [bench_stacks.price(trial(base, ch), "deepspeed")[0] for _, ch, _ in TRIALS]
    finally:
        bench_stacks.load_cluster = load


def main() -> None:
    best = None
    for i in range(10, 21):
        u = i / 100
        times = priced(u)
        errors = [math.log((times[a] / times[b]) / (TRIALS[a][2] / TRIALS[b][2])) for a, b in PAIRS]
        sq = sum(e * e for e in errors)
        ratios = "  ".join(
            f"{TRIALS[a][0].split(',')[0]} vs {TRIALS[b][0].split(',')[0]}: "
            f"{times[a] / times[b]:.3f} (measured {TRIALS[a][2] / TRIALS[b][2]:.3f})"
            for a, b in PAIRS
        )
        print(f"bmm_unaligned {u:.2f}  squared log error {sq:.5f}  {ratios}")
        if best is None or sq < best[1]:
            best = (u, sq)
    assert best is not None
    print(f"minimiser on this grid: {best[0]:.2f}")


if __name__ == "__main__":
    main()
