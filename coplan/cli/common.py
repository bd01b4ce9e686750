"""Shared CLI helpers: option checks, number formatting, consoles and JSON output."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape

from coplan.errors import Interrupted, SpecError

if TYPE_CHECKING:
    from coplan.cost.envelope import Validated


def stdout() -> Console:
    """A Rich console on the current ``sys.stdout`` (made per call so captured streams work)."""
    return Console(file=sys.stdout, highlight=False)


def print_json(data: Any) -> None:
    """Exactly one JSON document on stdout, nothing else (no colour, no wrapping)."""
    sys.stdout.write(json.dumps(data, indent=2) + "\n")
    sys.stdout.flush()


def positive(option: str, value: int | None, *, optional: bool = False) -> int | None:
    """``value`` if it is a positive integer (or ``None`` when ``optional``), else a one-line error."""
    if value is None and optional:
        return None
    if value is None or isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SpecError(option, None, f"must be a positive integer, got {value!r}")
    return value


@contextmanager
def interruptible(what: str) -> Iterator[None]:
    """Ctrl-C inside becomes one line, ``error: interrupted: <what>``, and exit code 130
    (``Interrupted``); the processes started inside end with it (``coplan.procs``)."""
    try:
        yield
    except KeyboardInterrupt:
        raise Interrupted(what) from None


def one_line(text: str) -> str:
    """Collapse a message to one line (error messages are printed as exactly one line)."""
    return " ".join(part.strip() for part in str(text).splitlines() if part.strip())


# --- number formatting (decimal SI prefixes) ---------------------------------------------------

_PREFIXES = ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K"))


def _scaled(value: float, prefixes: tuple[tuple[float, str], ...] = _PREFIXES) -> tuple[float, str]:
    for scale, prefix in prefixes:
        if abs(value) >= scale:
            return value / scale, prefix
    return float(value), ""


def human_count(n: float) -> str:
    """``124439808`` -> ``"124.4M"``; ``950`` -> ``"950"``. B for billions, as model sizes are named."""
    value, prefix = _scaled(n, ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")))
    return f"{value:.1f}{prefix}" if prefix else f"{int(n)}"


def human_flops(n: float) -> str:
    """``2.3e12`` -> ``"2.3 TFLOP"``."""
    value, prefix = _scaled(n)
    return f"{value:.1f} {prefix}FLOP" if prefix else f"{int(n)} FLOP"


_BINARY = ((2.0**40, "Ti"), (2.0**30, "Gi"), (2.0**20, "Mi"), (2.0**10, "Ki"))


def human_bytes(n: float) -> str:
    """``816926728`` -> ``"779.1 MiB"``: binary units, as ``--memory-budget-gb`` reads GiB."""
    value, prefix = _scaled(n, _BINARY)
    return f"{value:.1f} {prefix}B" if prefix else f"{int(n)} B"


def human_rate(n: float) -> str:
    """``2488123.4`` -> ``"2.49M"``: a rate in a narrow column (tokens/s)."""
    value, prefix = _scaled(n, ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")))
    return f"{value:.3g}{prefix}" if prefix else f"{n:.3g}"


def exact(n: int) -> str:
    """``124439808`` -> ``"124,439,808"``."""
    return f"{n:,}"


def mfu_words(e: Any) -> str:
    """MFU against the 16-bit dense peak, labelled, with the dtype's own peak beside it where that
    differs (fp8 on Hopper)."""
    text = f"{e.mfu:.1%} of the {e.peak_dtype_16bit} dense peak"
    if e.peak_dtype != e.peak_dtype_16bit:
        text += f" ({e.mfu_dtype_peak:.1%} of the {e.peak_dtype} peak)"
    return text


def show_trust(console: Console, trust: Validated) -> None:
    """Whether the configuration lies inside what the cost model was validated on, and if not, what
    is extrapolated (one line each); then what qualifies its price either way (``cautions``)."""
    if trust.inside:
        near = ", ".join(trust.nearest)
        console.print(f"[green]inside the validated envelope[/green] (nearest published runs: {near})")
    else:
        console.print(
            "[yellow]extrapolated[/yellow] beyond the published runs the cost model was checked on:"
        )
        for what in trust.extrapolated:
            console.print(f"  - {what}")
    for what in trust.cautions:
        console.print(f"[yellow]caution[/yellow]: {escape(what)}")
