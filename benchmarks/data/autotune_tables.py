"""Inductor's GEMM autotuning tables, read from a run's log into JSON: for each GEMM it tuned, the
library call's time (cuBLAS, ``mm``), the best Triton template's, the rate each reached and the
template's speed as a fraction of the library's. What a GPU's generated GEMMs achieve beside the
library's, for the cost model's pricing of a GEMM whose epilogue a plan fuses (only a template can
carry one):

    python benchmarks/data/autotune_tables.py RUN.log --device "NVIDIA H200" --torch 2.11.0+cu130 > OUT.json

The tables are the ones ``torch._inductor`` prints under ``max_autotune`` (``AUTOTUNE mm(MxK, KxN)``,
then one line per choice: name, milliseconds, percent of the best).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

HEADER = re.compile(r"AUTOTUNE (\w+)\((\d+)x(\d+), (\d+)x(\d+)\)")
CHOICE = re.compile(r"\s+(\S+) ([0-9.]+) ms")
LIBRARY = ("mm", "addmm", "bias_addmm")


def tables(text: str) -> list[dict[str, object]]:
    lines = text.splitlines()
    rows: list[dict[str, object]] = []
    for i, line in enumerate(lines):
        head = HEADER.match(line)
        if head is None:
            continue
        op = head.group(1)
        m, k, _, n = (int(g) for g in head.groups()[1:])
        strides = lines[i + 1].removeprefix("strides: ").strip() if i + 1 < len(lines) else ""
        times: dict[str, float] = {}
        for nxt in lines[i + 2 :]:
            if nxt.startswith("dtypes:"):
                continue
            got = CHOICE.match(nxt)
            if got is None:
                break
            times[got.group(1)] = float(got.group(2))
        library = min((t for name, t in times.items() if name in LIBRARY), default=None)
        template = min((t for name, t in times.items() if name.startswith("triton_")), default=None)
        if library is None or template is None:
            continue
        flops = 2.0 * m * k * n
        rows.append(
            {
                "op": op,
                "m": m,
                "k": k,
                "n": n,
                "strides": strides,
                "library_ms": library,
                "template_ms": template,
                "library_tflops": flops / library / 1e9,
                "template_tflops": flops / template / 1e9,
                "template_over_library": library / template,
            }
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log", type=Path)
    ap.add_argument("--device", required=True)
    ap.add_argument("--torch", required=True)
    args = ap.parse_args()
    rows = tables(args.log.read_text(errors="replace"))
    if not rows:
        raise SystemExit(f"{args.log}: no AUTOTUNE tables with a library and a template choice")
    ratios = [float(r["template_over_library"]) for r in rows]  # type: ignore[arg-type]
    out = {
        "device": args.device,
        "torch": args.torch,
        "source": str(args.log.name),
        "gemms": rows,
        "template_over_library_median": statistics.median(ratios),
        "template_over_library_range": [min(ratios), max(ratios)],
    }
    json.dump(out, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
