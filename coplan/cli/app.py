"""The Typer application and ``main()``, which turns user errors into one-line messages."""

from __future__ import annotations

import sys
from collections.abc import Sequence

import typer

from coplan.cli import (
    calibrate_cmd,
    coupling_cmd,
    dashboard_cmd,
    estimate_cmd,
    graph_cmd,
    hardware_cmd,
    history_cmd,
    inspect_cmd,
    learn_cmd,
    plan_cmd,
    run_cmd,
    stacks_cmd,
)
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
app.command("stacks")(stacks_cmd.stacks)
app.command("plan")(plan_cmd.plan)
app.command("compare")(plan_cmd.compare)
app.command("estimate")(estimate_cmd.estimate)
app.command("calibrate")(calibrate_cmd.calibrate)
app.command("run")(run_cmd.run)
app.command("inspect")(inspect_cmd.inspect)
app.command("coupling")(coupling_cmd.coupling)
app.add_typer(history_cmd.app, name="history")
app.command("dashboard")(dashboard_cmd.dashboard)
app.add_typer(learn_cmd.app, name="learn")


def report(err: CoplanError) -> int:
    """Print ``err`` as one line on stderr; return its exit code."""
    sys.stdout.flush()
    sys.stderr.write(f"error: {one_line(str(err))}\n")
    sys.stderr.flush()
    return int(getattr(err, "exit_code", 2))


try:  # Typer from 0.2x carries its own copy of click; earlier ones use click itself
    from typer._click.exceptions import ClickException
except ImportError:  # pragma: no cover - depends on the installed Typer
    from click.exceptions import ClickException  # type: ignore[assignment]


def _usage(err: ClickException) -> int:
    """A usage error (unknown option, a value not among the choices, not a number) as one line."""
    ctx = getattr(err, "ctx", None)
    where = f"{ctx.command_path}: " if ctx is not None and ctx.command_path else ""
    sys.stdout.flush()
    message = one_line(err.format_message()).replace("Value error, ", "")
    sys.stderr.write(f"error: {where}{message}\n")
    sys.stderr.flush()
    return err.exit_code


def main(argv: Sequence[str] | None = None) -> None:
    """Console-script entry point: run the app; ``CoplanError`` and usage errors -> one line on
    stderr and their exit code (2 bad input, 3 nothing fits, 1 a failed run).

    Always ends with ``SystemExit``, as a console script should.
    """
    args = list(argv) if argv is not None else sys.argv[1:]
    try:
        app(args=args or ["--help"], prog_name="coplan", standalone_mode=False)
    except CoplanError as err:
        raise SystemExit(report(err)) from None
    except ClickException as err:
        raise SystemExit(_usage(err)) from None
    except typer.Exit as done:  # --help, or a command's own typer.Exit
        raise SystemExit(done.exit_code) from None
    except typer.Abort:  # Ctrl-C where no command handled it
        sys.stderr.write("error: interrupted\n")
        raise SystemExit(130) from None
    raise SystemExit(0)
