"""The Typer application and ``main()``, which turns user errors into one-line messages."""

from __future__ import annotations

import sys
from collections.abc import Sequence

import typer

from coplan.cli import calibrate_cmd, coupling_cmd, estimate_cmd, graph_cmd, hardware_cmd, plan_cmd, run_cmd
from coplan.cli.common import one_line
from coplan.errors import CoplanError

app = typer.Typer(
    name="coplan",
    help="Plan ML training: fusion, rematerialization, parallelism and precision, jointly.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
app.command("graph")(graph_cmd.graph)
app.command("hardware")(hardware_cmd.hardware)
app.command("plan")(plan_cmd.plan)
app.command("compare")(plan_cmd.compare)
app.command("estimate")(estimate_cmd.estimate)
app.command("calibrate")(calibrate_cmd.calibrate)
app.command("run")(run_cmd.run)
app.command("coupling")(coupling_cmd.coupling)


def report(err: CoplanError) -> int:
    """Print ``err`` as one line on stderr; return its exit code."""
    sys.stdout.flush()
    sys.stderr.write(f"error: {one_line(str(err))}\n")
    sys.stderr.flush()
    return int(getattr(err, "exit_code", 2))


def main(argv: Sequence[str] | None = None) -> None:
    """Console-script entry point: run the app; ``CoplanError`` -> one line on stderr and its exit code.

    Always ends with ``SystemExit`` (click's standalone mode), as a console script should.
    """
    try:
        app(args=list(argv) if argv is not None else None, prog_name="coplan")
    except CoplanError as err:
        raise SystemExit(report(err)) from None
