"""DeepSpeed's ZeRO-3 runs of Narayanan et al. 2021 split into what grows with the data-parallel
degree and what does not, measured beside priced:

    python benchmarks/data/zero3_split.py

Each model (GPT-3 175B, the 530B model) ran ZeRO-3 at three GPU counts with one microbatch per GPU
a step or more (``published_stack_runs.json``, ``narayanan21-t2-zero3-*``). Its per-GPU
communication volume is the same at every count (each GPU gathers and reduces the whole model),
while the ring's latency and the launched copies per rank grow with the count. For each run the
step less what the ``deepspeed`` preset prices outside ZeRO-3's collectives (compute, recompute,
optimizer) is what the collectives took; a line through the three, ``a + b x GPUs``, splits it
into a part independent of the count (``a``: bytes moved) and one per rank (``b``: latency and
per-rank work), fitted the same way to the priced collectives. Nothing is fitted into the model.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parents[1]))

import bench_stacks  # noqa: E402

MODELS = {"175B": "narayanan21-t2-zero3-175b-", "530B": "narayanan21-t2-zero3-530b-"}


def line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares ``a + b x``."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def table() -> list[dict]:
    runs = json.loads(bench_stacks.DATA.read_text())["runs"]
    out = []
    for name, prefix in MODELS.items():
        gpus, priced, measured = [], [], []
        for run in sorted((r for r in runs if r["id"].startswith(prefix)), key=lambda r: r["gpus"]):
            est = bench_stacks.estimated(run, bench_stacks.stack_of(run))[3]
            comm = est.breakdown_s.get("zero_comm", 0.0)
            rest = est.step_time_s - comm
            gpus.append(float(run["gpus"]))
            priced.append(comm)
            measured.append(run["measured"]["step_time_s"] - rest)
        pa, pb = line(gpus, priced)
        ma, mb = line(gpus, measured)
        out.append(
            {
                "model": name,
                "gpus": gpus,
                "collectives_priced_s": priced,
                "collectives_measured_s": measured,
                "volume_s": [ma, pa],
                "per_rank_ms": [mb * 1e3, pb * 1e3],
            }
        )
    return out


def main() -> None:
    for row in table():
        print(
            f"{row['model']} at {', '.join(str(int(g)) for g in row['gpus'])} GPUs: collectives "
            + ", ".join(
                f"{m:.1f} / {p:.1f} s"
                for m, p in zip(row["collectives_measured_s"], row["collectives_priced_s"], strict=True)
            )
            + " (measured / priced)"
        )
        (ma, pa), (mb, pb) = row["volume_s"], row["per_rank_ms"]
        print(
            f"  independent of the GPU count: {ma:.1f} / {pa:.1f} s ({ma / pa:.2f}x); "
            f"per rank: {mb:.1f} / {pb:.1f} ms ({mb / pb:.2f}x)"
        )


if __name__ == "__main__":
    main()
