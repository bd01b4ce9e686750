"""Fusion x remat measured on real training (``coplan coupling --measure``), next to the cost
model's prediction of the same runs.

A GPT is trained a few steps under eight plans, the corners of two decisions:

- fusion: ``eager`` (no fusion groups: one kernel per op) or ``compiled`` (the greedy,
  Inductor-style fusion groups of ``search.space.fusion_option(ctx, "greedy")``); the runner
  (``coplan.apply``) compiles a plan with groups and runs one without them eagerly, so this module
  uses the plan API only and measures whatever the runner does with groups (``groups_honoured``
  in each corner says how many planned groups the compiled kernels kept; 0 means the corner ran
  without Inductor and its fusion effect is not real);
- remat: ``none``, Megatron's ``full`` and ``selective`` sets (``apply.predict.megatron_recompute``)
  and ``planned``: the set coplan's remat search (the joint search restricted to remat; the
  production remat pass where OR-Tools is missing, ``run.planned_by``) picks for that fusion under
  the memory budget. The planned set may differ between eager and compiled
  (recomputing a pointwise op is nearly free inside a compiled backward kernel): that is the
  coupling the simulated study prices, and when it differs a ninth run (compiled kernels with the
  set planned for eager) gives "remat, then fusion" its plan.

The other decisions are fixed: one process, microbatch = the batch, fp32 on a CPU (bf16 kernels on
CPUs are slow and the calibration's worst case) and bf16 compute on a GPU (no per-op fp32
overrides: the runner does not apply autocast-style overrides on CUDA yet).

**The memory budget** is on the activations saved for backward, the memory recomputation
controls: ``budget_fraction`` of the way from the least the remat space reaches (every saved tensor
recomputed) to nothing recomputed (0.5: half way), so recomputation is needed and some set fits.
The saved bytes are what the runner measures exactly (saved-tensor hooks) and what the cost model
predicts to the byte, so both sources judge feasibility on their own figure. The planner works on
peak memory: it plans under the peak budget that leaves exactly that much for saved activations
(the no-recompute plan's predicted peak minus the bytes to free). Peak memory is reported but not
judged: on a CPU the runner's peak (every live storage over a step) can be set by what no recompute
set changes (the fp32 logits and their gradient on a small model).

**Step times** are each corner's median step (after the first two) in ``repeats`` rounds, every
other round in reverse order so that drift of a shared machine falls on every corner alike; the
least over rounds is kept (contention only adds time).

Reported (``to_json``):

- every corner: measured and predicted step time, saved activation bytes and peak memory;
- ``factorial``: for each recompute mode, with eager-without-recompute as the baseline, the gains
  of fusion alone, of the mode alone, of both, and the interaction (no memory constraint), measured
  and predicted;
- ``pairs["fusion+remat"]``: the study's figures (single, each order, joint, interaction, joint
  over sequential) under the budget, once judged on measured times and saved bytes and once on
  predicted ones (each source picks its own best plans; a plan over the budget has no gain).
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from coplan.errors import SpecError
from coplan.experiments.coupling import interaction, interaction_ratio

if TYPE_CHECKING:
    from coplan.hardware.cluster import ClusterSpec
    from coplan.models.spec import ModelSpec
    from coplan.plan.context import PlanContext
    from coplan.plan.types import Plan

FUSIONS: tuple[str, ...] = ("eager", "compiled")
REMATS: tuple[str, ...] = ("none", "full", "selective", "planned")
#: the CPU profile ``coplan calibrate`` wrote for this repository's benchmarks (used when present)
CPU_PROFILE = Path("benchmarks/results/cpu_profile.json")
#: device name fragments (as CUDA reports them) -> the device preset that prices them
GPU_PRESETS: tuple[tuple[str, str], ...] = (
    ("H200", "h200"),
    ("H100", "h100-sxm"),
    ("B200", "b200"),
    ("A100-SXM4-40GB", "a100-sxm-40gb"),
    ("A100", "a100-sxm-80gb"),
    ("L4", "l4"),
)


def cpu_spec() -> ModelSpec:
    """The CPU default: a two-layer GPT small enough to train in seconds (``bench_apply``'s)."""
    from coplan.models.spec import ModelSpec

    return ModelSpec(name="gpt-a", n_layers=2, d_model=128, n_heads=4, vocab_size=2048, seq_len=256)


@dataclass(frozen=True, slots=True)
class MeasureConfig:
    """One measured study: ``device`` is ``cpu`` or ``cuda`` (resolved), ``cluster`` prices it."""

    device: str
    spec: ModelSpec
    batch: int
    seq: int
    steps: int
    cluster: ClusterSpec
    budget_fraction: float = 0.5
    repeats: int = 3


def default_cluster(device: str) -> str:
    """What prices the runs unless ``--profile`` says: the calibrated CPU profile when present
    (else the ``cpu`` preset), or the preset of the visible GPU."""
    if device == "cpu":
        return str(CPU_PROFILE) if CPU_PROFILE.exists() else "cpu"
    import torch

    name = torch.cuda.get_device_name()
    for frag, preset in GPU_PRESETS:
        if frag in name:
            return preset
    raise SpecError("--profile", None, f"no device preset for {name!r}: name a cluster or profile")


def configure(
    device: str = "auto",
    model: str | None = None,
    batch: int | None = None,
    seq: int | None = None,
    steps: int = 8,
    profile: str | None = None,
    budget_fraction: float = 0.5,
    repeats: int = 3,
) -> MeasureConfig:
    """The measured study's configuration from CLI-style options (defaults per device: the small
    GPT at batch 8 x 128 on a CPU, GPT-2 124M at batch 8 x 1024 on a GPU)."""
    from coplan.apply.run import resolve_device
    from coplan.hardware import load_cluster
    from coplan.models.spec import load_model_spec

    dev = resolve_device(device)
    if model is not None:
        spec = load_model_spec(model)
    else:
        spec = cpu_spec() if dev == "cpu" else load_model_spec("gpt2-124m")
    b = batch if batch is not None else 8
    s = seq if seq is not None else (128 if dev == "cpu" else 1024)
    for opt, v in (("--batch", b), ("--seq", s), ("--steps", steps), ("--repeats", repeats)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise SpecError(opt, None, f"must be a positive integer, got {v!r}")
    if steps < 3:
        raise SpecError("--steps", None, f"must be at least 3 (the first two are not timed), got {steps}")
    if not 0 <= budget_fraction < 1:
        raise SpecError("--budget-fraction", None, f"must be in [0, 1), got {budget_fraction!r}")
    cluster = load_cluster(profile or default_cluster(dev))
    return MeasureConfig(dev, spec, b, s, steps, cluster, budget_fraction, repeats)


# --- the plans -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Corner:
    fusion: str
    remat: str  # one of REMATS, or "planned (eager)" for the extra run
    plan: Plan


JOINT = "coplan's joint search restricted to remat (CP-SAT knapsack and local search)"
PASS = "coplan's remat pass (greedy by recompute seconds per byte): OR-Tools is not installed here"


def planner() -> str:
    """How the ``planned`` sets are chosen: the joint search needs OR-Tools' CP-SAT, which a GPU
    machine's image may lack; the production remat pass needs nothing (and the run says which)."""
    import importlib.util

    return JOINT if importlib.util.find_spec("ortools") is not None else PASS


@dataclass(frozen=True, slots=True)
class Budget:
    """``activation_bytes``: what a corner's saved activations may take (judged); ``peak_bytes``:
    the peak budget the planner planned the ``planned`` sets under (see the module doc)."""

    activation_bytes: float
    peak_bytes: float


def corner_plans(cfg: MeasureConfig, ctx: PlanContext) -> tuple[list[Corner], Budget]:
    """The corners' plans and the budget (the planner's peak budget is left on ``ctx``)."""
    from coplan.apply.predict import megatron_recompute, plan_for
    from coplan.passes.remat import remat_pass, saved_names, with_remat
    from coplan.search import Options, SearchSpace, run_strategy
    from coplan.search.space import DECISIONS, FUSION_OPTIONS, fusion_option

    # bf16 on a GPU as a plain compute dtype (norms, softmax and loss accumulate in fp32 inside
    # their kernels): the runner applies it on every path, which autocast's per-op fp32
    # overrides are not yet (they failed on CUDA with a dtype mismatch in the runner)
    base = plan_for(ctx, compute="bf16" if cfg.device != "cpu" else "fp32")
    fusions = {"eager": fusion_option(ctx, "eager"), "compiled": fusion_option(ctx, "greedy")}
    none = ctx.price(base).memory
    least = ctx.price(with_remat(base, frozenset(saved_names(ctx)), ctx)).memory.activations_bytes
    act = least + cfg.budget_fraction * (none.activations_bytes - least)
    budget = Budget(act, none.peak_bytes - (none.activations_bytes - act))
    ctx.budget_bytes = budget.peak_bytes
    space = SearchSpace(fusion=FUSION_OPTIONS, fixed=frozenset(DECISIONS) - {"remat"})
    out: list[Corner] = []
    planned: dict[str, frozenset[str]] = {}
    for f in FUSIONS:
        fbase = base.with_(fusion=fusions[f])
        for r in REMATS:
            if r == "planned":
                if planner() == JOINT:
                    plan = run_strategy("joint", ctx, Options(space=space, base=fbase)).plan
                else:
                    plan = remat_pass(ctx.index.graph, fbase, ctx)
                planned[f] = plan.remat.all_names
            else:
                plan = with_remat(fbase, megatron_recompute(ctx, r), ctx)
            out.append(Corner(f, r, plan))
    if planned["eager"] != planned["compiled"]:
        plan = with_remat(base.with_(fusion=fusions["compiled"]), planned["eager"], ctx)
        out.append(Corner("compiled", "planned (eager)", plan))
    return out, budget


# --- the analysis --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Figures:
    """One corner's numbers from one source (measured or predicted): step time and the activation
    bytes saved for backward (what the budget is judged on)."""

    step_time_s: float
    saved_bytes: float


def _pick(options: Sequence[str], figs: dict[str, Figures], budget: float) -> str:
    """The best corner key: fitting before not, then faster; not fitting: the least memory."""

    def key(k: str) -> tuple[bool, float]:
        f = figs[k]
        fits = f.saved_bytes <= budget
        return (not fits, f.step_time_s if fits else f.saved_bytes)

    return min(options, key=key)


def budgeted_pair(figs: dict[str, Figures], sets: dict[str, frozenset[str]], budget: float) -> dict[str, Any]:
    """The simulated study's fusion+remat figures over the corners (keys ``fusion/remat``), judged
    by ``figs`` under an activation ``budget`` (see the module doc). ``sets`` maps each key to its
    recompute set, so "remat, then fusion" keeps the set, not the label."""
    base = "eager/none"
    t0 = figs[base].step_time_s

    def gain(k: str) -> float | None:
        f = figs[k]
        return t0 / f.step_time_s if f.saved_bytes <= budget else None

    def with_set(fusion: str, names: frozenset[str]) -> str:
        return next(k for k in figs if k.startswith(fusion + "/") and sets[k] == names)

    def remats(fusion: str) -> list[str]:
        return [f"{fusion}/{r}" for r in REMATS]

    single_a = _pick(["eager/none", "compiled/none"], figs, budget)
    single_b = _pick(remats("eager"), figs, budget)
    a_then_b = _pick(remats(single_a.split("/")[0]), figs, budget)
    b_then_a = _pick([with_set(f, sets[single_b]) for f in FUSIONS], figs, budget)
    seq = _pick([a_then_b, b_then_a], figs, budget)
    joint = _pick(list(figs), figs, budget)
    fits = {k: figs[k].saved_bytes <= budget for k in (seq, joint)}
    return {
        "single_a": gain(single_a),
        "single_b": gain(single_b),
        "a_then_b": gain(a_then_b),
        "b_then_a": gain(b_then_a),
        "sequential": gain(seq),
        "joint": gain(joint),
        "interaction": interaction(gain(joint), (gain(single_a), gain(single_b))),
        "interaction_ratio": interaction_ratio(gain(joint), (gain(single_a), gain(single_b))),
        "joint_over_sequential": figs[seq].step_time_s / figs[joint].step_time_s
        if fits[seq] and fits[joint]
        else None,
        "baseline_fits": figs[base].saved_bytes <= budget,
        "choices": {
            "single_a": single_a,
            "single_b": single_b,
            "a_then_b": a_then_b,
            "b_then_a": b_then_a,
            "sequential": seq,
            "joint": joint,
        },
    }


def factorial(figs: dict[str, Figures]) -> list[dict[str, Any]]:
    """For each recompute mode, fusion and that mode against eager without recompute (no budget)."""
    t0 = figs["eager/none"].step_time_s
    f = t0 / figs["compiled/none"].step_time_s
    rows = []
    for r in REMATS[1:]:
        rg = t0 / figs[f"eager/{r}"].step_time_s
        both = t0 / figs[f"compiled/{r}"].step_time_s
        rows.append(
            {
                "remat": r,
                "fusion": f,
                "remat_gain": rg,
                "both": both,
                "interaction": interaction(both, (f, rg)),
                "interaction_ratio": interaction_ratio(both, (f, rg)),
            }
        )
    return rows


# --- running it ----------------------------------------------------------------------------------

Runner = Callable[[Corner], dict[str, Any]]


def run_measured(
    cfg: MeasureConfig, progress: Callable[[int, int, str], None] | None = None
) -> dict[str, Any]:
    """Plan, train and measure every corner; returns the object ``--measure --json`` prints."""
    import torch

    from coplan.apply.predict import make_context, run_cluster
    from coplan.apply.run import RunRequest, run_plan

    t0 = time.perf_counter()
    ctx = make_context(cfg.spec, run_cluster(cfg.cluster, 1, cfg.device), cfg.batch, cfg.seq, cfg.device)
    corners, budget = corner_plans(cfg, ctx)
    reports: list[dict[str, Any]] = [{} for _ in corners]
    times: list[list[float]] = [[] for _ in corners]
    loads: list[list[float | None]] = [[] for _ in corners]  # 1-minute load average after each run
    total = cfg.repeats * len(corners)
    for rnd in range(cfg.repeats):
        order = list(range(len(corners)))
        for n, i in enumerate(order if rnd % 2 == 0 else order[::-1]):
            c = corners[i]
            if progress:
                progress(rnd * len(corners) + n, total, f"round {rnd + 1}: {c.fusion} / {c.remat}")
            req = RunRequest(
                plan=c.plan,
                spec=cfg.spec,
                steps=cfg.steps,
                nproc=1,
                global_batch=cfg.batch,
                seq=cfg.seq,
                cluster=cfg.cluster,
                device=cfg.device,
            )
            rep = run_plan(req)
            times[i].append(rep["measured"]["step_time_s"])
            loads[i].append(os.getloadavg()[0] if hasattr(os, "getloadavg") else None)
            if not reports[i]:
                reports[i] = rep
    if progress:
        progress(total, total, "done")
    for rep, ts, ld in zip(reports, times, loads, strict=True):
        rep["measured"] = rep["measured"] | {
            "step_time_s": min(ts),
            "step_times_by_round_s": ts,
            "load_average_by_round": ld,
        }
    out = analyse(cfg, ctx, corners, reports, budget)
    out["run"]["torch"] = torch.__version__
    out["seconds"] = time.perf_counter() - t0
    return out


def analyse(
    cfg: MeasureConfig,
    ctx: PlanContext,
    corners: Sequence[Corner],
    reports: Sequence[dict[str, Any]],
    budget: Budget,
) -> dict[str, Any]:
    """The measured study's JSON from the corners and the runner's reports (``run_plan``'s)."""
    keys = [f"{c.fusion}/{c.remat}" for c in corners]
    sets = {k: c.plan.remat.all_names for k, c in zip(keys, corners, strict=True)}
    src: dict[str, dict[str, Figures]] = {"measured": {}, "predicted": {}}
    rows = []
    for k, c, rep in zip(keys, corners, reports, strict=True):
        for s in src:
            src[s][k] = Figures(rep[s]["step_time_s"], rep[s]["saved_activation_bytes"])
        fus = rep.get("fusion", {})
        rows.append(
            {
                "fusion": c.fusion,
                "remat": c.remat,
                "recomputed": len(sets[k]),
                "recompute": sorted(sets[k]),
                "fingerprint": c.plan.fingerprint,
                "measured": rep["measured"],
                "predicted": rep["predicted"],
                "fits_measured": rep["measured"]["saved_activation_bytes"] <= budget.activation_bytes,
                "fits_predicted": rep["predicted"]["saved_activation_bytes"] <= budget.activation_bytes,
                "groups_planned": int(fus.get("groups_planned", len(c.plan.fusion.groups))),
                "groups_honoured": int(fus.get("groups_honoured", 0)),
                "grad_check": rep.get("grad_check"),
            }
        )
    fac_m, fac_p = factorial(src["measured"]), factorial(src["predicted"])
    fac = [
        {"remat": m["remat"], "measured": _fac(m), "predicted": _fac(p)}
        for m, p in zip(fac_m, fac_p, strict=True)
    ]
    pair = {s: budgeted_pair(src[s], sets, budget.activation_bytes) for s in src}
    compiled = [r for r in rows if r["fusion"] == "compiled"]
    honoured = sum(r["groups_honoured"] for r in compiled)
    notes = [
        "predicted: the coplan cost model priced with the cluster named in run.cluster; measured: "
        "wall time (median of the steps after the first two, the least over rounds), saved-tensor "
        "hooks and live storage",
        "the budget is on saved activation bytes, judged on each source's own figure; a corner "
        "over it has no gain in the budgeted figures",
    ]
    if compiled and honoured == 0:
        notes.append(
            "the compiled corners kept none of their planned fusion groups (the runner ran them "
            "without Inductor): their measured fusion effect is not real, only the prediction is"
        )
    device_name = platform.processor() or platform.machine()
    if cfg.device == "cuda":
        import torch

        device_name = torch.cuda.get_device_name()
    return {
        "mode": "measured",
        "run": {
            "device": cfg.device,
            "device_name": device_name,
            "model": cfg.spec.name,
            "spec": cfg.spec.to_dict(),
            "global_batch": cfg.batch,
            "seq": cfg.seq,
            "steps": cfg.steps,
            "cluster": ctx.cluster.name,
            "precision": corners[0].plan.precision.compute,
            "budget_bytes": budget.activation_bytes,
            "planner_peak_budget_bytes": budget.peak_bytes,
            "budget_fraction": cfg.budget_fraction,
            "repeats": cfg.repeats,
            "planned_by": planner(),
        },
        "corners": rows,
        "factorial": fac,
        "pairs": {"fusion+remat": pair},
        "planned_sets_differ": any(c.remat == "planned (eager)" for c in corners),
        "notes": notes,
    }


def _fac(row: dict[str, Any]) -> dict[str, float | None]:
    return {
        "fusion": row["fusion"],
        "remat": row["remat_gain"],
        "both": row["both"],
        "interaction": row["interaction"],
        "interaction_ratio": row["interaction_ratio"],
    }
