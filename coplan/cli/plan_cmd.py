"""``coplan plan``: for now, resolve the cluster and show the graph the planner will plan over."""

from __future__ import annotations

from typing import Annotated

import typer

from coplan.cli.common import positive, print_json, stdout
from coplan.cli.graph_cmd import Impl, JsonOpt, SeqOpt, load_graph, render_summary

NOTE = "the planner is not implemented yet; this is the graph it will plan over"


def plan(
    model: Annotated[
        str, typer.Option("--model", "-m", help="Model preset name or a spec JSON file.")
    ] = "gpt2-124m",
    cluster: Annotated[
        str, typer.Option("--cluster", "-c", help="Cluster or device preset name, or a JSON file.")
    ] = "dgx-h100",
    gpus: Annotated[int, typer.Option("--gpus", "-g", help="Number of devices to use.")] = 1,
    global_batch: Annotated[
        int | None, typer.Option("--global-batch", help="Sequences per optimizer step [default: 1].")
    ] = None,
    seq: SeqOpt = None,
    json: JsonOpt = False,
) -> None:
    """Plan a training run of a model on a cluster (planner pending: shows the graph to plan)."""
    from coplan.hardware import load_cluster

    positive("--gpus", gpus)
    batch = positive("--global-batch", global_batch, optional=True) or 1
    spec = load_cluster(cluster, gpus)
    g, wall = load_graph(model, batch, seq, Impl.builtin)
    from coplan.ir.summary import summarize

    summary = summarize(g)
    if json:
        print_json({"planned": False, "note": NOTE, "cluster": spec.to_dict(), "graph": summary.to_dict()})
        return
    console = stdout()
    console.print(f"[yellow]note:[/yellow] {NOTE}", soft_wrap=True)
    console.print(f"[bold]cluster[/bold] {spec.summary()}", soft_wrap=True)
    render_summary(summary, wall, console)
