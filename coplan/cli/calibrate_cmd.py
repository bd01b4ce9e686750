"""``coplan calibrate``: measure this machine and write a device profile (placeholder)."""

from __future__ import annotations

from coplan.errors import CoplanError


def calibrate() -> None:
    """Measure matmul, elementwise, reduction and collective microbenchmarks into a profile."""
    raise CoplanError("calibrate is not implemented yet")
