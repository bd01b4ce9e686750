"""``coplan dashboard``: serve a local web page over the history of ``coplan inspect`` records."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def dashboard(
    db: Annotated[
        Path | None,
        typer.Option(
            "--db",
            help="The history database (default: $COPLAN_DB, else ~/.local/share/coplan/history.sqlite).",
        ),
    ] = None,
    port: Annotated[
        int,
        typer.Option("--port", help="Port on 127.0.0.1; 0 picks a free one."),
    ] = 8050,
    open_browser: Annotated[
        bool,
        typer.Option("--open/--no-open", help="Open the page in the default web browser."),
    ] = False,
) -> None:
    """Serve a web page over the history: per model, kernels, fallbacks, unfused patterns and step
    time over time, each regression linked to its diff against the previous record.

    Listens on 127.0.0.1 only and never writes the history. Ctrl-C stops it.
    """
    from coplan.inspect.dashboard import serve
    from coplan.inspect.history import default_db_path

    serve(db if db is not None else default_db_path(), port, open_browser=open_browser)
