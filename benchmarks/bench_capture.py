"""Capture and synthetic-build benchmarks. Prints the Markdown table of docs/graphs.md.

    python benchmarks/bench_capture.py [--repeat 3]

Times are wall-clock seconds on the machine it runs on, median of ``--repeat`` runs in one process
(the first capture of a process also pays PyTorch's one-off warm-up, reported separately).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable

import torch

from coplan.capture.api import capture_spec
from coplan.capture.synthetic import build_graph
from coplan.ir.checker import check
from coplan.ir.types import Graph
from coplan.models.spec import PRESETS

CASES: list[tuple[str, str, int, int, str]] = [
    # (label, preset, batch, seq, how)
    ("GPT-2 124M capture", "gpt2-124m", 1, 1024, "capture"),
    ("LLaMA-2 7B capture", "llama2-7b", 1, 4096, "capture"),
    ("GPT-2 124M synthetic", "gpt2-124m", 1, 1024, "synthetic"),
    ("LLaMA-2 7B synthetic", "llama2-7b", 1, 4096, "synthetic"),
    ("1T (Megatron 128 layers) synthetic", "megatron-1t", 1, 2048, "synthetic"),
]


def _run(how: str, preset: str, batch: int, seq: int) -> tuple[float, Graph]:
    build: Callable[..., Graph] = capture_spec if how == "capture" else build_graph
    t0 = time.perf_counter()
    g = build(PRESETS[preset], batch, seq)
    return time.perf_counter() - t0, g


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    first, _ = _run("capture", "gpt-tiny", 1, 64)
    print(
        f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}; first capture in a process (warm-up): {first:.2f} s\n"
    )
    print("| case | params | ops | tensors | median s | min s | checker |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for label, preset, batch, seq, how in CASES:
        times, g = [], None
        for _ in range(args.repeat):
            dt, g = _run(how, preset, batch, seq)
            times.append(dt)
        assert g is not None
        ok = "valid" if not check(g) else "INVALID"
        print(
            f"| {label} (batch {batch}, seq {seq}) | {g.param_count / 1e6:,.1f}M | {len(g.ops):,} | "
            f"{len(g.tensors):,} | {statistics.median(times):.2f} | {min(times):.2f} | {ok} |"
        )


if __name__ == "__main__":
    main()
