"""``coplan history list|show|diff|check`` and recording from ``coplan estimate`` and ``run``.

``check`` is made for CI: exit 0 when nothing regressed, 1 when something did (one line per
regression), 2 on bad input (one ``error:`` line). Records are fabricated (``test_history``) and
stored in a database under ``tmp_path``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_cli import Cli, assert_one_line_error
from test_history import inspect_record, with_fallback

from coplan.inspect.history import SUMMARY_COLUMNS, History


@pytest.fixture
def db(tmp_path: Path) -> Path:
    """A history of gpt-tiny: #1 the baseline, #2 the same compilation, #3 a new fallback, and #4 an
    estimate."""
    path = tmp_path / "h.sqlite"
    base = inspect_record(created="2020-01-01T10:00:00Z")
    with History(path) as h:
        h.add(base)
        h.add({**base, "created": "2020-01-01T11:00:00Z"})
        h.add({**with_fallback(base), "created": "2020-01-01T12:00:00Z", "git_commit": "1234567" + "0" * 33})
        h.add(
            {
                "kind": "estimate",
                "model": "gpt-tiny",
                "predicted_step_s": 0.2,
                "created": "2020-01-01T13:00:00Z",
            }
        )
    return path


def test_list(cli: Cli, db: Path) -> None:
    code, out, _ = cli("history", "list", "--db", str(db), "--json")
    assert code == 0
    rows = json.loads(out)["records"]
    assert [r["id"] for r in rows] == [4, 3, 2, 1]
    assert all(set(r) == set(SUMMARY_COLUMNS) for r in rows)
    code, out, _ = cli("history", "list", "--db", str(db), "--json", "--kind", "inspect", "--limit", "2")
    assert [r["id"] for r in json.loads(out)["records"]] == [3, 2]
    code, out, _ = cli("history", "list", "--db", str(db), "--model", "nope", "--json")
    assert json.loads(out) == {"records": []}
    code, out, _ = cli("history", "list", "--db", str(db))
    assert code == 0 and "gpt-tiny" in out and "estimate" in out and "1234567" in out


def test_show(cli: Cli, db: Path) -> None:
    code, out, _ = cli("history", "show", "3", "--db", str(db), "--json")
    assert code == 0
    record = json.loads(out)
    assert record["record_id"] == 3 and record["fallbacks"][0]["op"] == "coplan_test.identity.default"
    code, out, _ = cli("history", "show", "1234567", "--db", str(db))
    assert code == 0
    for needle in (
        "#3 inspect gpt-tiny",
        "remove_noop_ops",
        "coplan_test.identity.default",
        "3.1 us",
        "12.3 ms",
    ):
        assert needle in out, needle


def test_diff(cli: Cli, db: Path) -> None:
    code, out, _ = cli("history", "diff", "1", "3", "--db", str(db), "--json")
    assert code == 0
    d = json.loads(out)
    assert d.keys() >= {
        "a",
        "b",
        "passes",
        "first_divergence",
        "kernels",
        "fallbacks",
        "unfused",
        "identical",
    }
    assert (d["a"], d["b"]) == (1, 3)
    assert d["first_divergence"] == {"graph": "forward", "name": "remove_noop_ops", "stage": "post_grad"}
    code, out, _ = cli("history", "diff", "1", "3", "--db", str(db))
    assert code == 0
    assert "first divergence: pass remove_noop_ops on forward" in out
    assert "fallback + forward: coplan_test.identity.default" in out
    code, out, _ = cli("history", "diff", "1", "2", "--db", str(db))
    assert code == 0 and "the same compilation" in out


def test_check_exit_codes(cli: Cli, db: Path) -> None:
    code, out, _ = cli("history", "check", "--baseline", "1", "--candidate", "2", "--db", str(db))
    assert code == 0 and "no regressions" in out
    code, out, err = cli("history", "check", "--baseline", "1", "--candidate", "3", "--db", str(db))
    assert code == 1
    assert err == "error: #3 (gpt-tiny, inspect) against baseline #1: 3 regressions (threshold 2.0%)\n"
    lines = [line for line in out.splitlines() if line.startswith("regression: ")]
    assert len(lines) == 3
    assert any("new fallback coplan_test.identity.default" in line for line in lines)
    assert any("new unfused pattern aten.native_layer_norm + aten.gelu" in line for line in lines)
    assert any("more kernels: 3 -> 4" in line for line in lines)
    code, out, _ = cli(
        "history", "check", "--baseline", "1", "--candidate", "latest~1", "--db", str(db), "--json"
    )
    assert code == 1
    data = json.loads(out)
    assert data.keys() == {"baseline", "candidate", "regressions", "regressed"}
    assert (data["baseline"], data["candidate"], data["regressed"]) == (1, 3, True)
    assert {r["kind"] for r in data["regressions"]} == {"fallback", "unfused", "kernels"}
    # the default candidate: the newest inspect record of gpt-tiny after the baseline (#3, not the estimate)
    code, out, _ = cli("history", "check", "--baseline", "2", "--db", str(db), "--json")
    assert code == 1 and json.loads(out)["candidate"] == 3
    code, out, _ = cli(
        "history", "check", "--baseline", "1", "--candidate", "3", "--threshold", "0.5", "--db", str(db)
    )
    assert code == 1  # structural regressions take no threshold


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("--baseline", "99"), "no record '99'"),
        (("--baseline", "1", "--candidate", "deadbeef0"), "no record 'deadbeef0'"),
        (("--baseline", "3"), "newer than #3"),
        (("--baseline", "1", "--threshold", "-0.1"), "--threshold"),
        (("--baseline", "1", "--threshold", "inf"), "--threshold"),
        (("--baseline", "1", "--threshold", "nan"), "--threshold"),
    ],
)
def test_check_bad_input_exits_2(cli: Cli, db: Path, args: tuple[str, ...], needle: str) -> None:
    code, out, err = cli("history", "check", *args, "--db", str(db))
    assert out == ""
    assert_one_line_error(code, err, needle)


def test_unreadable_databases_exit_2(cli: Cli, tmp_path: Path) -> None:
    missing = tmp_path / "none.sqlite"
    for command in (("list",), ("show", "1"), ("diff", "1", "2"), ("check", "--baseline", "1")):
        code, _, err = cli("history", *command, "--db", str(missing))
        assert_one_line_error(code, err, f"no history at {missing}")
    assert not missing.exists()  # reading never creates
    junk = tmp_path / "junk.sqlite"
    junk.write_bytes(b"\x00\x01 not sqlite " * 200)
    code, _, err = cli("history", "check", "--baseline", "1", "--db", str(junk))
    assert_one_line_error(code, err, "not a coplan history database", str(junk))


def test_the_db_defaults_to_coplan_db(cli: Cli, db: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COPLAN_DB", str(db))
    code, out, _ = cli("history", "show", "latest", "--json")
    assert code == 0 and json.loads(out)["kind"] == "estimate"


def test_check_in_ci_through_the_entry_point(db: Path) -> None:
    """What a CI step runs: ``python -m coplan.cli history check``, judged by its exit code."""
    proc = subprocess.run(
        [sys.executable, "-m", "coplan.cli", "history", "check", "--baseline", "2", "--db", str(db)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout.count("regression: ") == 3 and "Traceback" not in proc.stderr


# --- recording from estimate and run ---------------------------------------------------------------

ESTIMATE = ("estimate", "--model", "gpt2-124m", "--gpus", "8", "--tp", "2")


def test_estimate_records_when_asked(cli: Cli, tmp_path: Path) -> None:
    path = tmp_path / "new" / "h.sqlite"
    code, out, _ = cli(*ESTIMATE, "--json")
    assert code == 0 and "record_id" not in json.loads(out) and not path.exists()  # off by default
    code, out, err = cli(*ESTIMATE, "--db", str(path), "--json")
    assert code == 0
    first = json.loads(out)
    assert first["record_id"] == 1 and "recorded" not in err
    code, out, err = cli(*ESTIMATE, "--history", "--db", str(path))
    assert code == 0 and f"recorded as #2 in {path}" in err
    with History(path, create=False) as h:
        (row,) = h.rows(limit=1)
        record = h.get(1)
    assert row["kind"] == "estimate" and row["model"] == "gpt2-124m" and row["id"] == 2
    assert row["hardware"] and row["torch"] and row["created"]
    assert record["predicted_step_s"] == pytest.approx(first["step_time_s"])
    assert record["payload"]["step_time_s"] == first["step_time_s"] and "record_id" not in record["payload"]
    assert record["measured"] is None and record["batch"] == first["config"]["global_batch"]
    code, out, _ = cli("history", "check", "--baseline", "1", "--db", str(path), "--json")
    assert code == 0 and json.loads(out)["regressed"] is False  # two identical estimates


def test_recording_is_checked_before_any_work(cli: Cli, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    code, out, err = cli(*ESTIMATE, "--db", str(blocker / "h.sqlite"), "--json")
    assert out == ""
    assert_one_line_error(code, err, "--db", "not a folder")
    junk = tmp_path / "junk.sqlite"
    junk.write_text("text\n")
    code, out, err = cli(*ESTIMATE, "--db", str(junk))
    assert_one_line_error(code, err, "not a coplan history database")
    # run refuses the --db before it reads the plan
    code, _, err = cli(
        "run", "--model", "gpt-tiny", "--plan", str(tmp_path / "none.json"), "--db", str(blocker / "h")
    )
    assert_one_line_error(code, err, "--db")
