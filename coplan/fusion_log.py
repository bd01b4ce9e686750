"""Inductor's reasons for not fusing two scheduler nodes, read from its own log.

Inductor's scheduler logs every refusal to fuse two nodes on its ``fusion`` artifact logger as a
``WhyNoFuse`` (torch/_inductor/scheduler.py): the two nodes' names and the reason. ``refusals()``
collects them, unprinted, while a compile runs; ``coplan run`` reads them to say why a planned
group was split, ``coplan inspect`` to say why two adjacent ops were not fused.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

#: the logger ``torch._logging.getArtifactLogger("torch._inductor.scheduler", "fusion")`` names
LOGGER = "torch._inductor.scheduler.__fusion"

#: (one node's name, the other's, the reason): a fused node's name joins its members' with ``_``
Refusal = tuple[str, str, str]


def read(record: logging.LogRecord) -> Refusal | None:
    """The refusal a log record carries, or None for any other record."""
    why = record.msg
    a, b = getattr(why, "name1", None), getattr(why, "name2", None)
    if a is None or b is None:
        return None
    try:
        reason = str(why).split(": ", 1)[1]
    except Exception:  # a reason whose %-arguments do not format: keep its template
        reason = str(getattr(why, "reason", ""))
    return str(a), str(b), reason


class _Collect(logging.Handler):
    def __init__(self, into: list[Refusal]) -> None:
        super().__init__(logging.DEBUG)
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        try:
            got = read(record)
        except Exception:  # a record of a shape this reading does not know: skip it, never raise
            return  # into the compile that logged it
        if got is not None:
            self.into.append(got)


@contextlib.contextmanager
def refusals() -> Iterator[list[Refusal]]:
    """The refusals logged while the block runs, in order, in the list it yields."""
    log = logging.getLogger(LOGGER)
    found: list[Refusal] = []
    handler = _Collect(found)
    saved = (log.level, log.propagate)
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    log.propagate = False  # collected, not printed
    try:
        yield found
    finally:
        log.removeHandler(handler)
        log.setLevel(saved[0])
        log.propagate = saved[1]
