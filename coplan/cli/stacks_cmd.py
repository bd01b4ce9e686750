"""``coplan stacks``: the training-stack presets, and one stack's settings with their citations."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer
from rich import box
from rich.table import Table

from coplan.cli.common import print_json, stdout
from coplan.cli.options import StackFileOpt

if TYPE_CHECKING:
    from rich.console import Console

    from coplan.cost.stacks import StackSpec


def stacks(
    name: Annotated[
        str | None,
        typer.Argument(
            help="A preset to show setting by setting, each with its citation.", show_default=False
        ),
    ] = None,
    stack_file: StackFileOpt = None,
    json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")] = False,
) -> None:
    """List the training-stack presets (--stack NAME in estimate, plan and compare), or show one
    preset or --stack-file setting by setting with the source each setting cites."""
    from coplan.cost.stacks import StackError, load_stack, load_stack_file, stack_names

    if name is not None and stack_file is not None:
        raise StackError("stacks", None, "give a preset NAME or --stack-file, not both")
    if name is not None and name not in stack_names():
        raise StackError("stacks", None, f"unknown stack {name!r} (choose from {', '.join(stack_names())})")
    one = load_stack(name) if name is not None else load_stack_file(stack_file) if stack_file else None
    if one is not None:
        if json:
            print_json(_as_json(one))
        else:
            render_stack(one, stdout())
        return
    presets = {n: load_stack(n) for n in stack_names()}
    if json:
        print_json({n: _as_json(s) for n, s in presets.items()})
    else:
        render_presets(presets, stdout())


def _as_json(s: StackSpec) -> dict[str, object]:
    """A stack's settings, name and citations (``StackSpec.to_dict``) with its ``about``."""
    return s.to_dict() | {"about": s.about}


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def render_presets(presets: dict[str, StackSpec], console: Console) -> None:
    table = Table(title="stacks", title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    table.add_column("name", style="cyan", no_wrap=True)
    table.add_column("kernels", no_wrap=True)
    table.add_column("attention", no_wrap=True)
    table.add_column("sharding", no_wrap=True)
    table.add_column("ZeRO", no_wrap=True)
    table.add_column("TP PP CP", no_wrap=True)
    table.add_column("checkpointing")
    for name, s in presets.items():
        layouts = " ".join(_yes(f) for f in (s.tensor_parallel, s.pipeline_parallel, s.context_parallel))
        table.add_row(
            name,
            # a stack with a compile flag runs either kernel set, as a plan decides
            s.kernels + (" or inductor" if s.compile_preset else ""),
            s.attention_kernel,
            s.sharding + (" (HSDP)" if s.hybrid_shard else ""),
            ",".join(str(z) for z in s.zero_stages),
            layouts,
            ", ".join(s.checkpointing),
        )
    console.print(table)
    console.print(
        "coplan stacks NAME shows one setting by setting, with the source each cites", soft_wrap=True
    )


def render_stack(s: StackSpec, console: Console) -> None:
    console.print(f"[bold]{s.name}[/bold]", soft_wrap=True)
    if s.about:
        console.print(s.about, soft_wrap=True)
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    table.add_column("setting", style="cyan", no_wrap=True)
    table.add_column("value")
    table.add_column("source")
    values = s.to_dict()
    for setting, value in values.items():
        if setting in ("name", "sources"):
            continue
        shown = ", ".join(str(v) for v in value) if isinstance(value, list) else str(value)
        table.add_row(setting, shown or '""', s.source_of(setting) or "(default)")
    console.print(table)
