"""``coplan inspect --html`` opened in a real browser (Debian's Chromium, headless).

The page is made from a real compile of a small model's training step: it must render every pass
of the timeline, the unfused patterns and fallbacks, and answer a lineage search, from the record
embedded in the file alone (no network), with no script error.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from browser_env import CHROMIUM

import coplan

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "inspect"))
from regressions import REGRESSION, model_and_inputs

pytestmark = [
    pytest.mark.browser,
    pytest.mark.compile,
    pytest.mark.skipif(
        not CHROMIUM.exists(), reason=f"{CHROMIUM} is not installed (apt-get install chromium)"
    ),
]


def test_the_inspect_report_in_a_browser(tmp_path: Path, page: Any) -> None:
    model, x = model_and_inputs()
    got = coplan.inspect(model, (x,), name="normact", steps=0, inductor_config=REGRESSION)
    report = got.html(tmp_path / "inspect.html")
    rec = got.record
    errors: list[str] = []
    foreign: list[str] = []
    page.on("pageerror", lambda err: errors.append(str(err)))
    page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    page.on("request", lambda req: None if req.url.startswith("file://") else foreign.append(req.url))

    page.goto(report.as_uri())
    assert page.title() == "coplan inspect: normact"
    assert page.locator("#passes tbody tr").count() == len(rec["passes"])
    assert page.locator("#kernels tbody tr").count() == rec["kernels"]
    unfused = page.locator("#unfused tbody tr")
    assert unfused.count() == len(rec["unfused"]) >= 1
    assert "aten.native_layer_norm -> aten.gelu" in page.locator("#unfused").inner_text()
    assert "coplan_test.identity.default" in page.locator("#fallbacks").inner_text()

    # lineage: a kernel's name finds the ops it holds, an op finds its kernel
    fallback = next(k for k in rec["kernel_table"] if k["kind"] == "fallback")
    page.fill("#lineage-q", fallback["name"])
    found = page.locator("#lineage-results li")
    assert found.count() >= 1 and fallback["name"] in found.first.inner_text()
    op = fallback["ops"][0]
    page.fill("#lineage-q", f"{fallback['graph']}/{op}")
    assert fallback["name"] in page.locator("#lineage-results").inner_text()
    page.fill("#lineage-q", "no-such-op-anywhere")
    assert page.locator("#lineage-results").inner_text() == "no op or kernel matches"
    assert errors == [] and foreign == []
