"""Cost model against published runs of PyTorch-native, DeepSpeed and eager stacks, each priced
with its stack's preset (``coplan/cost/stacks/*.json``) beside the Megatron-priced baseline.

    python benchmarks/bench_stacks.py [--runs RUNS.json] [--json OUT]

Each run of ``benchmarks/data/published_stack_runs.json`` (and the runs another stack made that are
kept with the Megatron runs, ``other_stack_runs``: MT-NLG's Megatron-DeepSpeed rows, with the
``deepspeed`` preset) is priced twice: as ``megatron`` (the
cost model before stacks were named: Megatron + Transformer Engine kernels, per-op checkpointing as
Megatron's selective) and with the preset of its stack (``torchtitan``, ``fsdp``, ``deepspeed``,
``eager``; the ``-compile`` preset where ``stack_settings.compile``, its loss eager where
``stack_settings.loss_compiled`` is false; FSDP1's flat parameters where ``stack_settings.fsdp``
says so (no FSDP2 copies around the collectives); HYBRID_SHARD shards within a node; torchtitan's fused
RMSNorm where ``stack_settings.norm`` names ``fused_rmsnorm``; the network between nodes the run's
source gives where it has one, ``network.node_gbps``). Checkpointing follows
``stack_settings.activation_checkpoint``: ``selective-op`` is torchtitan's per-op policy as a
recompute set (``coplan.cost.checkpoint``); ``selective-layer:N`` / ``selective-fraction:p``
checkpoint some blocks fully, as many as the stack's own rule picks
(``coplan.cost.checkpoint.checkpointed_blocks``), priced with ``TrainingConfig.recompute_layers``.
Each run is also priced as `coplan estimate --stack PRESET` prices it from its contract flags alone
(``contract_estimate``: the run's layout, batch, sequence, checkpointing, ZeRO stage and dtype, none
of its other settings). Prints per stack the mean absolute, mean signed and worst step-time error
of each, the eager/compile pair
ratios, the peak-memory error where published, and the runs that ran but are priced as not
fitting; writes the rows to
``benchmarks/results/published_stacks.json``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from bench_published import CONTRACT_MODEL_FIELDS, _contract_fields, run_config

from coplan.cost import CostModel, TrainingConfig, load_stack
from coplan.cost.checkpoint import checkpointed_blocks
from coplan.cost.config import production_overlaps
from coplan.hardware import load_cluster
from coplan.models.spec import ModelSpec

DATA = Path(__file__).parent / "data" / "published_stack_runs.json"
OUT = Path(__file__).parent / "results" / "published_stacks.json"
#: runs of the Megatron data (``published_runs.json``, where ``bench_published.py`` reports them
#: apart) that another stack made, and the preset that prices that stack: MT-NLG 530B ran
#: Megatron-DeepSpeed, DeepSpeed's pipeline engine driving Megatron's model
MEGATRON_DATA = Path(__file__).parent / "data" / "published_runs.json"
OTHER_STACKS = {"megatron-deepspeed": "deepspeed"}


def other_stack_runs(path: Path = MEGATRON_DATA) -> list[dict]:
    """The runs of ``path`` another stack made (``OTHER_STACKS``), as rows of this benchmark: its
    preset's stack, no setting of its own beyond the data's (its source gives none)."""
    out = []
    for run in json.loads(path.read_text())["runs"]:
        stack = OTHER_STACKS.get(run.get("stack", "megatron-lm"))
        if stack is not None:
            out.append({**run, "stack": stack, "stack_settings": {"compile": False}})
    return out


def stack_of(run: dict) -> str:
    """The preset a run is priced with."""
    name = run["stack"]
    return f"{name}-compile" if run["stack_settings"].get("compile") else name


def _base(run: dict) -> dict:
    r = dict(run)
    r.setdefault("vpp", 1)
    r.setdefault("sequence_parallel", False)
    r.setdefault("flash_attention", True)
    return r


def with_network(cluster, run: dict):  # type: ignore[no-untyped-def]
    """``cluster`` with the network the run's source gives (``network.node_gbps``: Gb/s between
    nodes per node, shared by its devices) where it differs from the preset's; the link's other
    settings are the preset's."""
    net = run.get("network")
    if not net or cluster.inter_node is None:
        return cluster
    per_device = net["node_gbps"] * 1e9 / 8 / cluster.groups[0].devices_per_node
    return replace(cluster, inter_node=replace(cluster.inter_node, bandwidth=per_device))


def configured(run: dict, stack: str):  # type: ignore[no-untyped-def]
    """(cost model, cluster, training configuration) of ``run`` under preset ``stack``."""
    r = _base(run)
    spec = ModelSpec(**{k: v for k, v in r["model"].items() if v is not None})
    cluster = with_network(load_cluster(r["cluster"], r["gpus"]), run)
    model = CostModel(spec=spec)
    if stack == "megatron":
        if r["recompute"] == "partial":
            r["recompute"] = "selective"
        return model, cluster, run_config(r)
    # a per-layer policy: its own count of fully checkpointed blocks (these runs have no pipeline)
    policy, count = _policy(r, spec.n_layers)
    spec_of_stack = load_stack(stack)
    if "loss_compiled" in r["stack_settings"]:
        # the run's own version of the stack says whether torch.compile covered the loss
        spec_of_stack = replace(spec_of_stack, eager_loss=not r["stack_settings"]["loss_compiled"])
    config = spec_of_stack.configure(run_config(r))
    if r["stack_settings"].get("loss_fn") == "fused_crossentropy":
        # flash-attn's fused cross-entropy: the IR's loss kernels (``TrainingConfig.eager_loss_cast``)
        config = config.with_(eager_loss_cast="fused")
    if "loss_cast" in r["stack_settings"]:
        # how the run's own code brought its logits to the loss (``TrainingConfig.eager_loss_cast``)
        config = config.with_(eager_loss_cast=r["stack_settings"]["loss_cast"])
    if r["stack_settings"].get("fsdp") == "fsdp1":
        # a torchtitan run from before FSDP2: flat parameters, gathered and reduced in place
        config = config.with_(gather_copies=False)
    if r["stack_settings"].get("async_tp"):
        # PyTorch's async TP (``coplan.cost.tp_overlap.async_tp_slots``)
        config = config.with_(async_tp=True)
    if r["stack_settings"].get("fsdp_float8_all_gather"):
        # torchao's float8 all-gather: FSDP2 gathers the units' linear weights in fp8
        # (``TrainingConfig.fp8_params``)
        config = config.with_(fp8_params=True)
    if r["stack_settings"].get("float8") == "rowwise":
        # torchao's rowwise recipe (``coplan.cost.fp8.rowwise_bytes``)
        config = config.with_(fp8_scaling="rowwise")
    if str(r["stack_settings"].get("norm", "")).startswith("fused_rmsnorm"):
        # torchtitan's Triton RMSNorm (``TrainingConfig.fused_rmsnorm``)
        config = config.with_(fused_rmsnorm=True)
    if r["stack_settings"].get("attention_unpad"):
        # flash-attn's variable-length path with unpadded inputs (``TrainingConfig.attention_unpad``)
        config = config.with_(attention_unpad=True)
    if "optimizer" in r["stack_settings"]:
        # how the run's PyTorch stepped AdamW (``TrainingConfig.optimizer``)
        config = config.with_(optimizer=r["stack_settings"]["optimizer"])
    if r["stack_settings"].get("cuda_launch_blocking"):
        # CUDA_LAUNCH_BLOCKING=1: each launch's host time in series (``TrainingConfig.launch_blocking``)
        config = config.with_(launch_blocking=True)
    if "gemm_padding" in r["stack_settings"]:
        # whether the run's compiler padded unaligned GEMMs (``TrainingConfig.gemm_padding``)
        config = config.with_(gemm_padding=r["stack_settings"]["gemm_padding"])
    if "zero3_gather" in r["stack_settings"]:
        # the run's DeepSpeed issues ZeRO-3's collectives its own way (``TrainingConfig.zero3_gather``)
        config = config.with_(zero3_gather=r["stack_settings"]["zero3_gather"])
    if "grad_accumulation" in r["stack_settings"]:
        # how the run's stack accumulated gradients over microbatches (``TrainingConfig.grad_accumulation``)
        config = config.with_(grad_accumulation=r["stack_settings"]["grad_accumulation"])
    if r["stack_settings"].get("zero3_overlap") is False:
        # each gather waits for the device (``TrainingConfig.overlap_zero``)
        config = config.with_(overlap_zero=False)
    if r["stack_settings"].get("sharding") == "HYBRID_SHARD":
        # sharded within a node, replicated across nodes
        config = config.with_(fsdp_shard=cluster.groups[0].devices_per_node)
    return model, cluster, _checkpointed(model, config, policy, count, spec.n_layers)


def _policy(r: dict, n_layers: int) -> tuple[str, int | None]:
    """The run's checkpointing policy and, for a per-layer one, its count of fully checkpointed
    blocks; ``r["recompute"]`` set to what the configuration takes before either is applied
    (``_checkpointed``): none for the per-op and per-layer policies."""
    policy = r["stack_settings"].get("activation_checkpoint", r["recompute"])
    count = checkpointed_blocks(policy, n_layers)
    r["recompute"] = "none" if policy == "selective-op" or count is not None else r["recompute"]
    return policy, count


def _checkpointed(model: CostModel, config, policy: str, count: int | None, n_layers: int):  # type: ignore[no-untyped-def]
    """``config`` with the run's checkpointing: torchtitan's per-op policy as its recompute set over
    the step's graph (``--recompute selective-op``), or the count of fully checkpointed blocks
    (``--recompute full --recompute-layers N``)."""
    if policy == "selective-op":
        config = config.with_(recompute=model.selective_op_set(config))
    if count:
        config = config.with_(recompute="full", recompute_layers=min(count, n_layers))
    return config


def contract_estimate(run: dict):  # type: ignore[no-untyped-def]
    """``run`` priced as `coplan estimate --stack PRESET` prices it from its contract flags alone
    (layout, batch, sequence, checkpointing as ``--recompute`` and ``--recompute-layers`` name it,
    ZeRO, dtype, flash attention; the model without dropout, the cluster preset's network): none of
    the run's own ``stack_settings`` (its PyTorch's optimizer, HSDP, float8 recipe, async TP,
    launch blocking, ...) beyond what the preset assumes."""
    r = _base(run)
    spec = ModelSpec(
        **{k: v for k, v in r["model"].items() if v is not None and k not in CONTRACT_MODEL_FIELDS}
    )
    cluster = load_cluster(r["cluster"], r["gpus"])
    stack = load_stack(stack_of(run))
    policy, count = _policy(r, spec.n_layers)
    fields = _contract_fields(r)
    if fields["recompute"] == "partial":
        fields["recompute"] = "selective"
    overlaps = production_overlaps(cluster.devices, r["tp"], r["sequence_parallel"], r["zero"])
    config = stack.configure(TrainingConfig(**fields, **overlaps))
    if r.get("stage_layers"):
        config = config.with_(stage_layers=tuple(r["stage_layers"]))  # --stage-layers
    elif (split := stack.stage_split(spec.n_layers, config.pp, config.vpp)) is not None:
        config = config.with_(stage_layers=split)
    model = CostModel(spec=spec)
    return model.estimate(cluster, _checkpointed(model, config, policy, count, spec.n_layers))


def estimated(run: dict, stack: str):  # type: ignore[no-untyped-def]
    """(cost model, cluster, configuration, estimate) of ``run`` under preset ``stack``."""
    model, cluster, config = configured(run, stack)
    return model, cluster, config, model.estimate(cluster, config)


def price(
    run: dict,
    stack: str,
    reserved: bool = False,
    priced=None,  # type: ignore[no-untyped-def]
) -> tuple[float, float, bool, float | None, float]:
    """(step seconds, allocated peak bytes, fits, reserved peak bytes, MFU) of ``run`` under preset
    ``stack`` (its ``estimated`` result where ``priced`` gives it); the reserved peak (with the
    caching allocator as the run's launcher set it) only where ``reserved`` asks, else None."""
    model, cluster, _, est = priced if priced is not None else estimated(run, stack)
    got = _reserved(model, cluster, est, run, stack) if reserved else None
    return est.step_time_s, est.memory.peak_bytes, est.fits, got, est.mfu


#: the parts of a priced step ``step_parts`` splits it into
PARTS = ("gemm", "attention", "other kernels", "rest")


def step_parts(run: dict, stack: str, priced=None) -> tuple[float, float, float, float]:  # type: ignore[no-untyped-def]
    """``run``'s priced step under ``stack`` in seconds by ``PARTS`` (its ``estimated`` result
    where ``priced`` gives it): its compute and recompute split by the slowest stage's kernel time
    in a microbatch (GEMMs, fused attention, every other kernel), and the rest of the step (exposed
    communication, the optimizer, pipeline bubbles)."""
    from coplan.cost.explain import kernel_costs

    model, cluster, config, est = priced if priced is not None else estimated(run, stack)
    stage = max(est.stages, key=lambda st: st.microbatch_s).index
    rows = kernel_costs(model.profile_for(config), cluster, config, stage)
    total = sum(k.total_s for k in rows)
    busy = est.breakdown_s["compute"] + est.breakdown_s["recompute"]
    gemm = sum(k.total_s for k in rows if k.kind == "matmul") / total * busy if total else 0.0
    attn = sum(k.total_s for k in rows if k.kind == "attention") / total * busy if total else 0.0
    return gemm, attn, busy - gemm - attn, est.step_time_s - busy


def _reserved(model: CostModel, cluster, est, run: dict, stack: str) -> float:  # type: ignore[no-untyped-def]
    """The reserved peak (``CostModel.reserved``), with expandable segments where the run's own
    launcher set them (its ``stack_settings``), else the preset's."""
    spec_of_stack = load_stack(stack)
    if run["stack_settings"].get("fsdp") == "fsdp1" and spec_of_stack.sharding == "fsdp2":
        # FSDP1 computes on its flat parameter and reduces on its post-backward stream
        spec_of_stack = replace(spec_of_stack, sharding="fsdp1")
    if "fsdp2_reduce_input" in run["stack_settings"]:
        # the run's FSDP2 made its reduce-scatter input where its torch did (``StackSpec.reduce_input``)
        spec_of_stack = replace(spec_of_stack, reduce_input=run["stack_settings"]["fsdp2_reduce_input"])
    if "expandable_segments" in run["stack_settings"]:
        spec_of_stack = replace(
            spec_of_stack, expandable_segments=run["stack_settings"]["expandable_segments"]
        )
    got = model.reserved(cluster, est, spec_of_stack)
    return got.reserved_bytes if got is not None else est.memory.peak_bytes


#: fewest runs a source's two-factor split is fitted on, and its one factor per part: five runs a
#: factor, fewer leave the factors undetermined (they trade against each other)
SPLIT_MIN_RUNS = 6
PARTS_MIN_RUNS = 5 * 4


def attention_split(rest, attention, measured):  # type: ignore[no-untyped-def]
    """The factors ``a``, ``b`` that make ``a x rest + b x attention`` closest to ``measured``
    (arrays of seconds, one entry a run) by least squares on relative error, and each run's relative
    residual."""
    import numpy as np

    two = np.stack([np.asarray(rest) / measured, np.asarray(attention) / measured], axis=1)
    (a, b), *_ = np.linalg.lstsq(two, np.ones(len(two)), rcond=None)
    return float(a), float(b), two @ np.array([a, b]) - 1


def part_split(rows: list[dict], runs: list[dict], priced: dict | None = None) -> list[dict]:
    """Per stack and source (the run ids' first word: ``tt``, ``fms``, ``llmfoundry``, ...) with at
    least ``SPLIT_MIN_RUNS`` runs, least squares on relative error: the two factors ``a``, ``b`` that
    make ``a x (priced step outside fused attention) + b x (priced attention)`` closest to the
    measured steps, and, with at least ``PARTS_MIN_RUNS`` runs, one factor per part of ``PARTS``. A
    factor far from 1 says which part of the price misses; one the runs' shares hardly vary over is
    poorly determined (the shares are given). A diagnosis, applied to no price. ``priced``: each
    run's ``estimated`` result under its preset, by id, where already computed."""
    import numpy as np

    groups: dict[tuple[str, str], list[tuple[tuple[float, ...], float]]] = {}
    for r, run in zip(rows, runs, strict=True):
        source = run["id"].split("-")[0].rstrip("0123456789")
        parts = step_parts(run, stack_of(run), (priced or {}).get(run["id"]))
        groups.setdefault((r["stack"], source), []).append((parts, r["measured_s"]))
    out = []
    for (stack, source), got in sorted(groups.items()):
        if len(got) < SPLIT_MIN_RUNS:
            continue
        parts = np.array([p for p, _ in got])
        meas = np.array([m for _, m in got])
        step = parts.sum(axis=1)
        a, b, residual = attention_split(step - parts[:, 1], parts[:, 1], meas)
        four = parts / meas[:, None]
        by_part, *_ = np.linalg.lstsq(four, np.ones(len(got)), rcond=None)
        shares = parts / step[:, None]
        fitted = len(got) >= PARTS_MIN_RUNS
        out.append(
            {
                "stack": stack,
                "source": source,
                "n": len(got),
                "share_min": float(shares[:, 1].min()),
                "share_max": float(shares[:, 1].max()),
                "rest": a,
                "attention": b,
                "mean_abs_residual": float(np.mean(np.abs(residual))),
                "parts": {
                    name: {
                        "factor": float(f),
                        "share_min": float(shares[:, i].min()),
                        "share_max": float(shares[:, i].max()),
                    }
                    for i, (name, f) in enumerate(zip(PARTS, by_part, strict=True))
                }
                if fitted
                else None,
                "parts_mean_abs_residual": float(np.mean(np.abs(four @ by_part - 1))) if fitted else None,
            }
        )
    return out


#: stack settings that change memory only (not what a step computes or sends): ignored where runs are
#: matched for ``weak_scaling``
MEMORY_ONLY = frozenset({"sources", "expandable_segments"})


def weak_scaling(rows: list[dict], runs: list[dict]) -> list[dict]:
    """Pairs of runs of one stack and source doing the same work per GPU (model, layout, microbatch,
    sequence, recompute, precision, sequences per GPU and stack settings equal) on different GPU
    counts: the measured step's change beside the priced one. Each GPU's work is the same, so what
    changes is communication and what scale does to it (ring latency, the fabric, waiting for the
    slowest rank); a measured change the price does not follow is a cost of scale it misses."""

    def key(run: dict) -> str:
        settings = {k: v for k, v in run["stack_settings"].items() if k not in MEMORY_ONLY}
        fields = ("model", "cluster", "tp", "pp", "vpp", "microbatch", "seq", "recompute", "dtype", "zero")
        return json.dumps(
            [run["stack"], run["id"].split("-")[0], [run.get(f) for f in fields], settings,
             run["global_batch"] / run["gpus"], run.get("network")],
            sort_keys=True,
        )  # fmt: skip

    groups: dict[str, list[tuple[dict, dict]]] = {}
    for r, run in zip(rows, runs, strict=True):
        groups.setdefault(key(run), []).append((r, run))
    out = []
    for got in groups.values():
        got.sort(key=lambda x: x[1]["gpus"])
        for (ra, a), (rb, b) in itertools.pairwise(got):
            if a["gpus"] == b["gpus"]:
                continue
            out.append(
                {
                    "small": ra["id"],
                    "large": rb["id"],
                    "gpus": [a["gpus"], b["gpus"]],
                    "measured": rb["measured_s"] / ra["measured_s"],
                    "priced": rb["priced"]["predicted_s"] / ra["priced"]["predicted_s"],
                }
            )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=Path, default=DATA)
    ap.add_argument("--json", type=Path, default=OUT)
    args = ap.parse_args()
    runs = json.loads(args.runs.read_text())["runs"]
    if args.runs == DATA:
        runs += other_stack_runs()  # the other stacks' runs kept with the Megatron data
    rows = []
    estimates = {}  # each run's estimate under its preset, for the split by part
    for run in runs:
        measured = run["measured"]
        row = {
            "id": run["id"],
            "stack": run["stack"],
            "preset": stack_of(run),
            "measured_s": measured["step_time_s"],
        }
        for label, stack in (("baseline", "megatron"), ("priced", stack_of(run))):
            start = time.perf_counter()
            kind = measured.get("memory_kind")
            got = estimated(run, stack)
            if label == "priced":
                estimates[run["id"]] = got
            step, peak, fits, reserved, mfu = price(run, stack, reserved=kind == "reserved", priced=got)
            # compared with what the source reports: the reserved peak, or the allocated one
            shown = reserved if reserved is not None else peak
            row[label] = {
                "predicted_s": step,
                "error": step / measured["step_time_s"] - 1,
                "peak_bytes": peak,
                "reserved_bytes": reserved,
                "memory_error": shown / measured["peak_memory_bytes"] - 1
                if measured.get("peak_memory_bytes")
                else None,
                "allocated_memory_error": peak / measured["peak_memory_bytes"] - 1
                if measured.get("peak_memory_bytes")
                else None,
                "active_memory_error": peak / measured["active_peak_bytes"] - 1
                if measured.get("active_peak_bytes")
                else None,
                "fits": fits,
                "mfu": mfu,
                "wall_s": time.perf_counter() - start,
            }
        contract = contract_estimate(run).step_time_s
        row["contract"] = {"predicted_s": contract, "error": contract / measured["step_time_s"] - 1}
        row["memory_kind"] = measured.get("memory_kind")
        row["pair"] = run.get("pair")
        rows.append(row)
    by_id = {r["id"]: r for r in rows}
    print(
        f"{'stack':<11}{'n':>3} | {'baseline: mean abs  signed  worst':>34} | "
        f"{'preset: mean abs  signed  worst':>32} | {'contract: mean abs  signed  worst':>34}"
    )
    summary: dict[str, dict] = {}
    for stack in [*dict.fromkeys(r["stack"] for r in rows), "all"]:
        sel = [r for r in rows if stack in ("all", r["stack"])]
        s = {}
        for label in ("baseline", "priced", "contract"):
            e = [r[label]["error"] for r in sel]
            s[label] = {
                "mean_abs": statistics.fmean(abs(x) for x in e),
                "mean_signed": statistics.fmean(e),
                "worst": max(e, key=abs),
            }
        summary[stack] = s
        b, p, c = s["baseline"], s["priced"], s["contract"]
        print(
            f"{stack:<11}{len(sel):>3} | {b['mean_abs']:>17.1%} {b['mean_signed']:>+7.1%} "
            f"{b['worst']:>+6.1%} "
            f"| {p['mean_abs']:>15.1%} {p['mean_signed']:>+7.1%} {p['worst']:>+6.1%} "
            f"| {c['mean_abs']:>17.1%} {c['mean_signed']:>+7.1%} {c['worst']:>+6.1%}"
        )
    # where the gap lies: the same stack's runs by the device they ran on and eager or compiled
    print("\nby device (preset's mean signed step-time error, runs):")
    groups: dict[tuple[str, str, str], list[float]] = {}
    for r, run in zip(rows, runs, strict=True):
        device = load_cluster(run["cluster"], run["gpus"]).groups[0].device.name
        key = (r["stack"], device, "compiled" if "compile" in r["preset"] else "eager")
        groups.setdefault(key, []).append(r["priced"]["error"])
    by_device = []
    for (stack, device, mode), errors in sorted(groups.items()):
        by_device.append(
            {
                "stack": stack,
                "device": device,
                "mode": mode,
                "n": len(errors),
                "mean_signed": statistics.fmean(errors),
            }
        )
        print(f"  {stack:<11}{device:<17}{mode:<9}{len(errors):>3}  {statistics.fmean(errors):+6.1%}")
    split = part_split(rows, runs, estimates)
    print(
        "\nwhere the gap lies: measured step = a x the priced step outside fused attention + b x the "
        "priced attention,\nand one factor per part (shares of the priced step), least squares over "
        "each source's runs (relative residuals)"
    )
    for g in split:
        print(
            f"  {g['stack']:<11}{g['source']:<11}{g['n']:>3} runs, attention {g['share_min']:.0%}-"
            f"{g['share_max']:.0%}: a {g['rest']:.2f}, b {g['attention']:.2f}, "
            f"mean |residual| {g['mean_abs_residual']:.1%}"
        )
        if g["parts"] is None:
            continue  # too few runs to determine a factor per part
        by_part = ", ".join(
            f"{name} {v['factor']:.2f} ({v['share_min']:.0%}-{v['share_max']:.0%})"
            for name, v in g["parts"].items()
        )
        print(f"  {'':<22}{by_part}; mean |residual| {g['parts_mean_abs_residual']:.1%}")
    scaling = weak_scaling(rows, runs)
    print(
        "\nweak scaling: runs doing the same work per GPU on more GPUs, the step's change measured and "
        "priced with the preset"
    )
    for w in scaling:
        print(
            f"  {w['large']:<55} {w['gpus'][0]:>4} -> {w['gpus'][1]:<4} GPUs: measured x{w['measured']:.3f}, "
            f"priced x{w['priced']:.3f}"
        )
    print("\neager / compile pairs: step-time ratio eager/compiled, measured vs predicted (points)")
    pairs = []
    for r in rows:
        other = by_id.get(r["pair"] or "")
        if other is None or "compile" in r["preset"]:
            continue
        meas = r["measured_s"] / other["measured_s"]
        out = {"eager": r["id"], "compiled": other["id"], "measured": meas}
        for label in ("baseline", "priced"):
            out[label] = r[label]["predicted_s"] / other[label]["predicted_s"]
        pairs.append(out)
        print(
            f"  {r['id']:<48} measured {meas:.3f}  baseline {out['baseline']:.3f} "
            f"({100 * (out['baseline'] - meas):+.1f})  preset {out['priced']:.3f} "
            f"({100 * (out['priced'] - meas):+.1f})"
        )
    mem = [r for r in rows if r["priced"]["memory_error"] is not None]
    print(
        f"\npeak memory where published ({len(mem)} runs, the reserved peak where that is what they "
        f"report): mean abs error baseline "
        f"{statistics.fmean(abs(r['baseline']['memory_error']) for r in mem):.1%}, preset "
        f"{statistics.fmean(abs(r['priced']['memory_error']) for r in mem):.1%} "
        f"(signed {statistics.fmean(r['priced']['memory_error'] for r in mem):+.1%}; the allocated peak "
        f"alone {statistics.fmean(abs(r['priced']['allocated_memory_error']) for r in mem):.1%})"
    )
    for r in mem:
        p = r["priced"]
        print(
            f"  {r['id']:<55} allocated {p['peak_bytes'] / 2**30:5.1f} GiB "
            f"({p['allocated_memory_error']:+.1%})  reserved {p['reserved_bytes'] / 2**30:5.1f} GiB "
            f"({p['memory_error']:+.1%})"
        )
    active = [r for r in rows if r["priced"]["active_memory_error"] is not None]
    if active:
        # the allocator's live blocks at their peak, where a source publishes it beside the
        # reserved peak: what the cost model's allocated peak prices, without the cache
        print(
            f"allocated peak against the published active peak ({len(active)} runs): mean abs error "
            f"baseline {statistics.fmean(abs(r['baseline']['active_memory_error']) for r in active):.1%}, "
            f"preset {statistics.fmean(abs(r['priced']['active_memory_error']) for r in active):.1%}"
        )
        for r in active:
            print(f"  {r['id']:<55} {r['priced']['active_memory_error']:+.1%}")
    for label in ("baseline", "priced"):
        bad = [r["id"] for r in rows if not r[label]["fits"]]
        print(f"runs that ran, priced as not fitting ({label}): {len(bad)} {bad}")
    walls = [r["priced"]["wall_s"] for r in rows]
    print(
        f"wall per run (estimate with its graph built, and the allocator's replay): median "
        f"{statistics.median(walls) * 1e3:.0f} ms"
    )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps(
            {
                "summary": summary,
                "by_device": by_device,
                "split": split,
                "weak_scaling": scaling,
                "pairs": pairs,
                "runs": rows,
            },
            indent=1,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
