"""``coplan run``: train N steps under a plan and show measured next to predicted.

    coplan run --model M --plan plan.json --steps N [--nproc K] [--batch B] [--seq S] [--json]

``--batch`` (``--global-batch``) is sequences per optimizer step and ``--seq`` the sequence length;
both default to the plan's and must match it (a plan is made for one job). A plan made for another
model, world size (``--nproc``), batch or sequence length is refused: one line, exit 2.
``--record runs.jsonl`` appends the run for ``coplan calibrate --runs``; ``--history`` (or ``--db
PATH``) records it in the history database for ``coplan history``. A run whose loss is not
finite or whose gradient check fails exits 1, after its output, with one ``error:`` line saying which.
"""

from __future__ import annotations

import enum
import json as jsonlib
import math
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich import box
from rich.markup import escape
from rich.table import Table

from coplan.cli.common import human_bytes, interruptible, positive, print_json, stdout
from coplan.cli.history_cmd import RecordDbOpt, RecordHistoryOpt, recording_to, say_recorded
from coplan.cli.options import Device, JsonOpt
from coplan.errors import SpecError
from coplan.fileio import append_text, check_output

if TYPE_CHECKING:
    from coplan.hardware.cluster import ClusterSpec
    from coplan.plan.types import Plan


class Mode(enum.StrEnum):  # coplan.apply.step.MODES
    plan = "plan"
    compile = "compile"
    eager = "eager"


class HostAllocator(enum.StrEnum):  # coplan.hardware.allocator.HOST_ALLOCATORS
    pinned = "pinned"
    default = "default"


def _cluster(name: str | None, plan: Plan, device: str) -> ClusterSpec:
    from coplan.hardware import load_cluster

    if name is not None:
        return load_cluster(name)
    try:
        return load_cluster(plan.cluster)
    except SpecError:
        if device == "cpu":
            return load_cluster("cpu")
        raise SpecError(
            "--cluster", None, f"the plan's cluster {plan.cluster!r} is not a preset or file: name one"
        ) from None


def run(
    model: Annotated[str, typer.Option("--model", "-m", help="Model preset name or a spec JSON file.")],
    plan: Annotated[Path, typer.Option("--plan", "-p", help="Plan JSON file (coplan plan --out).")],
    steps: Annotated[int, typer.Option("--steps", "-n", help="Training steps to run.")] = 5,
    nproc: Annotated[int, typer.Option("--nproc", help="Processes (devices) to train on.")] = 1,
    batch: Annotated[
        int | None,
        typer.Option(
            "--global-batch",
            "--batch",
            "-b",
            help="Sequences per optimizer step, all processes together \\[default: the plan's].",
            show_default=False,
        ),
    ] = None,
    seq: Annotated[
        int | None, typer.Option("--seq", "-s", help="Tokens per sequence \\[default: the plan's].")
    ] = None,
    device: Annotated[
        Device, typer.Option("--device", "-d", help="Where to train (cuda: NCCL between processes).")
    ] = Device.auto,
    cluster: Annotated[
        str | None,
        typer.Option(
            "--cluster", "-c", help="Hardware the prediction prices \\[default: the plan's, else cpu]."
        ),
    ] = None,
    threads: Annotated[
        int, typer.Option("--threads", help="Torch threads per process \\[default: cores / processes].")
    ] = 0,
    mode: Annotated[
        Mode,
        typer.Option(
            "--mode",
            help="plan (apply it), or a baseline with the plan's layout and batch: compile "
            "(torch.compile defaults) or eager; 16-bit plans' baselines run under autocast.",
        ),
    ] = Mode.plan,
    activation_budget: Annotated[
        float | None,
        typer.Option(
            "--activation-budget",
            help="With --mode compile: PyTorch's memory-budgeted partitioner at this fraction "
            "(torch._functorch.config.activation_memory_budget; 1 keeps its default saved set, 0 "
            "recomputes all it can).",
            show_default=False,
        ),
    ] = None,
    host_allocator: Annotated[
        HostAllocator,
        typer.Option(
            "--host-allocator",
            help="pinned (on a CPU, hold glibc malloc's mmap threshold at 32 MiB and heap trimming "
            "off, so steps do not page-fault their tensors in again) or default.",
        ),
    ] = HostAllocator.pinned,
    record: Annotated[
        Path | None,
        typer.Option("--record", help="Append this run to a JSONL file for coplan calibrate --runs."),
    ] = None,
    history: RecordHistoryOpt = False,
    db: RecordDbOpt = None,
    json: JsonOpt = False,
) -> None:
    """Train a few steps under a plan; report measured against predicted."""
    from coplan.apply.run import RunFailed, RunRequest, failure, resolve_device, run_plan
    from coplan.inspect.history import HistoryError
    from coplan.models.spec import load_model_spec
    from coplan.plan.types import Plan

    positive("--steps", steps)
    positive("--nproc", nproc)
    positive("--batch", batch, optional=True)
    positive("--seq", seq, optional=True)
    if threads < 0:
        raise SpecError("--threads", None, f"must be >= 0, got {threads}")
    if activation_budget is not None:
        if mode != Mode.compile:
            raise SpecError("--activation-budget", None, f"needs --mode compile, got --mode {mode.value}")
        if not 0.0 <= activation_budget <= 1.0:
            raise SpecError("--activation-budget", None, f"must be between 0 and 1, got {activation_budget}")
    check_output("--record", record)
    record_db = recording_to(history, db)
    dev = resolve_device(device.value)
    spec = load_model_spec(model)
    p = Plan.load(str(plan))
    req = RunRequest(
        plan=p,
        spec=spec,
        steps=steps,
        nproc=nproc,
        global_batch=batch or p.global_batch,
        seq=spec.resolve_seq(seq or p.seq),
        cluster=_cluster(cluster, p, dev),
        device=dev,
        threads=threads,
        mode=mode.value,
        host_allocator=host_allocator.value,
        activation_budget=activation_budget,
    )
    with interruptible("training stopped; nothing recorded"):
        out = run_plan(req)
    if record is not None:
        append_record(record, req, out)
    unrecorded = None
    if record_db is not None:
        # a database that became unusable during a long run must not cost the run's output: the
        # output comes first (record_id null), then the error
        try:
            out = {**out, "record_id": record_history(record_db, req, out)}
        except HistoryError as err:
            out, unrecorded = {**out, "record_id": None}, err
    if json:
        print_json(_jsonable(out))
    else:
        show(out)
        say_recorded(out.get("record_id"), record_db)
    why = failure(out)  # after the output, so a failed run's numbers are still shown and recorded
    if why is not None:
        raise RunFailed(why)
    if unrecorded is not None:
        raise unrecorded


def append_record(path: Path, req: Any, out: dict[str, Any]) -> None:
    """One JSON line per run: the job, the plan and what was measured and predicted."""
    line = {
        "model": req.spec.to_dict() if hasattr(req.spec, "to_dict") else req.spec.name,
        "plan": req.plan.to_dict(),
        "nproc": req.nproc,
        "device": req.device,
        "global_batch": req.global_batch,
        "seq": req.seq,
        **{k: out[k] for k in ("measured", "predicted", "grad_check")},
        "cluster": out["run"]["cluster"],
        # what coplan calibrate --runs prices the run again with
        "mode": req.mode,
        "device_name": out["run"].get("device_name", req.device),
        "cluster_spec": req.cluster.to_dict(),
    }
    append_text(path, jsonlib.dumps(_jsonable(line)) + "\n")


def record_history(path: Path, req: Any, out: dict[str, Any]) -> int:
    """The run in the history database (``coplan history``): its times, measured per timed step, and
    its whole ``--json`` object; the new record's id."""
    from coplan.cli.history_cmd import record
    from coplan.inspect.history import command_record

    r = out["run"]
    times = r.get("step_times_s") or []
    samples = [times[i] for i in r.get("timed_steps") or [] if 0 <= i < len(times)]
    entry = command_record(
        "run",
        model=req.spec.name,
        batch=req.global_batch,
        seq=req.seq,
        device=req.device,
        hardware=req.cluster.name,
        fingerprint=r.get("plan"),
        predicted_step_s=out["predicted"].get("step_time_s"),
        measured={"step_s": out["measured"].get("step_time_s"), "samples": samples},
        payload=_jsonable(out),
    )
    return record(path, entry)


def _jsonable(x: Any) -> Any:
    """NaN and infinity as null (JSON has neither)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    return x


def show(out: dict[str, Any]) -> None:
    console = stdout()
    r = out["run"]
    console.print(
        f"[bold]{r['model']}[/bold] plan {r['plan']} ({r['layout']}, {r['precision']}) on {r['nproc']} x "
        f"{r['device']}, global batch {r['global_batch']} x seq {r['seq']}, {r['steps']} steps",
        soft_wrap=True,
    )
    table = Table(box=box.SIMPLE_HEAD)
    for col in ("", "measured", "predicted", "error"):
        table.add_column(col, justify="left" if not col else "right")
    m, p = out["measured"], out["predicted"]
    for key, label, fmt in (
        ("step_time_s", "step time", lambda v: f"{v * 1e3:.2f} ms"),
        ("saved_activation_bytes", "saved activations", human_bytes),
        ("peak_bytes", "peak memory", human_bytes),
    ):
        mv, pv = m[key], p[key]
        ok = isinstance(mv, int | float) and math.isfinite(mv) and mv > 0
        table.add_row(label, fmt(mv) if ok else "-", fmt(pv), f"{pv / mv - 1:+.1%}" if ok else "-")
    console.print(table)
    g = out["grad_check"]
    console.print(
        f"gradients vs eager fp32: max relative error {g['max_rel_err']:.2e} "
        f"(tolerance {g['tolerance']:.0e}) " + ("[green]ok[/green]" if g["ok"] else "[red]FAILED[/red]"),
        soft_wrap=True,
    )
    console.print("loss per step: " + ", ".join(f"{v:.4f}" for v in out["loss"]), soft_wrap=True)
    f = out["fusion"]
    console.print(f"fusion groups honoured: {f['groups_honoured']} of {f['groups_planned']}")
    ran = out.get("predicted_as_run")
    if ran is not None:
        st = m["step_time_s"]
        err = f" ({ran['step_time_s'] / st - 1:+.1%} of measured)" if st and math.isfinite(st) else ""
        console.print(
            f"predicted as run (the plan's groups the compiler kept, {ran['groups']} of "
            f"{ran['groups_planned']}): {ran['step_time_s'] * 1e3:.2f} ms{err}",
            soft_wrap=True,
        )
    for g in f.get("not_honoured", [])[:10]:
        ops = ", ".join(g["ops"][:4]) + (", ..." if len(g["ops"]) > 4 else "")
        line = f"  group {g['group']} ({ops}) not honoured: {g['reason']}"
        console.print(line, soft_wrap=True, markup=False)
    if r["recomputed"]:
        console.print(f"recomputed in backward: {len(r['recomputed'])} tensors")
    if r["not_found"]:
        console.print(
            f"[yellow]plan tensors with no node in the graph: {', '.join(r['not_found'][:5])}[/yellow]"
        )
    for note in r["notes"]:
        console.print(f"[dim]{escape(note)}[/dim]", soft_wrap=True)
