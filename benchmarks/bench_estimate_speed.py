"""Speed of the cost model once graphs are built.

    python benchmarks/bench_estimate_speed.py [--count 10000]

1. One estimate of a 1T-parameter GPT (Narayanan et al.'s 128-layer, h=25600) on 3,072 A100s
   (tp 8, pp 64), after its graph is built and profiled: median of 20 calls.
2. A search's worth of estimates: ``--count`` configurations of LLaMA-2 70B on 1,024 H100s
   (tensor/pipeline/data degrees, interleaving, microbatch, recompute, ZeRO, sequence parallelism),
   the graphs of the microbatch sizes built first; total wall time.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

from coplan.cost import ConfigError, CostModel, TrainingConfig
from coplan.hardware import load_cluster
from coplan.models.spec import PRESETS, ModelSpec


def one_trillion() -> dict[str, float]:
    spec = ModelSpec(name="gpt-1t", n_layers=128, d_model=25600, n_heads=160, vocab_size=51200, seq_len=2048)
    cluster = load_cluster("dgx-a100-80gb", 3072)
    config = TrainingConfig(
        tp=8,
        pp=64,
        dp=6,
        microbatch=1,
        global_batch=3072,
        seq=2048,
        recompute="full",
        dtype="fp16",
        flash_attention=False,
    )
    cm = CostModel(spec=spec)
    start = time.perf_counter()
    cm.profile(1, 2048, "megatron")
    build = time.perf_counter() - start
    times, cpu = [], []
    for _ in range(20):
        start, start_cpu = time.perf_counter(), time.process_time()
        cm.estimate(cluster, config)
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return {
        "graph_and_profile_s": build,
        "estimate_median_s": statistics.median(times),
        "estimate_cpu_median_s": statistics.median(cpu),
    }


def search(count: int) -> dict[str, float]:
    spec = PRESETS["llama2-70b"]
    cluster = load_cluster("dgx-h100", 1024)
    cm = CostModel(spec=spec)
    mbs = (1, 2, 4)
    start = time.perf_counter()
    for mb in mbs:
        cm.profile(mb, 4096, "megatron")
    build = time.perf_counter() - start
    grid = itertools.product(
        (1, 2, 4, 8),
        (1, 2, 4, 8, 16),
        (1, 2, 4, 5),
        mbs,
        ("none", "selective", "full"),
        (0, 1, 2, 3),
        (False, True),
    )
    configs = []
    for tp, pp, vpp, mb, rec, zero, sp in grid:
        if (vpp > 1 and pp == 1) or (sp and tp == 1):
            continue
        dp = 1024 // (tp * pp)
        try:
            c = TrainingConfig(
                tp=tp,
                pp=pp,
                dp=dp,
                vpp=vpp,
                microbatch=mb,
                global_batch=4096,
                seq=4096,
                recompute=rec,
                zero=zero,
                sequence_parallel=sp,
            )
            cm.check(cluster, c)
        except ConfigError:
            continue
        configs.append(c)
    configs = (configs * (count // max(1, len(configs)) + 1))[:count]
    start = time.perf_counter()
    best = min(cm.estimate(cluster, c).step_time_s for c in configs)
    wall = time.perf_counter() - start
    return {
        "graphs_s": build,
        "estimates": len(configs),
        "distinct": len(set(configs)),
        "total_s": wall,
        "per_estimate_ms": wall / len(configs) * 1e3,
        "best_step_s": best,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--count", type=int, default=10_000)
    args = ap.parse_args()
    t = one_trillion()
    print(
        f"1T GPT on 3,072 A100 (tp8 pp64): graph+profile {t['graph_and_profile_s']:.2f} s, "
        f"one estimate {t['estimate_median_s'] * 1e3:.1f} ms (median of 20; "
        f"{t['estimate_cpu_median_s'] * 1e3:.1f} ms of CPU time)"
    )
    s = search(args.count)
    print(
        f"LLaMA-2 70B on 1,024 H100: {s['estimates']:,} estimates ({s['distinct']} distinct configurations) "
        f"in {s['total_s']:.1f} s = {s['per_estimate_ms']:.2f} ms each (graphs for 3 microbatch sizes: "
        f"{s['graphs_s']:.1f} s)"
    )


if __name__ == "__main__":
    main()
