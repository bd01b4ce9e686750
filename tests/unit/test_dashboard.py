"""``coplan dashboard``: the JSON API and the page, served from a history of fabricated records.

The records follow the inspect record schema: three inspect records of ``toy-mlp`` (the third a
regression: a new fallback, a new unfused pattern, two more kernels, slower step times, its passes
diverging from ``forward/remove_noop_ops`` on), one ``run`` record of it and one inspect record of
another model. ``tests/browser/test_dashboard_browser.py`` drives the page over the same history.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from coplan.inspect.dashboard import DashboardServer
from coplan.inspect.history import History

MODEL = "toy-mlp"
#: (graph, pass, stage) of every fabricated inspect record, in execution order
PASSES = [
    ("forward", "dynamo", "capture"),
    ("forward", "joint_graph_passes", "joint"),
    ("forward", "remove_noop_ops", "post_grad"),
    ("forward", "reinplace_inplaceable_ops", "post_grad"),
    ("backward", "remove_noop_ops", "post_grad"),
    ("backward", "reinplace_inplaceable_ops", "post_grad"),
]
#: where the regression's compilation starts to differ (index into PASSES)
DIVERGES_AT = 2
NEW_FALLBACK = "coplan_test.identity.default"
#: a fallback reason that would run script if the page ever parsed record text as HTML
XSS = '<img src=x onerror="window.__xss=1">'


def inspect_record(
    created: str,
    *,
    model: str = MODEL,
    kernels: int = 10,
    regressed: bool = False,
    step_s: float = 0.0120,
) -> dict[str, Any]:
    """An inspect record; ``regressed`` adds the fallback, the unfused pattern and changed passes."""
    passes = []
    for i, (graph, name, stage) in enumerate(PASSES):
        tail = "b" * 12 if regressed and i >= DIVERGES_AT else "a" * 12
        passes.append(
            {
                "name": name,
                "graph": graph,
                "stage": stage,
                "fingerprint": f"{i:04x}{tail}",
                "ops_before": 40 + i,
                "ops_after": 41 + i,
            }
        )
    fallbacks = []
    unfused = []
    if regressed:
        fallbacks.append(
            {
                "op": NEW_FALLBACK,
                "graph": "forward",
                "kernel": "extern_kernels.identity",
                "reason": f"no Inductor lowering (custom op) {XSS}",
                "count": 1,
            }
        )
        unfused.append(
            {
                "ops": ["aten.native_layer_norm", "aten.gelu"],
                "graph": "forward",
                "count": 2,
                "nodes": [["add_1", "mul_4"]],
                "via": [NEW_FALLBACK],
                "reason": f"separated by fallback kernel {NEW_FALLBACK}",
                "predicted_saving_s": 3.1e-6,
            }
        )
    kernel_table = [
        {
            "name": f"cpp_fused_op{i}_{i}",
            "graph": "forward" if i < kernels // 2 else "backward",
            "kind": "generated",
            "ops": [f"mul_{i}"],
            "aten": [f"aten.op{i}"],
            "bytes": 1024 * (i + 1),
            "flops": 0,
            "predicted_s": 1e-5,
        }
        for i in range(kernels)
    ]
    return {
        "schema": 1,
        "kind": "inspect",
        "model": model,
        "batch": 2,
        "seq": 128,
        "device": "cpu",
        "hardware": "cpu",
        "torch": "2.13.0+cpu",
        "build": "cpu",
        "fingerprint": ("b" if regressed else "a") * 16,
        "passes": passes,
        "graphs": [
            {"name": "forward", "fingerprint": passes[3]["fingerprint"], "ops": 44, "kernels": kernels // 2},
            {
                "name": "backward",
                "fingerprint": passes[5]["fingerprint"],
                "ops": 46,
                "kernels": kernels - kernels // 2,
            },
        ],
        "kernels": kernels,
        "kernel_table": kernel_table,
        "fallbacks": fallbacks,
        "unfused": unfused,
        "lineage": {"op_to_kernels": {}, "kernel_to_ops": {}},
        "graph_breaks": [],
        "bytes_moved": 123456789,
        "predicted_step_s": 0.0105 if regressed else 0.0100,
        "measured": {"step_s": step_s, "samples": [step_s - 1e-4, step_s, step_s + 1e-4]},
        "compile_s": 12.5,
        "git_commit": ("c0ffee" if regressed else "abcdef") + "0" * 34,
        "created": created,
        "record_id": None,
    }


def run_record(created: str) -> dict[str, Any]:
    return {
        "schema": 1,
        "kind": "run",
        "model": MODEL,
        "batch": 2,
        "seq": 128,
        "device": "cpu",
        "hardware": "cpu",
        "torch": "2.13.0+cpu",
        "build": "cpu",
        "fingerprint": None,
        "predicted_step_s": 0.01,
        "measured": {"step_s": 0.011, "samples": [0.011]},
        "git_commit": None,
        "created": created,
        "payload": {"loss": [2.0, 1.9]},
    }


def fill_history(path: Path) -> dict[str, int]:
    """Write the fabricated history at ``path``; the ids by role."""
    with History(path) as history:
        ids = {
            "base": history.add(inspect_record("2026-11-20T10:00:00Z")),
            "same": history.add(inspect_record("2026-11-21T10:00:00Z", step_s=0.01205)),
            "regressed": history.add(
                inspect_record("2026-11-22T10:00:00Z", kernels=12, regressed=True, step_s=0.0135)
            ),
            "run": history.add(run_record("2026-11-22T11:00:00Z")),
            "other": history.add(inspect_record("2026-11-22T12:00:00Z", model="other-model")),
        }
    return ids


@pytest.fixture
def history_db(tmp_path: Path) -> tuple[Path, dict[str, int]]:
    # the '<b>' in the name checks that the path shown on the page is escaped
    db = tmp_path / "hist<b>.sqlite"
    return db, fill_history(db)


@pytest.fixture
def server(history_db: tuple[Path, dict[str, int]]) -> Iterator[DashboardServer]:
    srv = DashboardServer(history_db[0], 0)
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()
        thread.join(5)


def get(srv: DashboardServer, path: str, headers: dict[str, str] | None = None) -> tuple[int, Any, Any]:
    """(status, body parsed as JSON where it is JSON, headers) of GET ``path``."""
    request = urllib.request.Request(srv.url.rstrip("/") + path, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            status, body, head = response.status, response.read(), response.headers
    except urllib.error.HTTPError as err:
        status, body, head = err.code, err.read(), err.headers
    if head.get("Content-Type", "").startswith("application/json"):
        return status, json.loads(body), head
    return status, body.decode(), head


def test_models(server: DashboardServer) -> None:
    status, data, _ = get(server, "/api/models")
    assert status == 200
    assert data["models"] == ["other-model", MODEL]


def test_records_oldest_first_with_regressions(
    server: DashboardServer, history_db: tuple[Path, dict[str, int]]
) -> None:
    ids = history_db[1]
    status, data, _ = get(server, f"/api/records?model={MODEL}")
    assert status == 200
    assert data["kinds"] == ["inspect", "run"]
    inspect = [r for r in data["records"] if r["kind"] == "inspect"]
    assert [r["id"] for r in inspect] == [ids["base"], ids["same"], ids["regressed"]]
    assert [r["kernels"] for r in inspect] == [10, 10, 12]
    assert [r["fallbacks"] for r in inspect] == [0, 0, 1]
    assert [r["unfused"] for r in inspect] == [0, 0, 1]
    assert [r["previous_id"] for r in inspect] == [None, ids["base"], ids["same"]]
    assert inspect[0]["regressions"] == [] and inspect[1]["regressions"] == []
    kinds = {g["kind"] for g in inspect[2]["regressions"]}
    assert {"fallback", "unfused", "kernels", "predicted_step", "measured_step"} <= kinds
    with History(history_db[0], create=False) as history:  # the baseline is the history's own
        for r in data["records"]:
            previous = history.previous(r["id"])
            assert r["previous_id"] == (None if previous is None else previous["record_id"])
    (run,) = [r for r in data["records"] if r["kind"] == "run"]
    assert run["previous_id"] is None and run["regressions"] == []

    status, only, _ = get(server, f"/api/records?model={MODEL}&kind=run")
    assert [r["id"] for r in only["records"]] == [ids["run"]]


def test_records_needs_a_known_model(server: DashboardServer) -> None:
    assert get(server, "/api/records")[0] == 400
    status, data, _ = get(server, "/api/records?model=nope")
    assert status == 404 and "nope" in data["error"]


def test_record_and_diff(server: DashboardServer, history_db: tuple[Path, dict[str, int]]) -> None:
    ids = history_db[1]
    status, record, _ = get(server, f"/api/record/{ids['regressed']}")
    assert status == 200
    assert record["record_id"] == ids["regressed"]
    assert record["fallbacks"][0]["op"] == NEW_FALLBACK

    status, data, _ = get(server, f"/api/diff/{ids['same']}/{ids['regressed']}")
    assert status == 200
    d = data["diff"]
    assert d["first_divergence"]["graph"] == "forward"
    assert d["first_divergence"]["name"] == "remove_noop_ops"
    assert [f["op"] for f in d["fallbacks"]["added"]] == [NEW_FALLBACK]
    assert d["kernels"]["delta"] == 2
    assert [p["changed"] for p in d["passes"]] == [i >= DIVERGES_AT for i in range(len(PASSES))]
    assert any(g["kind"] == "fallback" and g["op"] == NEW_FALLBACK for g in data["regressions"])

    status, same, _ = get(server, f"/api/diff/{ids['base']}/{ids['same']}")
    assert same["diff"]["first_divergence"] is None and same["regressions"] == []


def test_unknown_records_and_routes_are_404(server: DashboardServer) -> None:
    status, data, _ = get(server, "/api/record/999")
    assert status == 404 and "999" in data["error"]
    assert get(server, "/api/diff/1/999")[0] == 404
    assert get(server, "/api/record/abc")[0] == 404
    assert get(server, "/../etc/passwd")[0] == 404


def test_page_is_self_contained_and_escaped(server: DashboardServer) -> None:
    status, html, headers = get(server, "/")
    assert status == 200
    for element in (
        "model-select",
        "kind-select",
        "plot-kernels",
        "plot-fallbacks",
        "plot-unfused",
        "plot-step",
        "regressions",
        "diff-panel",
    ):
        assert f'id="{element}"' in html
    assert "hist&lt;b&gt;.sqlite" in html and "hist<b>" not in html
    # plotly is inline: no script is loaded from anywhere, and the policy forbids it
    assert "<script src" not in html and "Plotly" in html
    policy = headers["Content-Security-Policy"]
    assert "default-src 'none'" in policy and "connect-src 'self'" in policy
    assert headers["X-Content-Type-Options"] == "nosniff"


def test_foreign_host_is_refused(server: DashboardServer) -> None:
    # a page elsewhere that rebinds its own name to 127.0.0.1 sends its name as Host
    assert get(server, "/api/models", {"Host": "attacker.example:80"})[0] == 403
    assert get(server, "/api/models", {"Host": f"localhost:{server.server_address[1]}"})[0] == 200


def test_the_history_is_only_read(server: DashboardServer, history_db: tuple[Path, dict[str, int]]) -> None:
    db, ids = history_db
    before = hashlib.sha256(db.read_bytes()).hexdigest()
    diff = f"/api/diff/{ids['same']}/{ids['regressed']}"
    for path in ("/", "/api/models", f"/api/records?model={MODEL}", diff):
        assert get(server, path)[0] == 200
    assert hashlib.sha256(db.read_bytes()).hexdigest() == before
    with History(db, create=False) as history:
        assert len(history) == len(ids)


def test_empty_history(tmp_path: Path) -> None:
    db = tmp_path / "empty.sqlite"
    History(db).close()
    srv = DashboardServer(db, 0)
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        assert get(srv, "/api/models")[1]["models"] == []
    finally:
        srv.shutdown()
        srv.server_close()


# --- the command -------------------------------------------------------------------------------------


def test_missing_db_is_one_line_exit_2(cli: Any, tmp_path: Path) -> None:
    code, out, err = cli("dashboard", "--db", str(tmp_path / "none.sqlite"), "--port", "0")
    assert code == 2 and out == ""
    assert err.startswith("error: --db ") and "no such file" in err and err.count("\n") == 1


@pytest.mark.parametrize("content", [b"not a database at all", b""])
def test_not_a_history_is_one_line_exit_2(cli: Any, tmp_path: Path, content: bytes) -> None:
    bad = tmp_path / "bad.sqlite"
    bad.write_bytes(content)
    code, _, err = cli("dashboard", "--db", str(bad), "--port", "0")
    assert code == 2 and err.startswith("error: --db") and err.count("\n") == 1
    assert bad.read_bytes() == content


def test_a_folder_is_not_a_history(cli: Any, tmp_path: Path) -> None:
    code, _, err = cli("dashboard", "--db", str(tmp_path), "--port", "0")
    assert code == 2 and "not a file" in err


@pytest.mark.parametrize("port", ["-1", "65536"])
def test_bad_port(cli: Any, history_db: tuple[Path, dict[str, int]], port: str) -> None:
    code, _, err = cli("dashboard", "--db", str(history_db[0]), "--port", port)
    assert code == 2 and err.startswith("error: --port") and err.count("\n") == 1


def test_port_in_use(cli: Any, history_db: tuple[Path, dict[str, int]]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, _, err = cli("dashboard", "--db", str(history_db[0]), "--port", str(port))
    assert code == 2 and err.startswith(f"error: --port {port}: cannot listen")


@pytest.mark.procs
def test_command_serves_until_ctrl_c(history_db: tuple[Path, dict[str, int]]) -> None:
    """The real command: prints its URL, answers, and ends on SIGINT with one line and exit 130."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "coplan.cli", "dashboard", "--db", str(history_db[0]), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        url = ""
        for _ in range(5):
            line = proc.stdout.readline()
            if line.startswith("serving "):
                url = line.split()[1]
                break
        assert url.startswith("http://127.0.0.1:"), url
        with urllib.request.urlopen(url + "api/models", timeout=10) as response:
            assert json.loads(response.read())["models"] == ["other-model", MODEL]
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130
    assert err.strip().splitlines() == ["error: interrupted: dashboard stopped; the history was only read"]
