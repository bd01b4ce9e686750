"""``coplan.inspect`` on a real ``torch.compile`` of a small model's training step (CPU).

Three compiles are shared by the module: the model twice (the same program must give the same
fingerprints, pass by pass) and once with a compiler pass that puts an opaque identity op between
the layer norm and its GELU (``regressions.py``): the regression must be caught and named.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import torch
from regressions import REGRESSION, model_and_inputs

import coplan
from coplan.inspect.diff import check, diff
from coplan.inspect.html import render
from coplan.inspect.step import adamw

pytestmark = pytest.mark.compile


def _inspect(config: dict | None = None) -> dict:
    model, x = model_and_inputs()
    # a foreach AdamW: Inductor compiles the optimizer step too (the fused default runs eagerly)
    return coplan.inspect(
        model, (x,), name="normact", steps=3, inductor_config=config, optimizer=adamw("foreach")
    ).record


@pytest.fixture(scope="module")
def runs() -> Iterator[dict[str, dict]]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield {"a": _inspect(), "b": _inspect(), "bad": _inspect(REGRESSION)}
    finally:
        torch.set_num_threads(threads)


def test_two_runs_of_one_program_have_the_same_fingerprints(runs):
    a, b = runs["a"], runs["b"]
    assert a["fingerprint"] == b["fingerprint"]
    assert [(p["graph"], p["name"], p["fingerprint"]) for p in a["passes"]] == [
        (p["graph"], p["name"], p["fingerprint"]) for p in b["passes"]
    ]
    assert diff(a, b)["first_divergence"] is None
    assert check(a, b) == []  # measured times differ, but the same program is not a regression


def test_the_stages_of_a_training_step(runs):
    a = runs["a"]
    assert [g["name"] for g in a["graphs"]] == ["forward", "backward", "optimizer"]
    for g in a["graphs"]:
        stages = [p["stage"] for p in a["passes"] if p["graph"] == g["name"]]
        assert stages[0] == "partition" and stages[-2:] == ["scheduler", "codegen"]
        assert "post_grad" in stages
        codegen = next(p for p in a["passes"] if p["graph"] == g["name"] and p["stage"] == "codegen")
        listed = sum(1 for k in a["kernel_table"] if k["graph"] == g["name"])
        assert codegen["ops_after"] == g["kernels"] == listed
    assert a["notes"] == []  # every instrument read what it watches
    model_stages = [p["stage"] for p in a["passes"] if p["graph"] == "model"]
    assert model_stages[0] == "capture" and "joint" in model_stages
    assert a["kernels"] == len(a["kernel_table"])
    # the norm and its activation are one kernel in the clean forward
    fwd = [k for k in a["kernel_table"] if k["graph"] == "forward"]
    assert any({"aten.native_layer_norm", "aten.gelu"} <= set(k["aten"]) for k in fwd)


def test_lineage_maps_ops_to_kernels_both_ways(runs):
    lineage = runs["a"]["lineage"]
    for kernel, ops in lineage["kernel_to_ops"].items():
        for op in ops:
            assert kernel in lineage["op_to_kernels"][op]
    for k in runs["a"]["kernel_table"]:
        assert f"{k['graph']}/{k['name']}" in lineage["kernel_to_ops"]


def test_predicted_step_is_the_sum_of_its_kernels(runs):
    a = runs["a"]
    assert a["predicted_step_s"] == pytest.approx(sum(k["predicted_s"] for k in a["kernel_table"]))
    assert all(k["predicted_s"] > 0 for k in a["kernel_table"])
    assert a["bytes_moved"] == sum(k["bytes"] for k in a["kernel_table"]) > 0
    assert a["measured"]["step_s"] > 0 and len(a["measured"]["samples"]) == 3


def test_the_optimizer_graph_breaks_are_reported(runs):
    breaks = runs["a"]["graph_breaks"]
    assert breaks and all(b["location"].startswith("torch/optim/") for b in breaks)
    assert all(b["reason"] for b in breaks)


def test_the_injected_regression_is_caught_and_named(runs):
    a, bad = runs["a"], runs["bad"]
    assert bad["fingerprint"] != a["fingerprint"]
    first = diff(a, bad)["first_divergence"]
    assert first == {"graph": "forward", "name": "post_grad_custom_post_pass", "stage": "post_grad"}
    # every forward pass before it is unchanged
    before = [p for p in a["passes"] if p["graph"] == "forward"]
    after = [p for p in bad["passes"] if p["graph"] == "forward"]
    cut = next(i for i, p in enumerate(after) if p["name"] == "post_grad_custom_post_pass")
    assert [p["fingerprint"] for p in before[:cut]] == [p["fingerprint"] for p in after[:cut]]

    regressions = check(a, bad)
    kinds = {r["kind"] for r in regressions}
    assert {"fallback", "unfused", "kernels", "predicted_step"} <= kinds
    fallback = next(r for r in regressions if r["kind"] == "fallback" and r["graph"] == "forward")
    assert fallback["op"] == "coplan_test.identity.default"
    unfused = next(r for r in regressions if r["kind"] == "unfused" and r["graph"] == "forward")
    assert unfused["ops"] == ["aten.native_layer_norm", "aten.gelu"]
    assert unfused["first_divergence"]["name"] == "post_grad_custom_post_pass"
    assert unfused["predicted_saving_s"] > 0
    assert "coplan_test.identity" in unfused["reason"]
    kernels = next(r for r in regressions if r["kind"] == "kernels")
    assert kernels["delta"] >= 2  # the fallback, and the norm and the GELU split in two
    assert bad["predicted_step_s"] > a["predicted_step_s"]


def test_unfused_savings_are_bounded_by_the_kernels_they_merge(runs):
    bad = runs["bad"]
    times = {(k["graph"], k["name"]): k["predicted_s"] for k in bad["kernel_table"]}
    for u in bad["unfused"]:
        for pk, ck in u["kernels"]:
            assert u["predicted_saving_s"] <= u["count"] * (times[(u["graph"], pk)] + times[(u["graph"], ck)])


def test_the_record_is_json_and_its_html_escapes_it(runs):
    rec = dict(runs["a"])
    rec["model"] = "</script><img src=x onerror=alert(1)>"
    text = json.dumps(rec)
    assert json.loads(text)["fingerprint"] == runs["a"]["fingerprint"]
    page = render(rec)
    assert "<img src=x" not in page
    assert page.count("</script>") == 2  # the JSON's and the code's, nothing from the record


def test_recording_stores_the_record(tmp_path):
    from coplan.inspect.history import History

    model, x = model_and_inputs()
    db = tmp_path / "h.sqlite"
    got = coplan.inspect(model, (x,), name="normact", steps=0, db=db)
    assert got.record["record_id"] is not None
    with History(db, create=False) as h:
        stored = h.get(got.record["record_id"])
    assert stored["fingerprint"] == got.fingerprint
    assert stored["measured"] is None
    # the default fused AdamW is one eager kernel: no optimizer graph, no graph break for it
    assert stored["optimizer"] == {"name": "AdamW", "implementation": "fused", "compiled": False}
    assert [g["name"] for g in stored["graphs"]] == ["forward", "backward"]
    assert stored["graph_breaks"] == []


def test_an_instrument_that_fails_does_not_fail_the_compile(monkeypatch):
    from coplan.inspect import observe

    def broken(gm):
        raise RuntimeError("cannot read this graph")

    monkeypatch.setattr(observe, "fingerprint", broken)
    model, x = model_and_inputs()
    got = coplan.inspect(model, (x,), steps=0)
    assert got.kernels > 0  # Inductor compiled and the kernels were read
    assert got.record["notes"] and all("cannot read this graph" in n for n in got.record["notes"])


def test_the_step_is_priced_on_the_hardware_named(runs):
    # the same compiled step priced on an H100 of a DGX (its device) instead of this CPU
    model, x = model_and_inputs()
    got = coplan.inspect(model, (x,), steps=0, hardware="dgx-h100").record
    assert got["hardware"] == "dgx-h100"
    assert got["fingerprint"] != "" and 0 < got["predicted_step_s"] < runs["a"]["predicted_step_s"]
