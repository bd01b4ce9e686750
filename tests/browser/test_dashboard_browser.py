"""``coplan dashboard`` in a real browser: Debian's Chromium, headless, driven by Playwright.

Playwright's pip package carries its own driver; the browser is the system's ``/usr/bin/chromium``
(``apt-get install chromium``), so nothing is downloaded when the test runs (``playwright install``
is never needed). Without Chromium or Playwright the test is skipped with the reason.

Over a history of three inspect records of one model, the third a regression (a new fallback and
two more kernels), the page must load, plot one point per record with the regression marked, open
the diff of the regression from the regressions table (first diverged pass highlighted, the new
fallback listed) and the diff of a point clicked on the plot, show record text as text only, and
ask nothing of any server but its own.
"""

from __future__ import annotations

import importlib.util
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from browser_env import CHROMIUM

from coplan.inspect.dashboard import DashboardServer

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(
        not CHROMIUM.exists(), reason=f"{CHROMIUM} is not installed (apt-get install chromium)"
    ),
]


def _records_module() -> Any:
    """The fabricated history of the API tests (tests/unit/test_dashboard.py), loaded by path: the
    browser and the API are tested on the same records."""
    path = Path(__file__).resolve().parents[1] / "unit" / "test_dashboard.py"
    spec = importlib.util.spec_from_file_location("dashboard_records", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


records = _records_module()


@pytest.fixture
def dashboard(tmp_path: Path) -> Iterator[tuple[str, dict[str, int]]]:
    db = tmp_path / "history.sqlite"
    ids = records.fill_history(db)
    srv = DashboardServer(db, 0)
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield srv.url, ids
    finally:
        srv.shutdown()
        srv.server_close()
        thread.join(5)


def test_plot_regression_and_diff(dashboard: tuple[str, dict[str, int]], page: Any) -> None:
    url, ids = dashboard
    errors: list[str] = []
    foreign: list[str] = []
    page.on("pageerror", lambda err: errors.append(str(err)))
    page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    page.on("request", lambda req: None if req.url.startswith(url) else foreign.append(req.url))

    page.goto(url)
    assert page.title() == "coplan dashboard"
    # the first model in the list is shown first; switch to the one with the three records
    page.wait_for_function("() => document.body.dataset.loaded !== undefined")
    page.select_option("#model-select", records.MODEL)
    page.wait_for_function("() => document.getElementById('plot-kernels').data?.[0]?.x?.length === 3")

    # one point per record in every plot, drawn: the trace data and the SVG markers alike
    counts = page.evaluate(
        """() => Object.fromEntries(["plot-kernels", "plot-fallbacks", "plot-unfused", "plot-step"].map(
             (id) => [id, document.getElementById(id).data.map((t) => t.x.length)]))"""
    )
    assert counts == {"plot-kernels": [3], "plot-fallbacks": [3], "plot-unfused": [3], "plot-step": [3, 3]}
    assert page.locator("#plot-kernels .scatterlayer .point").count() == 3
    ys = page.evaluate("document.getElementById('plot-kernels').data[0].y")
    assert ys == [10, 10, 12]
    colors = page.evaluate("document.getElementById('plot-kernels').data[0].marker.color")
    assert colors[0] == colors[1] != colors[2]  # only the regression is marked

    # the regressions table: every row is the regressed record, linked to its diff
    rows = page.locator("#regressions tbody tr")
    assert rows.count() >= 3
    assert set(page.locator("#regressions tbody tr").evaluate_all("rs => rs.map(r => r.dataset.record)")) == {
        str(ids["regressed"])
    }
    fallback_row = rows.filter(has_text=records.NEW_FALLBACK).first
    fallback_row.locator("a.diff-link").click()

    panel = page.locator(f"#diff-panel[data-b='{ids['regressed']}']")
    panel.wait_for(state="visible")
    assert panel.get_attribute("data-a") == str(ids["same"])
    assert page.locator("#first-divergence-name").inner_text() == "forward / remove_noop_ops"
    highlighted = page.locator("#diff-passes tr.first-divergence")
    assert highlighted.count() == 1
    cells = highlighted.locator("td").all_inner_texts()
    assert cells[1:3] == ["forward", "remove_noop_ops"]
    assert page.locator("#diff-passes tr.changed").count() == len(records.PASSES) - records.DIVERGES_AT
    added = page.locator("#diff-fallbacks-added").inner_text()
    assert records.NEW_FALLBACK in added
    assert "10 \u2192 12 (+2)" in page.locator("#diff-facts").inner_text()
    assert page.evaluate("location.hash") == f"#diff/{ids['same']}/{ids['regressed']}"

    # record text is text: the fallback reason's <img onerror> is shown, never run
    assert records.XSS in added
    assert page.evaluate("window.__xss") is None
    assert page.locator("img").count() == 0

    # a click on the plot's second point opens its diff against the first: nothing diverged
    page.locator("#plot-kernels").scroll_into_view_if_needed()  # the open diff scrolled it away
    box = page.locator("#plot-kernels .scatterlayer .point").nth(1).bounding_box()
    x, y = box["x"] + box["width"] / 2, box["y"] + box["height"] / 2
    page.mouse.move(x, y)
    page.mouse.click(x, y)
    page.locator(f"#diff-panel[data-b='{ids['same']}']").wait_for(state="visible")
    assert page.locator("#diff-panel").get_attribute("data-a") == str(ids["base"])
    assert "No pass diverges" in page.locator("#diff-first-divergence").inner_text()
    assert page.locator("#diff-passes tr.changed").count() == 0

    assert errors == []
    assert foreign == []
