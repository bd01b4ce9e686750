"""``coplan graph``: capture (or build) one training step of a model and summarise its IR."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING, Annotated

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from coplan.cli.common import exact, human_bytes, human_count, human_flops, positive, print_json, stdout
from coplan.cli.options import DEFAULT_GLOBAL_BATCH, DEFAULT_MODEL, GlobalBatchOpt, JsonOpt, ModelOpt, SeqOpt
from coplan.errors import CoplanError

if TYPE_CHECKING:
    from coplan.ir.summary import GraphSummary
    from coplan.ir.types import Graph
    from coplan.models.spec import ModelSpec


class Impl(enum.StrEnum):
    """How the graph is obtained."""

    builtin = "builtin"  # trace coplan's own PyTorch model of the spec
    hf = "hf"  # trace the Hugging Face transformers model of the spec
    synthetic = "synthetic"  # build the IR directly from the spec, no tracing


def load_graph(model: str, batch: int, seq: int | None, impl: Impl = Impl.builtin) -> tuple[Graph, float]:
    """Resolve ``model``, check the sizes, and return the validated graph and the wall time spent."""
    from coplan.models.spec import load_model_spec

    positive("--batch", batch)
    positive("--seq", seq, optional=True)
    spec = load_model_spec(model)
    start = time.perf_counter()
    graph = _build(spec, batch, seq, impl)
    from coplan.ir.checker import validate

    validate(graph)
    return graph, time.perf_counter() - start


def _build(spec: ModelSpec, batch: int, seq: int | None, impl: Impl) -> Graph:
    if impl is Impl.synthetic:
        try:
            from coplan.capture.synthetic import build_graph
        except ImportError as err:
            if err.name not in ("coplan.capture.synthetic", None):
                raise
            raise CoplanError("--impl synthetic: the synthetic graph builder is not available") from None
        return build_graph(spec, batch, seq)
    from coplan.capture.api import capture_hf, capture_spec

    capture = capture_hf if impl is Impl.hf else capture_spec
    return capture(spec, batch, seq)


def graph(
    model: ModelOpt = DEFAULT_MODEL,
    batch: GlobalBatchOpt = None,
    seq: SeqOpt = None,
    impl: Annotated[Impl, typer.Option("--impl", help="How to obtain the graph.")] = Impl.builtin,
    json: JsonOpt = False,
) -> None:
    """Capture one training step (forward, backward, optimizer) of a model and summarise its graph.

    The step is one device's, without gradient accumulation: all ``--batch`` sequences in one pass.
    """
    g, wall = load_graph(model, DEFAULT_GLOBAL_BATCH if batch is None else batch, seq, impl)
    from coplan.ir.summary import summarize

    summary = summarize(g)
    if json:
        print_json(summary.to_dict())
    else:
        render_summary(summary, wall, stdout())


# --- rendering ---------------------------------------------------------------------------------


def _table(title: str) -> Table:
    return Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)


def render_summary(s: GraphSummary, wall_s: float, console: Console) -> None:
    """The human-readable summary of a graph: headline numbers, then ops by phase and by kind."""
    head = Table.grid(padding=(0, 2))
    head.add_column(style="cyan", no_wrap=True)
    head.add_column()
    head.add_row("model", f"[bold]{s.model}[/bold] ({s.source}, optimizer {s.optimizer or '-'})")
    head.add_row("batch × seq", f"{s.batch} × {s.seq} = {exact(s.batch * s.seq)} tokens per step")
    head.add_row("parameters", f"{human_count(s.params)} ({exact(s.params)})")
    head.add_row("FLOPs per step", f"{human_flops(s.flops)} ({exact(s.flops)}) on matrix units")
    head.add_row("vector FLOPs", f"{human_flops(s.vector_flops)} ({exact(s.vector_flops)})")
    head.add_row(
        "saved activations",
        f"{human_bytes(s.activation_bytes)} ({exact(s.activation_bytes)} bytes) kept for backward",
    )
    head.add_row("blocks", str(s.blocks))
    head.add_row("ops / tensors", f"{exact(s.ops)} / {exact(s.tensors)}")
    head.add_row("fingerprint", s.fingerprint)
    tracing = f" (tracing {s.capture_s:.2f} s)" if s.capture_s else ""
    head.add_row("time", f"{wall_s:.2f} s to capture/build and check{tracing}")
    console.print(head)

    phases = _table("by phase")
    phases.add_column("phase")
    phases.add_column("ops", justify="right")
    phases.add_column("FLOPs", justify="right")
    phases.add_column("share", justify="right")
    for phase, count in s.ops_by_phase.items():
        flops = s.flops_by_phase.get(phase, 0)
        share = f"{100 * flops / s.flops:.0f}%" if s.flops else "-"
        phases.add_row(phase, exact(count), human_flops(flops), share)
    phases.add_row("[bold]total[/bold]", exact(s.ops), human_flops(s.flops), "100%" if s.flops else "-")
    console.print()
    console.print(phases)

    kinds = _table("ops by kind")
    items = sorted(s.ops_by_kind.items(), key=lambda kv: (-kv[1], kv[0]))
    half = (len(items) + 1) // 2
    for _ in range(2 if len(items) > 1 else 1):
        kinds.add_column("kind")
        kinds.add_column("ops", justify="right")
    for i in range(half):
        row = [items[i][0], exact(items[i][1])]
        if len(items) > 1:
            row += [items[i + half][0], exact(items[i + half][1])] if i + half < len(items) else ["", ""]
        kinds.add_row(*row)
    console.print()
    console.print(kinds)
