"""Cost model against published, measured step times of large training runs.

    python benchmarks/bench_published.py [--runs RUNS.json] [--json OUT] [--contract] [--markdown]

Each run in the data file names its model (with its dropout probabilities), cluster preset,
parallel layout (with ``stage_layers`` where the source's recipe splits layers unevenly), batch,
recompute, precision, attention kernel (``attention``: the fused kernel its stack ran, with the
evidence), the stack's loss kernels (``loss_fusion``), pipeline-send
and gradient-reduction settings (``overlap.p2p``, ``grad_reduce_fp32``), fp8 primary weights
(``fp8_params``), an eagerly run MLP activation (``activation_fusion``), the Transformer Engine
userbuffers settings its recipe tunes (``ub_cfg``, slot -> method, num_sm, num_splits,
set_sm_margin; absent: TE's defaults), data-parallel buffers registered with NCCL (``nccl_ub``),
and the step time its
source measured. The same device presets price every run (one
profile per device, nothing fitted per run). Prints a table and the mean and worst absolute error
(Megatron-Core stacks, all and on the A100/H100 clusters the accuracy target names, and newer GPUs
apart; other stacks; the runs added after the model and priced unchanged; all);
``--json`` writes the rows. ``--contract`` prices each run as `coplan estimate` would from its
contract flags alone (parallel layout, batch, sequence, recompute, ZeRO, dtype, flash attention;
the model without dropout; overlaps, loss kernels and gradient precision at the CLI's defaults):
what a user, or a check, who knows only those gets. ``--markdown`` ends with the table by source
of docs/cost-model.md.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

from coplan.cost import CostModel, TrainingConfig
from coplan.cost.config import production_overlaps
from coplan.cost.tp_overlap import read_ub_cfg
from coplan.hardware import ClusterSpec, load_cluster
from coplan.models.spec import ModelSpec

DATA = Path(__file__).parent / "data" / "published_runs.json"

#: Cluster presets of the GPUs the published-run accuracy target names (A100 and H100).
SCOPE = ("dgx-a100", "dgx-h100")


#: docs/cost-model.md's table by source: (run id prefix, description), in the order shown.
SOURCES = (
    ("narayanan21", "Narayanan et al. 2021, Tables 1 and 2 (Megatron-LM, fp16)"),
    ("megatron21", "Megatron-LM README, GPT-3 175B (Jan 2021)"),
    ("korthikanti22", "Korthikanti et al. 2022, Table 5 and abstract"),
    ("nemo22", "NeMo-Megatron launcher README, Jul 2022 (5B, 175B at 1,024 GPUs)"),
    ("nemolauncher2207", "the same two tables, their other columns"),
    ("nemolauncher2209", "the launcher README's Sep 2022 tables (5B, 175B; 175B re-derived, see below)"),
    ("nemolauncherci2209", "the launcher's release-perf CI step times, GPT-3 175B, Sep 2022"),
    ("mtnlg", "MT-NLG 530B (Megatron-DeepSpeed: another stack)"),
    ("megatron24", "Megatron-LM README model table and strong scaling (Megatron-Core r0.8)"),
    ("nemolauncher2403", "NeMo launcher H100 FP8 table, Mar 2024"),
    ("nemolongseq2403", "NeMo long-sequence page, LLaMA-2 7B at 4K-16K, CP 1 (NeMo 24.03)"),
    ("nemolongseqcp2403", "the same page, 32K to 1M tokens, CP 2 to 32"),
    ("nemolauncher2404", "the same table, Apr 2024"),
    ("nemolauncher2406", "the same table, NeMo 24.05"),
    ("nemo2407", "NeMo 24.07 performance summary (FP8)"),
    ("dgxc2411", "DGX Cloud benchmarks v24.11.1 (NeMo 24.05 / 24.09)"),
    ("dgxc2502", "DGX Cloud benchmarks v25.02.02 (NeMo 24.09 / 24.12)"),
    ("dgxc2504", "DGX Cloud benchmarks v25.04.02 (NeMo 25.02)"),
    ("dgxc2505", "DGX Cloud benchmarks v25.05.05 (NeMo 25.04)"),
    ("nemo2502", "NeMo 25.02 performance summary, GPT-3 175B"),
    ("mbridge", "Megatron-Bridge performance tables, 25.09 to 26.04"),
)


#: What `coplan estimate`'s contract flags say of a run (``--contract``); everything else is left to
#: the CLI's defaults: the model spec without dropout, overlaps as ``production_overlaps`` decides.
CONTRACT_MODEL_FIELDS = ("hidden_dropout", "attention_dropout")


def contract_config(run: dict, cluster: ClusterSpec) -> TrainingConfig:
    """The configuration `coplan estimate` builds from the run's contract flags alone."""
    return TrainingConfig(
        **_contract_fields(run),
        **production_overlaps(cluster.devices, run["tp"], run["sequence_parallel"], run["zero"]),
    )


def run_config(run: dict) -> TrainingConfig:
    """The configuration the run's source describes: its contract flags and its stack's settings."""
    overlap = run.get("overlap", {})
    buckets = run.get("dp_buckets", {})
    return TrainingConfig(
        **_contract_fields(run),
        overlap_grad_reduce=overlap.get("grad_reduce", True),
        overlap_param_gather=overlap.get("param_gather", False),
        tp_comm_overlap=overlap.get("tp_comm", False),
        # the recipe's userbuffers settings where it tunes them (TE's defaults otherwise), read as
        # `coplan estimate --tp-overlap-cfg` reads them
        tp_overlap_cfg=read_ub_cfg(run.get("ub_cfg", {})),
        # Megatron's cross-entropy kernels as the run's recipe selects them (coplan/cost/loss.py)
        loss_fusion=run.get("loss_fusion", "none"),
        overlap_p2p=overlap.get("p2p", True),
        grad_reduce_fp32=run.get("grad_reduce_fp32", True),
        # fp8 primary weights where the recipe sets them (NeMo ``fp8_params``, ``--fp8-param-gather``)
        fp8_params=run.get("fp8_params", False),
        # the MLP activation op by op where the stack runs it eagerly (NeMo 2.x's squared ReLU)
        activation_fusion=run.get("activation_fusion", True),
        # an uneven pipeline layout, in virtual-stage order, where the source's recipe gives one
        stage_layers=tuple(run["stage_layers"]) if run.get("stage_layers") else None,
        # the stack's gradient buckets (coplan/cost/buckets.py): Megatron-Core's rule unless the
        # run's optimizer buckets otherwise (Apex's distributed Adam, PyTorch DDP, local DDP)
        dp_bucket_params=buckets.get("params"),
        dp_bucket_scope=buckets.get("scope", "megatron-core"),
        # the fused-attention kernel the run's stack ran where it is not the device profile's
        # (Transformer Engine with NVTE_FUSED_ATTN=0 runs FlashAttention-2 on Hopper)
        attention_kernel=run.get("attention", {}).get("kernel", "auto"),
        # data-parallel buffers registered with NCCL where the recipe sets ``nccl_ub``
        nccl_ub=run.get("nccl_ub", False),
    )


def _contract_fields(run: dict) -> dict:
    return {
        "tp": run["tp"],
        "pp": run["pp"],
        "cp": run.get("cp", 1),
        "dp": run["gpus"] // (run["tp"] * run.get("cp", 1) * run["pp"]),
        "vpp": run["vpp"],
        "microbatch": run["microbatch"],
        "global_batch": run["global_batch"],
        "seq": run["seq"],
        "recompute": run["recompute"],
        "sequence_parallel": run["sequence_parallel"],
        "zero": run["zero"],
        "dtype": run["dtype"],
        "flash_attention": run["flash_attention"],
    }


def run_one(run: dict, contract: bool = False) -> dict:
    model = {k: v for k, v in run["model"].items() if v is not None}
    if contract:
        model = {k: v for k, v in model.items() if k not in CONTRACT_MODEL_FIELDS}
    spec = ModelSpec(**model)
    cluster = load_cluster(run["cluster"], run["gpus"])
    config = contract_config(run, cluster) if contract else run_config(run)
    start = time.perf_counter()
    est = CostModel(spec=spec).estimate(cluster, config)
    wall = time.perf_counter() - start
    measured = run["measured"]["step_time_s"]
    return {
        "id": run["id"],
        "stack": run.get("stack", "megatron-lm"),
        "held_out": run.get("held_out"),
        "gpus": run["gpus"],
        "cluster": run["cluster"],
        "layout": f"tp{run['tp']} pp{run['pp']}"
        + (f" cp{run['cp']}" if run.get("cp", 1) > 1 else "")
        + f" v{run['vpp']} mb{run['microbatch']} gb{run['global_batch']}",
        "measured_s": measured,
        "predicted_s": est.step_time_s,
        "error": est.step_time_s / measured - 1,
        "mfu": est.mfu,
        "fits": est.fits,
        "breakdown_s": dict(est.breakdown_s),
        "estimate_wall_s": wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=Path, default=DATA)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument(
        "--contract",
        action="store_true",
        help="price each run from `coplan estimate`'s contract flags alone (CLI defaults for the rest)",
    )
    ap.add_argument("--markdown", action="store_true", help="end with docs/cost-model.md's table by source")
    args = ap.parse_args()
    runs = json.loads(args.runs.read_text())["runs"]
    rows = [run_one(r, args.contract) for r in runs]
    w = max(len(r["id"]) for r in rows)
    print(f"{'run':{w}} {'GPUs':>5} {'layout':28} {'measured':>9} {'predicted':>9} {'error':>7} {'MFU':>5}")
    for r in rows:
        print(
            f"{r['id']:{w}} {r['gpus']:5d} {r['layout']:28} {r['measured_s']:9.3f} {r['predicted_s']:9.3f} "
            f"{r['error']:+7.1%} {r['mfu']:5.1%}{'' if r['fits'] else '  (does not fit)'}"
        )
    summary = {}
    # coplan prices Megatron-LM's schedule and kernels; runs of other stacks are reported apart
    # the accuracy target is stated for A100 and H100 clusters; newer GPUs are shown apart
    scoped = [r for r in rows if r["cluster"].startswith(SCOPE)]
    for label, subset in (
        ("megatron-lm", [r for r in rows if r["stack"] == "megatron-lm"]),
        ("megatron-lm A100/H100", [r for r in scoped if r["stack"] == "megatron-lm"]),
        ("megatron-lm newer GPUs", [r for r in rows if r["stack"] == "megatron-lm" and r not in scoped]),
        ("other stacks", [r for r in rows if r["stack"] != "megatron-lm"]),
        # runs added after the cost model and priced as it stood (the data's ``held_out``)
        ("held out", [r for r in rows if r["held_out"]]),
        ("held out A100/H100", [r for r in scoped if r["held_out"]]),
        ("all", rows),
    ):
        if not subset:
            continue
        summary[label] = _stats(subset)
        _print_stats(label, summary[label])
    # per source table (the id's first word: a paper, a README's table, a benchmark release), where
    # a table's weak-scaling columns share one error: the sources weigh unequally in the groups above
    by_source: dict[str, list[dict]] = {}
    for r in scoped:
        by_source.setdefault(f"{r['id'].split('-')[0]} {r['cluster']}", []).append(r)
    print("\nper source (A100/H100):")
    sources = {label: _stats(subset) for label, subset in sorted(by_source.items())}
    for label, s in sources.items():
        _print_stats(label, s)
    trend = scale_trend(runs, rows)
    print(
        f"\nscale trend: {trend['series']} series of one configuration on several GPU counts "
        f"({trend['runs']} runs); the error moves {trend['mean_slope']:+.2%} per doubling of the GPUs "
        f"on average (median {trend['median_slope']:+.2%}; {trend['negative']} of {trend['series']} "
        "series more negative at scale)"
    )
    if args.json:
        out = {"summary": summary, "by_source": sources, "scale_trend": trend, "rows": rows}
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    if args.markdown:
        print()
        print(markdown_table(scoped))


def scale_trend(runs: list[dict], rows: list[dict]) -> dict:
    """How the Megatron-LM runs' step-time error moves with the GPU count within a series (one
    source's runs of one model, layout, microbatch, sequence, recomputation and dtype on several
    GPU counts, weak or strong scaling): the least-squares slope of each series' errors on
    ``log2(GPUs)``, and their mean and median over the series. A cost model that prices what a
    job waits for at scale would show no slope; a negative one is measured steps slowing with scale
    beyond what is priced (stragglers, jitter, network contention)."""
    series: dict[tuple, list[tuple[float, float]]] = {}
    for run, row in zip(runs, rows, strict=True):
        if row["stack"] != "megatron-lm":
            continue
        key = (
            run["id"].split("-")[0],
            run["cluster"],
            json.dumps(run["model"], sort_keys=True),
            run["tp"],
            run["pp"],
            run.get("vpp", 1),
            run.get("cp", 1),
            run["microbatch"],
            run["seq"],
            run.get("recompute"),
            run.get("dtype"),
        )
        series.setdefault(key, []).append((math.log2(run["gpus"]), row["error"]))
    slopes = []
    counted = 0
    for points in series.values():
        xs = [x for x, _ in points]
        if len(set(xs)) < 2:
            continue
        mx, my = statistics.fmean(xs), statistics.fmean(y for _, y in points)
        slopes.append(sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x in xs))
        counted += len(points)
    return {
        "series": len(slopes),
        "runs": counted,
        "mean_slope": statistics.fmean(slopes) if slopes else 0.0,
        "median_slope": statistics.median(slopes) if slopes else 0.0,
        "negative": sum(1 for s in slopes if s < 0),
    }


def markdown_table(rows: list[dict]) -> str:
    """The table by source of docs/cost-model.md (``SOURCES``), one line per source and GPU; a run of a source
    not listed is an error (the table would silently leave it out)."""
    groups: dict[tuple[int, str], list[dict]] = {}
    for r in rows:
        first = r["id"].split("-")[0]
        at = next((i for i, (prefix, _) in enumerate(SOURCES) if first.startswith(prefix)), None)
        if at is None:
            raise SystemExit(f"bench_published: run {r['id']!r} has no entry in SOURCES")
        gpu = "A100" if "a100" in r["cluster"] else "H100"
        groups.setdefault((at, gpu), []).append(r)
    lines = [
        "| source (id prefix) | GPU | runs | held out | mean error | worst | mean signed | within 15% |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for (at, gpu), subset in sorted(groups.items()):
        prefix, text = SOURCES[at]
        s = _stats(subset)
        worst = max((r["error"] for r in subset), key=abs)
        held = sum(1 for r in subset if r["held_out"])
        lines.append(
            f"| `{prefix}`: {text} | {gpu} | {s['runs']} | {held} | {s['mean_abs_error']:.1%} | {worst:+.1%} "
            f"| {s['mean_signed_error']:+.1%} | {s['within_15pct']} |"
        )
    return "\n".join(lines)


def _stats(subset: list[dict]) -> dict:
    errs = [abs(r["error"]) for r in subset]
    return {
        "runs": len(subset),
        "mean_abs_error": statistics.fmean(errs),
        "worst_abs_error": max(errs),
        "mean_signed_error": statistics.fmean(r["error"] for r in subset),
        "within_15pct": sum(e <= 0.15 for e in errs),
    }


def _print_stats(label: str, s: dict) -> None:
    print(
        f"{label:34} {s['runs']:3d} runs: mean |error| {s['mean_abs_error']:.1%}, "
        f"worst {s['worst_abs_error']:.1%}, mean signed {s['mean_signed_error']:+.1%}, "
        f"{s['within_15pct']} within 15%"
    )


if __name__ == "__main__":
    main()
