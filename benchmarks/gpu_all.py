"""``bench_gpu.py all``: coplan's plans against torch.compile on one device, at a loose and a
memory-tight batch, for GPT-2 124M and Llama 3.2 1B (a small GPT on a CPU).

Per model and batch, five runs of ``coplan run``'s path (``coplan.apply.run.run_plan``):

- ``eager``: plain PyTorch under bf16 autocast, the joint plan's layout and microbatching;
- ``compile``: ``torch.compile`` with Inductor's defaults, the same;
- ``compile_budget``: ``torch.compile`` with PyTorch's memory-budgeted partitioner
  (``torch._functorch.config.activation_memory_budget``) at the fraction that gives it the joint
  plan's saved activations: the joint run's measured saved bytes over the ``compile`` run's (the
  partitioner's budget is a fraction of its own default saved set), from the cost model where a
  run failed;
- ``coplan_joint`` and ``coplan_sequential``: the ``joint`` and ``sequential`` strategies' plans
  for coplan's runner (bf16: the runner emulates fp8).

The batches come from the cost model, not a table: the tight batch is the smallest power of two
at which ``torch.compile``'s defaults in one microbatch do not fit the device, the loose one a
quarter of it. At the tight batch every run takes the whole batch in one microbatch: both
strategies plan with the layout held there (``SearchSpace.fixed``), so the budget must be met by
what recomputation, fusion and precision free, as ``torch.compile``'s memory-budgeted partitioner
must meet it; splitting the batch instead would leave memory slack for every run and nothing to
compare. On a GPU larger than the one the plans were made for (an H200 running the H100's plans)
each run is held to that one's memory (``torch.cuda.set_per_process_memory_fraction``), so it is
as tight there. A CPU's memory is not the constraint, so there the
tight plans get a budget halfway between that baseline's predicted peak and the same kernels'
with every block recomputed (``cpu_budget``).

Plans are made where OR-Tools is installed (``plans``; the GPU machine has none) and written to
``benchmarks/data/gpu/all/``; ``all`` plans any that are missing when it can. Results go to
``OUT/bench_gpu.json`` after every run, so a run cut short keeps what finished.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
PLAN_DIR = HERE / "data" / "gpu" / "all"
RUNS = ("eager", "compile", "coplan_joint", "coplan_sequential", "compile_budget")
STRATEGIES = {"coplan_joint": "joint", "coplan_sequential": "sequential"}

#: model -> (spec: a preset or a file, cluster: a preset or a file, sequence length) per device
#: kind; on a CPU the profile ``coplan calibrate`` fitted to this machine prices the runs
#: (``gpt-tiny``: the quick end-to-end check the tests run, with the uncalibrated preset)
MODELS: dict[str, dict[str, tuple[str, str, int]]] = {
    "cuda": {
        "gpt2-124m": ("gpt2-124m", "dgx-h100", 1024),
        "llama3.2-1b": ("llama3.2-1b", "dgx-h100", 2048),
    },
    "cpu": {
        "gpt-b": (str(HERE / "data" / "gpt-b.json"), str(HERE / "results" / "cpu_profile.json"), 256),
        "gpt-tiny": ("gpt-tiny", "cpu", 64),
    },
}
DEFAULT = {"cuda": ["gpt2-124m", "llama3.2-1b"], "cpu": ["gpt-b"]}


def _context(model: str, device: str, batch: int, budget: float | None = None) -> Any:
    from coplan.apply.predict import make_context, run_cluster
    from coplan.hardware import load_cluster
    from coplan.models.spec import load_model_spec

    spec, cluster, seq = MODELS[device][model]
    ctx = make_context(
        load_model_spec(spec), run_cluster(load_cluster(cluster), 1, device), batch, seq, device
    )
    if budget is not None:
        ctx.budget_bytes = budget
    return ctx


def _compile_baseline(model: str, device: str, batch: int) -> tuple[Any, Any]:
    """(context, plan) of ``torch.compile``'s defaults in one microbatch of ``batch``, priced as
    ``coplan run --mode compile`` prices it."""
    from coplan.apply.predict import baseline_plan, mode_stack, plan_for

    ctx = _context(model, device, batch)
    ctx.stack = mode_stack(ctx.stack, "compile")
    return ctx, baseline_plan(plan_for(ctx, compute="bf16", microbatch=batch), ctx, "compile")


def _baseline_peak(model: str, device: str, batch: int) -> tuple[float, float]:
    """(predicted peak of ``torch.compile``'s defaults in one microbatch, the planner's budget)."""
    ctx, base = _compile_baseline(model, device, batch)
    return ctx.price(base).memory.peak_bytes, float(ctx.budget_bytes or 0.0)


def cpu_budget(model: str, batch: int) -> float:
    """A CPU's stand-in for a device's memory at the tight batch: halfway between the predicted
    one-microbatch peaks of ``torch.compile``'s defaults and of the same kernels recomputing every
    block (``passes.remat.full_names``), so the plans must recompute and one microbatch can fit."""
    from coplan.passes.remat import full_names, with_remat

    ctx, base = _compile_baseline(model, "cpu", batch)
    full = with_remat(base, full_names(ctx), ctx)
    return (ctx.price(base).memory.peak_bytes + ctx.price(full).memory.peak_bytes) / 2


def batches(model: str, device: str) -> dict[str, int]:
    """{"tight": ..., "loose": ...} for ``model`` on ``device`` (module docstring)."""
    if device == "cpu":
        return {"tight": 16, "loose": 4}
    batch = 1
    while batch < 4096:
        peak, budget = _baseline_peak(model, device, batch)
        if peak > budget:
            break
        batch *= 2
    return {"tight": batch, "loose": max(1, batch // 4)}


def write_plans(models: list[str], device: str, out: Path = PLAN_DIR) -> dict[str, Any]:
    """Plan both strategies for each model and batch; a manifest of batches and budgets."""
    from coplan.apply.predict import plan_for
    from coplan.search import Options, run_strategy
    from coplan.search.space import SearchSpace

    out.mkdir(parents=True, exist_ok=True)
    manifest: dict[str, Any] = {"device": device, "models": {}}
    for model in models:
        sizes = batches(model, device)
        entry: dict[str, Any] = {"batch_tight": sizes["tight"], "batch_loose": sizes["loose"], "budgets": {}}
        for kind, batch in sizes.items():
            budget = None
            if device == "cpu" and kind == "tight":
                budget = cpu_budget(model, batch)
            for run, strategy in STRATEGIES.items():
                ctx = _context(model, device, batch, budget)
                entry["budgets"][kind] = ctx.budget_bytes
                opts = Options(space=SearchSpace(dtypes=("bf16",)))
                if kind == "tight":
                    # the whole batch in one microbatch (module docstring)
                    opts = Options(
                        space=SearchSpace(dtypes=("bf16",), fixed=frozenset({"parallel"})),
                        base=plan_for(ctx, compute="bf16", microbatch=batch),
                    )
                t0 = time.perf_counter()
                plan = run_strategy(strategy, ctx, opts).plan
                (out / f"{model}_{kind}_{run}.json").write_text(plan.to_json() + "\n")
                print(
                    f"{model} {kind} (batch {batch}) {run}: planned in {time.perf_counter() - t0:.1f} s",
                    flush=True,
                )
        manifest["models"][model] = entry
    (out / f"manifest_{device}.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def _manifest(models: list[str], device: str, plan_dir: Path) -> dict[str, Any]:
    path = plan_dir / f"manifest_{device}.json"
    have = json.loads(path.read_text()) if path.exists() else {"models": {}}
    missing = [
        m
        for m in models
        if m not in have["models"]
        or not all((plan_dir / f"{m}_{k}_{r}.json").exists() for k in ("tight", "loose") for r in STRATEGIES)
    ]
    if missing:
        try:
            import ortools  # noqa: F401
        except ImportError:
            raise SystemExit(  # noqa: B904 (the missing plans are the message, not the import)
                f"no plans for {', '.join(missing)} in {plan_dir}: run `bench_gpu.py plans` where OR-Tools is"
            )
        done = write_plans(missing, device, plan_dir)
        have["models"].update(done["models"])
        have["device"] = device
        (plan_dir / f"manifest_{device}.json").write_text(json.dumps(have, indent=1) + "\n")
    return have


def priced_as(device: str, cluster: str) -> str:
    """The cluster preset that prices a run: the GPU present where it is another part than the
    plans were made for (an H200 runs the H100's plans, which fit it, at its own memory bandwidth)."""
    if device == "cuda" and cluster == "dgx-h100":
        import torch

        if torch.cuda.is_available() and "H200" in torch.cuda.get_device_name():
            return "dgx-h200"
    return cluster


def _one(
    model: str,
    device: str,
    batch: int,
    plan_file: Path,
    mode: str,
    steps: int,
    budget: float | None = None,
    profile: str | None = None,
    memory_cap: float | None = None,
) -> dict[str, Any]:
    """One run. ``memory_cap``: bytes the run may hold on a GPU (``plans_device_memory``), None:
    the device's own."""
    from coplan.apply.run import RunRequest, run_plan
    from coplan.hardware import load_cluster
    from coplan.models.spec import load_model_spec
    from coplan.plan.types import Plan

    spec, cluster, seq = MODELS[device][model]
    req = RunRequest(
        plan=Plan.load(str(plan_file)),
        spec=load_model_spec(spec),
        steps=steps,
        nproc=1,
        global_batch=batch,
        seq=seq,
        cluster=load_cluster(priced_as(device, cluster)),
        device=device,
        mode=mode,
        activation_budget=budget,
    )
    cap = hold_memory(device, memory_cap)
    t0 = time.perf_counter()
    try:
        out = run_plan(req)
    except Exception as e:  # an out-of-memory baseline is a result, not a crash of the benchmark
        return {
            "batch": batch,
            "error": f"{type(e).__name__}: {str(e)[:300]}",
            "wall_s": time.perf_counter() - t0,
        }
    finally:
        # the next run starts from an empty cache: its peak is its own, not this run's segments
        import gc

        gc.collect()
        if device == "cuda":
            import torch

            torch.cuda.empty_cache()
    m, p = out["measured"], out["predicted"]
    calibrated: dict[str, Any] = {}
    if profile:
        # the same run priced on the profile ``coplan calibrate`` fitted on this device
        from dataclasses import replace

        from coplan.apply.run import priced_request

        cal = priced_request(replace(req, cluster=load_cluster(profile)))[2]
        calibrated = {
            "predicted_calibrated_step_time_s": cal.step_time_s,
            "predicted_calibrated_peak_bytes": cal.peak_bytes,
        }
    return {
        **calibrated,
        "batch": batch,
        "tokens_per_s": batch * seq / m["step_time_s"],
        "step_time_s": m["step_time_s"],
        "predicted_step_time_s": p["step_time_s"],
        "peak_bytes": m["peak_bytes"],
        "predicted_peak_bytes": p["peak_bytes"],
        "saved_activation_bytes": m["saved_activation_bytes"],
        # what autograd kept, by shape: where a compiler's saved set and the price part
        "saved_by_shape": out.get("saved_by_shape", []),
        "predicted_saved_activation_bytes": p["saved_activation_bytes"],
        "grad_ok": out["grad_check"]["ok"],
        "grad_max_rel_err": out["grad_check"]["max_rel_err"],
        "activation_budget": budget,
        "memory_cap_bytes": cap,
        "microbatch": Plan.load(str(plan_file)).parallel.microbatch,
        # the AdamW form the run built (``coplan run``'s ``run.optimizer``), which repricing keeps
        "optimizer": out["run"].get("optimizer"),
        "recomputed": len(out["run"]["recomputed"]),
        "groups_planned": out["fusion"]["groups_planned"],
        "groups_honoured": out["fusion"]["groups_honoured"],
        # the plan priced without the groups the compiler left apart (``coplan run``'s report)
        "predicted_as_run_step_time_s": out.get("predicted_as_run", p)["step_time_s"],
        "wall_s": time.perf_counter() - t0,
    }


def plans_device_memory(model: str, device: str) -> float | None:
    """Bytes of the GPU the plans for ``model`` were made for (on a CPU: None). A run on a larger
    GPU is held to them (``hold_memory``), so the baselines have the memory the plans had; the
    plans' own budget keeps the caching allocator's and CUDA's headroom below it."""
    if device != "cuda":
        return None
    from coplan.hardware import load_cluster

    return float(load_cluster(MODELS[device][model][1]).devices[0].memory_bytes)


def hold_memory(device: str, cap: float | None) -> float | None:
    """Hold this process's CUDA allocations to ``cap`` bytes where the GPU has more (the caching
    allocator refuses beyond ``torch.cuda.set_per_process_memory_fraction`` of the device); the cap
    in force, or None."""
    if device != "cuda" or not cap:
        return None
    import torch

    total = torch.cuda.get_device_properties(0).total_memory
    if cap >= total:
        return None
    torch.cuda.set_per_process_memory_fraction(cap / total)
    return float(cap)


def _isolated(
    model: str,
    device: str,
    batch: int,
    plan_file: Path,
    mode: str,
    steps: int,
    budget: float | None,
    profile: str | None = None,
    memory_cap: float | None = None,
) -> dict[str, Any]:
    """``_one`` in a process of its own: a run that runs out of memory leaves nothing behind for the
    next (its CUDA context, compiled graphs and allocator cache go with the process), and each
    peak is that run's alone. Inductor's on-disk cache still serves what an earlier run compiled."""
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.json"
        code = (
            f"import json, sys; sys.path.insert(0, {str(HERE)!r}); import gpu_all; "
            "json.dump(gpu_all._one(*json.loads(sys.argv[1])), open(sys.argv[2], 'w'), default=str)"
        )
        args = json.dumps([model, device, batch, str(plan_file), mode, steps, budget, profile, memory_cap])
        proc = subprocess.run([sys.executable, "-c", code, args, str(out)], check=False)
        if out.exists():
            return dict(json.loads(out.read_text()))
    return {
        "batch": batch,
        "error": f"the run's process exited {proc.returncode}",
        "wall_s": time.perf_counter() - t0,
    }


def _budget(runs: dict[str, Any], kind: str) -> float:
    """The partitioner's fraction giving ``compile`` the joint plan's saved activations."""
    joint, comp = runs.get(f"coplan_joint@{kind}", {}), runs.get(f"compile@{kind}", {})
    key = "saved_activation_bytes"
    if key not in joint or key not in comp:  # a failed run: the cost model's figures
        key = "predicted_saved_activation_bytes"
    if not comp.get(key):
        return 1.0
    return max(0.0, min(1.0, joint.get(key, 0.0) / comp[key]))


def run_all(
    models: list[str],
    device: str,
    out_dir: Path,
    steps: int,
    plan_dir: Path = PLAN_DIR,
    kinds: tuple[str, ...] = ("tight", "loose"),
    only: tuple[str, ...] = RUNS,
    isolate: bool | None = None,
    profile: str | None = None,
) -> dict[str, Any]:
    """``isolate``: each run in a process of its own (``_isolated``); by default on a GPU only,
    where one run's memory would otherwise be the next one's. ``profile``: a cluster file
    ``coplan calibrate`` fitted on this device, which prices every run a second time."""
    import torch

    if isolate is None:
        isolate = device == "cuda"

    manifest = _manifest(models, device, plan_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    result: dict[str, Any] = {"device": name, "torch": torch.__version__, "steps": steps, "models": {}}
    result["priced_as"] = {m: priced_as(device, MODELS[device][m][1]) for m in models}
    result["planned_for"] = {m: MODELS[device][m][1] for m in models}
    if profile:
        result["calibrated_profile"] = Path(profile).name
    target = out_dir / "bench_gpu.json"
    for model in models:
        entry = manifest["models"][model]
        cap = plans_device_memory(model, device)
        runs: dict[str, Any] = {}
        result["models"][model] = {
            "batch_tight": entry["batch_tight"],
            "batch_loose": entry["batch_loose"],
            "seq": MODELS[device][model][2],
            "runs": runs,
        }
        t_model = time.perf_counter()
        for kind in kinds:
            batch = entry[f"batch_{kind}"]
            joint = plan_dir / f"{model}_{kind}_coplan_joint.json"
            for run in RUNS:
                if run not in only:
                    continue
                plan_file, mode, budget = joint, "plan", None
                if run in STRATEGIES:
                    plan_file = plan_dir / f"{model}_{kind}_{run}.json"
                elif run == "compile_budget":
                    mode, budget = "compile", _budget(runs, kind)
                else:
                    mode = run
                one = _isolated if isolate else _one
                got = runs[f"{run}@{kind}"] = one(
                    model, device, batch, plan_file, mode, steps, budget, profile, cap
                )
                target.write_text(json.dumps(result, indent=1) + "\n")
                shown = (
                    "failed: " + got["error"]
                    if "error" in got
                    else (
                        f"{got['step_time_s'] * 1e3:.1f} ms (pred {got['predicted_step_time_s'] * 1e3:.1f}), "
                        f"{got['tokens_per_s']:,.0f} tok/s, peak {got['peak_bytes'] / 2**30:.2f} GiB"
                    )
                )
                print(f"{model} {run}@{kind} b{batch}: {shown} [{got['wall_s']:.0f} s]", flush=True)
        result["models"][model]["wall_s"] = time.perf_counter() - t_model
        target.write_text(json.dumps(result, indent=1) + "\n")
    return result


def _ordered(meas: list[float], pred: list[float]) -> tuple[int, int]:
    """(pairs of runs the prediction orders as measured, pairs it orders at all). Two runs priced
    the same (one configuration run twice: the budgeted ``torch.compile`` at fraction 1.00 is the
    defaults') make no claim about their order, so their measured order, which is noise, is not
    counted."""
    right = total = 0
    for i in range(len(meas)):
        for j in range(i + 1, len(meas)):
            if math.isclose(pred[i], pred[j], rel_tol=1e-9):
                continue
            total += 1
            right += (pred[i] < pred[j]) == (meas[i] < meas[j])
    return right, total


def summary(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Per model and batch: the comparisons the issue states, and whether the cost model ranks the
    runs as measured."""
    rows = []
    for model, entry in result["models"].items():
        for kind in ("tight", "loose"):
            if not any(k.endswith(f"@{kind}") for k in entry["runs"]):
                continue
            runs = {r: entry["runs"].get(f"{r}@{kind}", {}) for r in RUNS}
            ok = {r: v for r, v in runs.items() if "step_time_s" in v}

            def ratio(a: str, b: str, ok: dict[str, Any] = ok) -> float:
                if a in ok and b in ok:
                    return ok[a]["tokens_per_s"] / ok[b]["tokens_per_s"]
                return math.nan

            names = list(ok)
            meas = [ok[n]["step_time_s"] for n in names]
            pred = [ok[n]["predicted_step_time_s"] for n in names]
            errs = {n: ok[n]["predicted_step_time_s"] / ok[n]["step_time_s"] - 1 for n in names}
            ordered = _ordered(meas, pred)
            cal_key = "predicted_calibrated_step_time_s"
            calibrated = None
            if names and all(cal_key in ok[n] for n in names):
                calibrated = {
                    "errors": {n: ok[n][cal_key] / ok[n]["step_time_s"] - 1 for n in names},
                    "pairs_ordered": list(_ordered(meas, [ok[n][cal_key] for n in names])),
                }
            rows.append(
                {
                    "model": model,
                    "batch": kind,
                    "joint_vs_compile": ratio("coplan_joint", "compile"),
                    "joint_vs_compile_budget": ratio("coplan_joint", "compile_budget"),
                    "joint_vs_sequential": ratio("coplan_joint", "coplan_sequential"),
                    "ranking_matches": ordered[0] == ordered[1],
                    "pairs_ordered": list(ordered),
                    "errors": errs,
                    "failed": [r for r in RUNS if r not in ok],
                    "calibrated": calibrated,
                }
            )
    return rows


def table(result: dict[str, Any]) -> str:
    steps = result.get("steps")
    head = f"device: {result['device']}, torch {result['torch']}, {steps} steps (median of the timed ones)"
    lines = [head, ""]
    lines.append(
        "| model | run | batch | step ms measured | predicted | error | tokens/s | peak GiB "
        "| saved GiB measured / predicted | recomputed | grad ok |"
    )
    lines.append("|---|---|---:|---:|---:|---:|---:|---:|---|---:|---|")
    for model, entry in result["models"].items():
        for key, r in entry["runs"].items():
            if "error" in r:
                lines.append(f"| {model} | {key} | {r['batch']} | failed: {r['error'][:60]} | | | | | | | |")
                continue
            budget = r.get("activation_budget")
            label = f"{key} (budget {budget:.2f})" if budget is not None else key
            ms, pred = r["step_time_s"] * 1e3, r["predicted_step_time_s"] * 1e3
            saved, saved_pred = (
                r["saved_activation_bytes"] / 2**30,
                r["predicted_saved_activation_bytes"] / 2**30,
            )
            lines.append(
                f"| {model} | {label} | {r['batch']} | {ms:.1f} | {pred:.1f} | {pred / ms - 1:+.1%} | "
                f"{r['tokens_per_s']:,.0f} | {r['peak_bytes'] / 2**30:.2f} | "
                f"{saved:.3f} / {saved_pred:.3f} | "
                f"{r['recomputed']} | {r['grad_ok']} |"
            )
    lines.append("")
    lines.append(
        "| model | batch | joint / compile | joint / compile with budget | joint / sequential "
        "| predicted ranking = measured (pairs ordered right) |"
    )
    lines.append("|---|---|---:|---:|---:|---|")

    def times(x: float) -> str:  # a ratio, or "-" where a run of the pair did not finish
        return f"{x:.2f}x" if math.isfinite(x) else "-"

    for s in summary(result):
        lines.append(
            f"| {s['model']} | {s['batch']} | {times(s['joint_vs_compile'])} | "
            f"{times(s['joint_vs_compile_budget'])} | {times(s['joint_vs_sequential'])} | "
            f"{s['ranking_matches']} ({s['pairs_ordered'][0]} of {s['pairs_ordered'][1]}"
            + (
                f"; on the calibrated profile {s['calibrated']['pairs_ordered'][0]} of "
                f"{s['calibrated']['pairs_ordered'][1]}"
                if s.get("calibrated")
                else ""
            )
            + ") |"
        )
    return "\n".join(lines)
