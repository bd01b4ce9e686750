"""The history database (``coplan.inspect.history``) and what changed between records
(``coplan.inspect.diff``), on fabricated records that follow the inspect record's schema.

The kill test starts a writer process that stores large records in a loop, kills it with SIGKILL
while it writes, and checks that the database opens, passes SQLite's integrity check, and holds
every record the writer reported stored, each parsing as JSON.
"""

from __future__ import annotations

import copy
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from coplan.inspect import history as H
from coplan.inspect.diff import check, diff, kernel_key

ROOT = Path(__file__).resolve().parents[2]


def _fp(seed: str) -> str:
    """A 16-hex fingerprint made from ``seed``."""
    return f"{abs(hash(seed)) & (2**64 - 1):016x}"


def inspect_record(**over: Any) -> dict[str, Any]:
    """An inspect record of a small two-graph step (schema 1), with ``over`` replacing keys."""
    passes = []
    for graph, ops in (("forward", 41), ("backward", 77)):
        for name, stage, before, after in (
            ("dynamo", "capture", 0, ops),
            ("remove_noop_ops", "post_grad", ops, ops - 2),
            ("reorder_for_locality", "post_grad", ops - 2, ops - 2),
            ("remove_noop_ops", "post_grad", ops - 2, ops - 3),
            ("lowering", "lowering", ops - 3, ops - 3),
        ):
            passes.append(
                {
                    "name": name,
                    "graph": graph,
                    "stage": stage,
                    "fingerprint": _fp(f"{graph}{name}{before}"),
                    "ops_before": before,
                    "ops_after": after,
                }
            )
    kernels = [
        {
            "name": "cpp_fused_gelu_native_layer_norm_0",
            "graph": "forward",
            "kind": "generated",
            "ops": ["var_mean", "mul_3"],
            "aten": ["aten.native_layer_norm", "aten.gelu"],
            "bytes": 123456,
            "flops": 0,
            "predicted_s": 1.2e-5,
        },
        {
            "name": "extern_kernels.mm",
            "graph": "forward",
            "kind": "extern",
            "ops": ["mm"],
            "aten": ["aten.mm"],
            "bytes": 4096,
            "flops": 8192,
            "predicted_s": 3e-6,
        },
        {
            "name": "cpp_fused_add_1",
            "graph": "backward",
            "kind": "generated",
            "ops": ["add_1"],
            "aten": ["aten.add"],
            "bytes": 2048,
            "flops": 0,
            "predicted_s": 1e-6,
        },
    ]
    record: dict[str, Any] = {
        "schema": 1,
        "kind": "inspect",
        "model": "gpt-tiny",
        "batch": 2,
        "seq": 32,
        "device": "cpu",
        "hardware": "cpu",
        "torch": "2.13.0+cpu",
        "build": "cpu",
        "fingerprint": _fp("step"),
        "passes": passes,
        "graphs": [
            {"name": "forward", "fingerprint": _fp("fw"), "ops": 38, "kernels": 2},
            {"name": "backward", "fingerprint": _fp("bw"), "ops": 74, "kernels": 1},
        ],
        "kernels": 3,
        "kernel_table": kernels,
        "fallbacks": [],
        "unfused": [
            {
                "ops": ["aten.add", "aten.mul"],
                "graph": "backward",
                "count": 1,
                "nodes": [["add_1", "mul_4"]],
                "via": [],
                "reason": "a reduction between them",
                "predicted_saving_s": 1e-6,
            }
        ],
        "lineage": {"op_to_kernels": {}, "kernel_to_ops": {}},
        "graph_breaks": [],
        "bytes_moved": 129600,
        "predicted_step_s": 0.0123,
        "measured": {"step_s": 0.0150, "samples": [0.0151, 0.0149, 0.0150, 0.0152, 0.0148]},
        "compile_s": 4.2,
        "git_commit": "abcdef0123456789abcdef0123456789abcdef01",
        "created": "2026-11-27T11:30:00Z",
        "record_id": None,
    }
    record.update(over)
    return record


def with_fallback(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` after a custom op started falling back to eager in the forward graph: the forward
    graph diverges at ``remove_noop_ops``, one more kernel, and the layer norm no longer fuses with
    the GELU (the fallback kernel stands between them)."""
    r = copy.deepcopy(record)
    op = "coplan_test.identity.default"
    for p in r["passes"]:
        if p["graph"] == "forward" and p["stage"] != "capture":
            p["fingerprint"] = _fp(p["fingerprint"] + "changed")
    r["graphs"][0] = {**r["graphs"][0], "fingerprint": _fp("fw2"), "kernels": 3}
    r["fingerprint"] = _fp("step2")
    r["kernels"] = 4
    r["kernel_table"].append(
        {
            "name": "fallback_kernel_2",
            "graph": "forward",
            "kind": "fallback",
            "ops": ["identity"],
            "aten": [op],
            "bytes": 0,
            "flops": 0,
            "predicted_s": 2e-6,
        }
    )
    r["fallbacks"] = [
        {
            "op": op,
            "graph": "forward",
            "kernel": "fallback_kernel_2",
            "reason": "no Inductor lowering",
            "count": 1,
        }
    ]
    r["unfused"].append(
        {
            "ops": ["aten.native_layer_norm", "aten.gelu"],
            "graph": "forward",
            "count": 2,
            "nodes": [["var_mean", "gelu"], ["var_mean_1", "gelu_1"]],
            "via": [op],
            "reason": f"separated by fallback kernel {op}",
            "predicted_saving_s": 3.1e-6,
        }
    )
    return r


# --- the database ----------------------------------------------------------------------------------


def test_default_db_path_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("COPLAN_DB", str(tmp_path / "x.sqlite"))
    assert H.default_db_path() == tmp_path / "x.sqlite"
    monkeypatch.delenv("COPLAN_DB")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    assert H.default_db_path() == tmp_path / "data" / "coplan" / "history.sqlite"
    monkeypatch.delenv("XDG_DATA_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert H.default_db_path() == tmp_path / "home" / ".local" / "share" / "coplan" / "history.sqlite"


def test_add_get_rows_and_refs(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "h.sqlite"  # folders are made
    with H.History(path) as h:
        a = h.add(inspect_record(created="2020-01-01T10:00:00Z"))
        b = h.add(inspect_record(created="2020-01-01T11:00:00Z", git_commit="1234567fedcba" + "0" * 27))
        c = h.add(
            inspect_record(created="2020-01-01T12:00:00Z", model="other", fingerprint="ffff0000ffff0000")
        )
        e = h.add({"kind": "estimate", "model": "gpt-tiny", "predicted_step_s": 0.5, "measured": None})
        assert (a, b, c, e) == (1, 2, 3, 4)
        assert len(h) == 4
        got = h.get(a)
        assert got["record_id"] == a and got["passes"] == inspect_record()["passes"]
        assert h.get("#2")["record_id"] == b and h.get("2")["record_id"] == b
        # newest: the latest creation time (the estimate was made now, after the fabricated times)
        assert h.get("latest")["record_id"] == e
        assert h.get("latest~1")["record_id"] == c
        assert h.get("latest~3")["record_id"] == a
        assert h.get("1234567")["record_id"] == b  # a git commit prefix
        assert h.get("abcdef0")["record_id"] == c  # the newest of those made at that commit
        assert h.get("ffff00")["record_id"] == c  # a fingerprint prefix
        for bad in ("latest~9", "99", "#99", "zzzz", "", "abc"):
            with pytest.raises(H.HistoryError, match="no record"):
                h.get(bad)
        rows = h.rows()
        assert [r["id"] for r in rows] == [e, c, b, a]
        assert set(rows[0]) == set(H.SUMMARY_COLUMNS)
        assert rows[-1]["kernels"] == 3 and rows[-1]["unfused"] == 1 and rows[-1]["fallbacks"] == 0
        assert rows[-1]["measured_step_s"] == pytest.approx(0.015)
        assert [r["id"] for r in h.rows(model="gpt-tiny", kind="inspect")] == [b, a]
        assert [r["id"] for r in h.rows(limit=2)] == [e, c]
        assert h.models() == ["gpt-tiny", "other"]
        assert h.previous(b)["record_id"] == a  # type: ignore[index]
        assert h.previous(a) is None
        assert h.previous(e) is None  # no earlier estimate
        assert h.newer(a)["record_id"] == b  # type: ignore[index]
        assert h.newer(b) is None


def test_records_keep_their_values_and_nan_becomes_null(tmp_path: Path) -> None:
    with H.History(tmp_path / "h.sqlite") as h:
        rid = h.add(inspect_record(predicted_step_s=float("nan"), created=None))
        got = h.get(rid)
    assert got["predicted_step_s"] is None
    assert got["created"].endswith("Z")  # a missing time is now
    with H.History(tmp_path / "h.sqlite", create=False) as h, pytest.raises(H.HistoryError, match="kind"):
        h.add({"model": "x"})


def test_unusable_databases_are_one_line_errors(tmp_path: Path) -> None:
    missing = tmp_path / "none.sqlite"
    with pytest.raises(H.HistoryError, match=f"no history at {missing}"):
        H.History(missing, create=False)
    assert not missing.exists()
    text = tmp_path / "notes.sqlite"
    text.write_text("not a database, just text\n" * 100)
    with pytest.raises(H.HistoryError, match="is not a coplan history database"):
        H.History(text)
    other = tmp_path / "other.sqlite"
    with sqlite3.connect(other) as conn:
        conn.execute("CREATE TABLE records (x)")
    with pytest.raises(H.HistoryError, match="not a coplan history"):
        H.History(other)
    with pytest.raises(H.HistoryError, match="is a directory"):
        H.History(tmp_path)
    newer = tmp_path / "newer.sqlite"
    H.History(newer).close()
    with sqlite3.connect(newer) as conn:
        conn.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    with pytest.raises(H.HistoryError, match="schema 99"):
        H.History(newer)
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(H.HistoryError, match="cannot create history"):
        H.History(blocker / "h.sqlite")
    with pytest.raises(H.HistoryError, match="not a folder"):
        H.check_writable(blocker / "h.sqlite")
    H.check_writable(tmp_path / "new" / "deeper" / "h.sqlite")
    assert not (tmp_path / "new").exists()  # checking creates nothing


def test_the_file_is_wal_and_every_message_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "h.sqlite"
    H.History(path).close()
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    for make in (lambda: H.History(tmp_path / "no.sqlite", create=False), lambda: H.History(path).get("7")):
        with pytest.raises(H.HistoryError) as err:
            make()
        assert "\n" not in str(err.value) and err.value.exit_code == 2


def test_record_context(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # not a repository
    ctx = H.record_context()
    assert ctx["git_commit"] is None
    assert ctx["torch"] and (ctx["build"] == "cpu" or ctx["build"].startswith(("cuda ", "rocm ")))
    assert ctx["created"].endswith("Z") and "T" in ctx["created"]
    head = H.git_commit(ROOT)  # None where git is missing or the checkout is not a repository
    assert head is None or len(head) == 40


# --- diff and check --------------------------------------------------------------------------------


def test_identical_records_do_not_regress() -> None:
    a = inspect_record(record_id=1)
    b = inspect_record(
        record_id=2,
        created="2026-11-28T00:00:00Z",
        measured={"step_s": 0.0151, "samples": [0.0153, 0.0147, 0.0151]},
    )
    d = diff(a, b)
    assert d["identical"] and d["fingerprint"]["same"]
    assert d["first_divergence"] is None
    assert not any(p["changed"] for p in d["passes"])
    assert check(a, b) == [] and check(a, b, threshold=0.0) == []
    assert check(b, a) == []


def test_a_new_fallback_is_named_with_its_consequences() -> None:
    a = inspect_record(record_id=1)
    b = with_fallback(inspect_record(record_id=2))
    d = diff(a, b)
    assert not d["identical"]
    assert d["first_divergence"] == {"graph": "forward", "name": "remove_noop_ops", "stage": "post_grad"}
    # passes align by (graph, name, occurrence): remove_noop_ops runs twice on each graph
    noop = [p for p in d["passes"] if p["graph"] == "forward" and p["name"] == "remove_noop_ops"]
    assert [p["occurrence"] for p in noop] == [0, 1] and all(p["changed"] for p in noop)
    assert not any(p["changed"] for p in d["passes"] if p["graph"] == "backward")
    assert d["kernels"]["delta"] == 1
    assert [k["kind"] for k in d["kernels"]["added"]] == ["fallback"]
    assert [f["op"] for f in d["fallbacks"]["added"]] == ["coplan_test.identity.default"]
    assert [u["ops"] for u in d["unfused"]["added"]] == [["aten.native_layer_norm", "aten.gelu"]]
    assert [g["kernels_delta"] for g in d["graphs"]] == [1, 0]
    found = {r["kind"]: r for r in check(a, b)}
    assert set(found) == {"fallback", "unfused", "kernels"}
    assert "coplan_test.identity.default" in found["fallback"]["message"]
    assert "aten.native_layer_norm + aten.gelu" in found["unfused"]["message"]
    assert found["unfused"]["predicted_saving_s"] == pytest.approx(3.1e-6)
    assert "3.1 us" in found["unfused"]["message"]
    assert "3 -> 4" in found["kernels"]["message"]
    for r in found.values():
        assert r["first_divergence"] == {"graph": "forward", "name": "remove_noop_ops", "stage": "post_grad"}
        assert "forward/remove_noop_ops" in r["message"]
        assert "\n" not in r["message"]
    # the fix is no regression
    assert check(b, a) == []


def test_more_instances_of_an_unfused_pattern_and_a_new_graph_break() -> None:
    a = inspect_record()
    b = copy.deepcopy(a)
    b["unfused"][0]["count"] = 3
    b["graph_breaks"] = [
        {"frame": "1/0", "location": "torch/optim/optimizer.py:79", "reason": "[a] data-dependent"}
    ]
    kinds = [(r["kind"], r["message"]) for r in check(a, b)]
    assert [k for k, _ in kinds] == ["unfused", "graph_break"]
    assert "1 ->" in kinds[0][1] and "x3" in kinds[0][1]
    assert "torch/optim/optimizer.py:79" in kinds[1][1]


def test_kernels_are_matched_by_what_they_run_not_their_number() -> None:
    a = inspect_record()
    b = copy.deepcopy(a)
    for k in b["kernel_table"]:
        k["name"] = k["name"].replace("_0", "_7")
    assert diff(a, b)["kernels"]["added"] == [] and check(a, b) == []
    assert kernel_key({"graph": "g", "kind": "generated", "name": "cpp_fused_add_12"}) == (
        "g",
        "generated",
        ("cpp_fused_add",),
    )


def test_predicted_step_time_regresses_past_the_threshold() -> None:
    a = inspect_record()
    slower = inspect_record(predicted_step_s=0.0123 * 1.05)
    found = check(a, slower)
    assert [r["kind"] for r in found] == ["predicted_step"]
    assert "+5.0%" in found[0]["message"]
    assert check(a, inspect_record(predicted_step_s=0.0123 * 1.01)) == []  # inside the 2% threshold
    assert check(a, slower, threshold=0.1) == []
    with pytest.raises(ValueError):
        check(a, slower, threshold=-1)


def test_measured_time_regresses_only_beyond_the_sample_spread() -> None:
    a = inspect_record(measured={"step_s": 0.0150, "samples": [0.0140, 0.0150, 0.0160]})
    # a candidate built by another torch: its measured time can be the compiler's doing
    other = {"torch": "2.99.0"}
    # median 10% slower, but the samples overlap: noise, not a regression
    noisy = inspect_record(measured={"step_s": 0.0165, "samples": [0.0155, 0.0165, 0.0175]}, **other)
    assert check(a, noisy) == []
    slower = inspect_record(measured={"step_s": 0.0180, "samples": [0.0170, 0.0180, 0.0190]}, **other)
    found = check(a, slower)
    assert [r["kind"] for r in found] == ["measured_step"]
    assert found[0]["candidate_fastest"] == 0.0170 and found[0]["baseline_slowest"] == 0.0160
    # the same compiled program on the same torch, device and sizes: a slower measurement is the
    # machine's, never a regression
    same = inspect_record(measured={"step_s": 0.0180, "samples": [0.0170, 0.0180, 0.0190]})
    assert check(a, same) == []
    # without samples, the medians
    no_samples = inspect_record(measured={"step_s": 0.0150, "samples": []})
    assert check(no_samples, inspect_record(measured={"step_s": 0.0152}, **other)) == []
    assert [r["kind"] for r in check(no_samples, inspect_record(measured={"step_s": 0.016}, **other))] == [
        "measured_step"
    ]
    assert check(no_samples, inspect_record(measured=None, **other)) == []


def test_run_and_estimate_records_compare_times_and_fingerprint() -> None:
    base = {
        "kind": "run",
        "model": "m",
        "fingerprint": "aa",
        "predicted_step_s": 1.0,
        "measured": {"step_s": 2.0, "samples": [2.0, 2.01]},
    }
    same = {**base, "payload": {"anything": 1}}
    d = diff(base, same)
    assert d["identical"] and d["kernels"] is None and d["passes"] == []
    assert check(base, same) == []
    other = {
        **base,
        "fingerprint": "bb",
        "predicted_step_s": 1.5,
        "measured": {"step_s": 3.0, "samples": [2.9, 3.1]},
    }
    d = diff(base, other)
    assert not d["fingerprint"]["same"] and d["predicted_step"]["change"] == pytest.approx(0.5)
    assert [r["kind"] for r in check(base, other)] == ["predicted_step", "measured_step"]


# --- a writer killed while it writes ----------------------------------------------------------------

#: Stores large records in a loop, printing each id once stored. With ``hold``, the fourth insert
#: stops inside its transaction (after BEGIN IMMEDIATE, in the INSERT) and says so, so the kill lands
#: there for certain; without, the parent kills at a time when a write is most likely under way.
WRITER = textwrap.dedent(
    """
    import sys, time
    from coplan.inspect.history import History

    path, hold = sys.argv[1], sys.argv[2] == "hold"
    body = "x" * 2_000_000  # large, so that most of the time is spent inside a write

    state = {"insert": False}

    def saw(sql):
        state["insert"] = sql.lstrip().upper().startswith("INSERT")

    def stop_here():
        if state["insert"] and h._conn.in_transaction:
            print("inside", flush=True)
            time.sleep(60)
        return 0

    with History(path) as h:
        for i in range(100000):
            if hold and i == 3:
                h._conn.set_trace_callback(saw)
                h._conn.set_progress_handler(stop_here, 10)
            rid = h.add({"kind": "inspect", "model": "m", "i": i, "body": body})
            print(rid, flush=True)
    """
)


def _kill_writer(path: Path, hold: bool) -> list[int]:
    """Start the writer, kill it with SIGKILL mid-write; the ids it reported stored."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(path), "hold" if hold else "loop"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    stored: list[int] = []
    try:
        assert p.stdout is not None and p.stderr is not None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = p.stdout.readline().strip()
            if not line:
                pytest.fail(f"the writer ended early: {p.stderr.read().decode()}")
            if line == b"inside":
                break
            stored.append(int(line))
            if not hold and len(stored) == 4:
                time.sleep(0.013)  # a write takes about 20 ms: most of it is the commit's I/O
                break
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=10)
        assert p.returncode == -signal.SIGKILL
        stored += [int(x) for x in p.stdout.read().split() if x.isdigit()]
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    return stored


@pytest.mark.procs
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SIGKILL of a child process: Linux only")
@pytest.mark.parametrize("hold", [True, False], ids=["inside-transaction", "timed"])
def test_a_writer_killed_mid_write_leaves_a_consistent_history(tmp_path: Path, hold: bool) -> None:
    path = tmp_path / "h.sqlite"
    stored = _kill_writer(path, hold)
    assert len(stored) >= (3 if hold else 4)
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    with H.History(path, create=False) as h:
        ids = [r["id"] for r in h.rows()]
        # every record the writer was told is stored is there; at most the one being written is lost
        assert set(stored) <= set(ids)
        assert len(ids) <= len(stored) + 1
        if hold:
            assert ids == sorted(stored, reverse=True)  # the interrupted insert left nothing
        for rid in ids:
            body = h.get(rid)
            assert body["record_id"] == rid and body["i"] == rid - 1 and len(body["body"]) == 2_000_000
        assert h.add({"kind": "inspect", "model": "m"}) == max(ids) + 1  # and it takes new records
