"""``coplan.fusion_log``: Inductor's refusals to fuse, collected from its scheduler's log."""

from __future__ import annotations

import logging

from coplan.fusion_log import LOGGER, read, refusals


class _WhyNoFuse:
    """The shape of Inductor's ``WhyNoFuse`` record (torch/_inductor/scheduler.py)."""

    def __init__(self, a: str, b: str, reason: str, *args: object) -> None:
        self.name1, self.name2, self.reason, self.args = a, b, reason, args

    def __str__(self) -> str:
        return f"cannot fuse {self.name1} with {self.name2}: " + (self.reason % self.args)


def test_refusals_are_collected_unprinted_and_the_logger_restored(capsys):
    log = logging.getLogger(LOGGER)
    level, propagate = log.level, log.propagate
    with refusals() as got:
        log.debug(_WhyNoFuse("op1", "op2_op3", "numel mismatch %d vs %d", 4, 8))
        log.debug("an unrelated message")
    assert got == [("op1", "op2_op3", "numel mismatch 4 vs 8")]
    assert (log.level, log.propagate) == (level, propagate)
    assert capsys.readouterr().err == ""


def _record(msg: object) -> logging.LogRecord:
    return logging.LogRecord(LOGGER, logging.DEBUG, __file__, 1, msg, None, None)


def test_read_ignores_other_records():
    assert read(_record("plain text")) is None


def test_a_reason_whose_arguments_do_not_format_keeps_its_template():
    # read directly: handing such a record to logging would make every other handler fail on it
    assert read(_record(_WhyNoFuse("op4", "op5", "bad %d", "x"))) == ("op4", "op5", "bad %d")
