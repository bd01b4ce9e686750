"""Whether a GPU's GEMM rate holds under sustained load: the probe of the cost model's one
unexplained gap on GPUs (docs/stacks.md, "A step on one GPU"): on one H200 cuBLAS ran a short
step's GEMMs 15% faster than the GEMM curve fitted to published multi-hour runs, and the published
PyTorch-native runs price 10-20% too fast. If a GPU's clocks fall under minutes of dense GEMMs (its
power cap, its temperature), short single-GPU measurements and long jobs see different GEMM rates.

    python benchmarks/data/gpu_sustained_probe.py [--seconds 60] [--size 8192] > sustained.json
    python benchmarks/data/gpu_sustained_probe.py --dry-run      # this CPU, two seconds: plumbing only

Runs back-to-back bf16 GEMMs of ``--size`` cubed for ``--seconds`` and records, per window of
about half a second, the GEMM rate (CUDA events over the window's calls) beside what
``nvidia-smi`` reports at the window's end: SM clock, power draw, power limit, temperature and
its throttle reasons. Prints one JSON object: the device, the windows, and the first and last
ten seconds' median rates, clocks and power.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch

QUERY = "clocks.sm,power.draw,power.limit,temperature.gpu,clocks_throttle_reasons.active"


def smi() -> dict[str, str]:
    """One reading of the GPU's clocks, power and temperature ({} where nvidia-smi is absent)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-i", "0"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return {}
    return dict(zip(QUERY.split(","), (v.strip() for v in out.split(",")), strict=False))


def windows(seconds: float, size: int, device: str, window_s: float = 0.5) -> list[dict]:
    """Back-to-back ``size``-cubed GEMMs for ``seconds``, timed per window of ``window_s``."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    flops = 2.0 * size**3
    for _ in range(3):  # warm-up: cuBLAS's heuristic and workspace
        a @ b
    if device == "cuda":
        torch.cuda.synchronize()
    out: list[dict] = []
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        calls = 0
        t0 = time.perf_counter()
        if device == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
        while time.perf_counter() - t0 < window_s:
            a @ b
            calls += 1
            if device == "cuda" and calls % 8 == 0:
                torch.cuda.synchronize()  # keep the host within a few calls of the device
        if device == "cuda":
            end.record()
            torch.cuda.synchronize()
            elapsed = begin.elapsed_time(end) / 1e3
        else:
            elapsed = time.perf_counter() - t0
        row = {"t_s": round(time.perf_counter() - start, 3), "calls": calls}
        row["tflops"] = calls * flops / elapsed / 1e12
        row.update(smi() if device == "cuda" else {})
        out.append(row)
    return out


def summary(rows: list[dict], span_s: float = 10.0) -> dict:
    """Median rate (and clock and power, where read) over the first and the last ``span_s``."""
    end = rows[-1]["t_s"] if rows else 0.0

    def med(sel: list[dict], key: str) -> float | None:
        vals = []
        for r in sel:
            try:
                vals.append(float(r[key]))
            except (KeyError, ValueError):
                continue
        return statistics.median(vals) if vals else None

    out = {}
    for name, sel in (
        ("first", [r for r in rows if r["t_s"] <= span_s]),
        ("last", [r for r in rows if r["t_s"] >= end - span_s]),
    ):
        out[name] = {k: med(sel, k) for k in ("tflops", "clocks.sm", "power.draw", "temperature.gpu")}
    first, last = out["first"]["tflops"], out["last"]["tflops"]
    out["last_over_first"] = last / first if first and last else None
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--size", type=int, default=8192)
    ap.add_argument("--dry-run", action="store_true", help="two seconds of CPU GEMMs: the plumbing only")
    args = ap.parse_args()
    if args.dry_run:
        device, seconds, size = "cpu", 2.0, 256
    elif not torch.cuda.is_available():
        print("gpu_sustained_probe: no CUDA device (use --dry-run on a CPU)", file=sys.stderr)
        raise SystemExit(2)
    else:
        device, seconds, size = "cuda", args.seconds, args.size
    rows = windows(seconds, size, device)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    result = {
        "device": name,
        "torch": torch.__version__,
        "size": size,
        "seconds": seconds,
        "summary": summary(rows),
        "windows": rows,
    }
    print(json.dumps(result, indent=1))
    s = result["summary"]
    dtype = "bf16" if device == "cuda" else "fp32"
    print(
        f"{name}: {size}^3 {dtype} GEMMs for {seconds:.0f} s: first 10 s "
        f"{s['first']['tflops']:.1f} TFLOP/s, last 10 s {s['last']['tflops']:.1f} "
        f"(x{s['last_over_first'] or 0:.3f})",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
