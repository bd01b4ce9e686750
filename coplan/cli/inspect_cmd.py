"""``coplan inspect``: compile one training step with ``torch.compile`` and show what the compiler did."""

from __future__ import annotations

import contextlib
import enum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from coplan.cli.choices import Optimizer
from coplan.cli.common import human_bytes, positive, print_json, stdout
from coplan.cli.options import DEFAULT_MODEL, GlobalBatchOpt, HtmlOpt, JsonOpt, ModelOpt
from coplan.errors import CoplanError

#: the inspected step's default size: small enough to compile and run on a laptop CPU in seconds;
#: Inductor's decisions for a transformer block do not change with these sizes in any way that
#: matters here (pass the job's own sizes to see its exact kernels)
DEFAULT_BATCH = 2
DEFAULT_SEQ = 128


class InspectDevice(enum.StrEnum):
    cpu = "cpu"
    cuda = "cuda"


class InspectImpl(enum.StrEnum):
    builtin = "builtin"  # coplan's own PyTorch model of the spec
    hf = "hf"  # the Hugging Face transformers model of the spec


def _model(
    model: str, impl: InspectImpl, batch: int, seq: int | None
) -> tuple[Any, tuple[Any, ...], dict[str, Any], int]:
    import torch

    from coplan.models.spec import load_model_spec
    from coplan.models.transformer import build_model, example_batch

    hf = _hf_config(model)
    if hf is not None:
        return _hf_config_model(model, hf, batch, seq)
    spec = load_model_spec(model)
    s = min(seq or DEFAULT_SEQ, spec.seq_len) if seq is None else seq
    if s > spec.seq_len:
        raise CoplanError(f"--seq {s}: model {spec.name!r} takes at most {spec.seq_len} tokens")
    torch.manual_seed(0)
    idx, targets = example_batch(spec, batch, s)
    if impl is InspectImpl.hf:
        from coplan.models.hf import hf_model

        module = hf_model(spec)
        return module, (), {"input_ids": idx, "labels": targets}, s
    return build_model(spec), (idx, targets), {}, s


def _hf_config(model: str) -> dict[str, Any] | None:
    """The contents of ``model`` when it is a Hugging Face ``config.json`` (it has ``model_type``)."""
    import json

    from coplan.fileio import looks_like_file, read_text

    if not (model.lower().endswith(".json") or looks_like_file(model)):
        return None
    try:
        data = json.loads(read_text(Path(model), model))
    except (json.JSONDecodeError, ValueError):
        return None  # not JSON: the spec loader names the error
    return data if isinstance(data, dict) and "model_type" in data else None


def _hf_config_model(
    path: str, data: dict[str, Any], batch: int, seq: int | None
) -> tuple[Any, tuple[Any, ...], dict[str, Any], int]:
    """The ``transformers`` causal LM of a config file, as ``from_config`` builds it (random
    weights, nothing downloaded), and a random batch of token ids as its input and labels."""
    import torch

    from coplan.models.hf import _transformers

    tf = _transformers()
    kind = str(data["model_type"])
    fields = {
        k: v for k, v in data.items() if k not in ("model_type", "architectures", "transformers_version")
    }
    try:
        cfg = tf.AutoConfig.for_model(kind, **fields)
        cfg._attn_implementation = "sdpa"
        module = tf.AutoModelForCausalLM.from_config(cfg)
    except (ValueError, KeyError, TypeError) as err:
        raise CoplanError(f"--model {path}: transformers cannot build a causal LM of it: {err}") from None
    longest = next(
        (int(getattr(cfg, k)) for k in ("max_position_embeddings", "n_positions") if getattr(cfg, k, None)),
        None,
    )
    s = seq or (min(DEFAULT_SEQ, longest) if longest else DEFAULT_SEQ)
    if longest is not None and s > longest:
        raise CoplanError(f"--seq {s}: {path} takes at most {longest} positions")
    torch.manual_seed(0)
    ids = torch.randint(0, int(cfg.vocab_size), (batch, s))
    return module, (), {"input_ids": ids, "labels": ids.clone()}, s


def inspect(
    model: ModelOpt = DEFAULT_MODEL,
    batch: GlobalBatchOpt = None,
    seq: Annotated[
        int | None, typer.Option("--seq", "-s", help=f"Tokens per sequence \\[default: {DEFAULT_SEQ}].")
    ] = None,
    device: Annotated[
        InspectDevice, typer.Option("--device", help="Where to compile and run.")
    ] = InspectDevice.cpu,
    impl: Annotated[
        InspectImpl, typer.Option("--impl", help="Which implementation of the model.")
    ] = InspectImpl.builtin,
    hardware: Annotated[
        str | None,
        typer.Option(
            "--hardware",
            help="Device or cluster preset, or a profile file (coplan calibrate), the kernels are priced "
            "on \\[default: the local device's].",
        ),
    ] = None,
    steps: Annotated[int, typer.Option("--steps", help="Steps timed after the compiling one.")] = 3,
    optimizer: Annotated[
        Optimizer,
        typer.Option(
            "--optimizer",
            help="AdamW implementation: fused (one kernel, torchtitan's default), or foreach / for-loop "
            "(compiled by Inductor: its optimizer kernels, and a much longer compile).",
        ),
    ] = Optimizer.fused,
    record: Annotated[
        bool, typer.Option("--record/--no-record", help="Store the result in the history database.")
    ] = True,
    db: Annotated[
        Path | None,
        typer.Option("--db", help="History database \\[default: $COPLAN_DB, else the user's data folder]."),
    ] = None,
    json: JsonOpt = False,
    html: HtmlOpt = None,
) -> None:
    """Compile one training step (forward, backward, optimizer) with torch.compile and show what the
    compiler did: every pass with its fingerprint, graph breaks, fallbacks, patterns that should
    have fused and did not (with what fusing them would save), the kernels and their lineage, and
    the predicted and measured step time. The result is recorded in the history (coplan history)."""
    from coplan.fileio import check_output
    from coplan.inspect import history

    b = DEFAULT_BATCH if batch is None else batch
    positive("--batch", b)
    positive("--seq", seq, optional=True)
    if steps < 0:
        raise CoplanError(f"--steps must be >= 0, got {steps}")
    check_output("--html", html)
    db_path = history.check_writable(db or history.default_db_path()) if record else None
    if hardware is not None:
        from coplan.inspect.api import pricing_device

        pricing_device(hardware)
    import torch

    if device is InspectDevice.cuda and not torch.cuda.is_available():
        raise CoplanError("--device cuda: no CUDA device is visible")
    module, args, kwargs, s = _model(model, impl, b, seq)
    dev = torch.device(device.value)
    module = module.to(dev)
    args = tuple(a.to(dev) for a in args)
    kwargs = {k: v.to(dev) for k, v in kwargs.items()}
    from coplan.inspect.api import inspect_module
    from coplan.inspect.step import adamw

    # a compile takes a minute or two on a CPU: say what is running (on stderr, where it does not
    # mix with --json; a terminal shows it as a spinner, a pipe as nothing)
    what = f"compiling one training step of {model} with torch.compile" + (
        f", then timing {steps} steps" if steps else ""
    )
    status = Console(stderr=True).status(what) if not json else contextlib.nullcontext()
    with status:
        result = inspect_module(
            module,
            args,
            kwargs,
            steps=steps,
            hardware=hardware,
            name=model,
            batch=b,
            seq=s,
            optimizer=adamw(optimizer.value),
        )
    rec = result.record
    if db_path is not None:
        rec["record_id"] = history.store(db_path, rec)
    if html is not None:
        result.html(html)
    if json:
        print_json(rec)
    else:
        render(rec, stdout(), db_path)


def _us(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e6:,.1f} us"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:,.2f} ms"


def _table(title: str) -> Table:
    return Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)


def render(rec: dict[str, Any], console: Console, db: Path | None) -> None:
    head = Table.grid(padding=(0, 2))
    head.add_column(style="cyan", no_wrap=True)
    head.add_column()
    head.add_row("model", f"[bold]{rec['model']}[/bold], batch {rec['batch']} x seq {rec['seq']}")
    head.add_row("device", f"{rec['device']} (priced as {rec['hardware']}), torch {rec['torch']}")
    head.add_row("fingerprint", rec["fingerprint"])
    head.add_row("kernels", f"{rec['kernels']} ({human_bytes(rec['bytes_moved'])} moved per step)")
    measured = (rec.get("measured") or {}).get("step_s")
    head.add_row("step time", f"predicted {_ms(rec['predicted_step_s'])}, measured {_ms(measured)}")
    head.add_row("compile", f"{rec['compile_s']:.1f} s, {rec.get('recompiles', 0)} recompiles")
    opt = rec.get("optimizer") or {}
    if opt:
        how = "compiled" if opt.get("compiled") else "eager (not traced by torch.compile)"
        head.add_row("optimizer", f"{opt.get('name')} ({opt.get('implementation')}), {how}")
    console.print(head)

    graphs = _table("graphs")
    for col in ("graph", "fingerprint", "ops", "kernels"):
        graphs.add_column(col, justify="right" if col in ("ops", "kernels") else "left")
    for g in rec["graphs"]:
        graphs.add_row(g["name"], g["fingerprint"], str(g["ops"]), str(g["kernels"]))
    console.print()
    console.print(graphs)

    passes = _table("passes that changed a graph (all passes: --json or --html)")
    for col in ("graph", "stage", "pass", "fingerprint", "ops"):
        passes.add_column(col)
    for p in rec["passes"]:
        if p["ops_before"] != p["ops_after"] or p["stage"] in (
            "capture",
            "partition",
            "scheduler",
            "codegen",
        ):
            passes.add_row(
                p["graph"], p["stage"], p["name"], p["fingerprint"], f"{p['ops_before']} -> {p['ops_after']}"
            )
    console.print()
    console.print(passes)

    if rec["graph_breaks"]:
        breaks = _table("graph breaks")
        breaks.add_column("where")
        breaks.add_column("reason")
        for b in rec["graph_breaks"]:
            breaks.add_row(b["location"], b["reason"])
        console.print()
        console.print(breaks)
    if rec["fallbacks"]:
        fb = _table("fallbacks (ops Inductor did not generate code for)")
        for col in ("graph", "op", "count", "reason"):
            fb.add_column(col)
        for f in rec["fallbacks"]:
            fb.add_row(f["graph"], f["op"], str(f["count"]), f["reason"])
        console.print()
        console.print(fb)
    unfused = rec["unfused"]
    if unfused:
        un = _table(f"unfused patterns ({len(unfused)}; the 10 costliest)")
        for col in ("graph", "ops", "count", "saving/step", "reason"):
            un.add_column(col, justify="right" if col in ("count", "saving/step") else "left")
        for u in unfused[:10]:
            via = f" via {', '.join(u['via'])}" if u["via"] else ""
            un.add_row(
                u["graph"],
                " -> ".join(u["ops"]) + via,
                str(u["count"]),
                _us(u["predicted_saving_s"]),
                u["reason"],
            )
        console.print()
        console.print(un)
    if db is not None and rec.get("record_id") is not None:
        console.print()
        console.print(f"recorded as #{rec['record_id']} in {db}")
