"""Errors that the CLI turns into one-line messages (no traceback).

Every user-facing failure is a ``CoplanError``; the CLI prints ``error: <message>`` and exits with
``exit_code``. Internal bugs are not ``CoplanError`` and keep their traceback.
"""

from __future__ import annotations


class CoplanError(Exception):
    """A failure caused by the user's input, reported as one line."""

    exit_code: int = 2


class SpecError(CoplanError):
    """A spec file or preset that cannot be used. Names the source and the field."""

    def __init__(self, source: str, field: str | None, message: str) -> None:
        self.source = source
        self.field = field
        self.reason = message
        where = f"{source}: field '{field}'" if field else source
        super().__init__(f"{where}: {message}")


class GraphError(CoplanError):
    """An IR that violates one of its invariants (see ``coplan.ir.checker``)."""

    exit_code = 1


class CaptureError(CoplanError):
    """A model that could not be traced into the IR."""

    exit_code = 1


class Interrupted(CoplanError):
    """A command stopped by Ctrl-C (SIGINT); the message says what was stopped and what was kept.
    Exit code 130, the shell's for a command ended by SIGINT."""

    exit_code = 130

    def __init__(self, what: str) -> None:
        super().__init__(f"interrupted: {what}")
