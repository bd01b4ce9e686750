"""What people read: plan summaries name ops by where they are in the model, the ``compare``
HTML plot zooms on the budget and the chosen plans and says on hover which plan a point is, and
the coupling heat map's text stays readable on every cell. Both HTML files open offline."""

from __future__ import annotations

import json
import math
import re
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest

from coplan.ir.types import Graph, GraphMeta, Op, OpKind, Phase, Tensor, TensorRole
from coplan.plan import PlanContext, PrecisionPlan, RematPlan, plan_summary
from coplan.plan.labels import Labels, _span

# --- module paths instead of op ids ----------------------------------------------------------------


@pytest.fixture(scope="module")
def gpt2_ctx() -> PlanContext:
    from coplan.cost import CostModel
    from coplan.hardware import load_cluster
    from coplan.models.spec import load_model_spec

    spec = load_model_spec("gpt2-124m")
    return PlanContext(CostModel(spec=spec), load_cluster("dgx-h100", 1), global_batch=8, seq=1024)


def _mentions(text: str, name: str) -> bool:
    return re.search(rf"(?<![\w.\[]){re.escape(name)}(?!\w)", text) is not None


def test_plan_summary_names_module_paths_not_op_ids(gpt2_ctx: PlanContext) -> None:
    idx = gpt2_ctx.index
    ops = list(idx.op_by_name.values())
    norms = [op for op in ops if op.target == "layer_norm"]
    block_norms = [op for op in norms if op.block is not None]
    assert block_norms and len(norms) > len(block_norms)  # both kinds: in the blocks and outside
    saved = [n for names in idx.saved_names.values() for n in names]
    plan = gpt2_ctx.default_plan().with_(
        precision=PrecisionPlan(compute="bf16", ops=tuple((op.name, "fp32") for op in norms)),
        remat=RematPlan(recompute=frozenset(saved[:3])),
    )
    text = " | ".join(plan_summary(plan, None, idx).values())
    for op in ops:  # no op is named by its IR name
        assert not _mentions(text, op.name), (op.name, text)
    container = idx.graph.meta.block_container
    for op in norms[:4]:
        ref = f"{container}.{op.block}"
        where = f"{container}[*]{op.module_path[len(ref) :]}" if op.block is not None else op.module_path
        assert idx.labels.op(op.name) == where
        assert where in text
    for n in saved[:3]:
        assert idx.labels.tensor(n) in text and not _mentions(text, n)
    # machines keep reading the IR names: the plan's JSON is unchanged
    assert {n for n, _ in plan.to_dict()["precision"]["ops"].items()} == {op.name for op in norms}


def test_labels_are_unique_for_every_name_a_plan_can_use(gpt2_ctx: PlanContext) -> None:
    idx = gpt2_ctx.index
    labels = [idx.labels.op(n) for n in idx.op_by_name]
    assert len(set(labels)) == len(labels)
    assert all(not re.fullmatch(r"[a-z_]+_\d+", x) for x in labels)


def _captured_graph() -> tuple[Graph, dict[int, list[Op]], list[Op], dict[int, int]]:
    """Two identical blocks as a captured graph names them: values after FX nodes, so ops that
    share a module are told apart by their kind and order."""
    tensors: list[Tensor] = []
    ops: list[Op] = []

    def add(block: int | None, path: str, target: str, phase: Phase = Phase.FORWARD) -> Op:
        tid = len(tensors)
        name = f"{target.split('.')[1]}_{len(ops)}"
        tensors.append(Tensor(id=tid, name=name, shape=(4,), dtype="float32", role=TensorRole.ACTIVATION))
        op = Op(
            id=len(ops),
            name=name,
            target=target,
            kind=OpKind.ELEMENTWISE,
            inputs=(),
            outputs=(tid,),
            phase=phase,
            module_path=path,
            block=block,
        )
        ops.append(op)
        return op

    blocks: dict[int, list[Op]] = {}
    for b in range(2):
        p = f"model.layers.{b}"
        blocks[b] = [
            add(b, f"{p}.mlp.fc", "aten.addmm.default"),
            add(b, f"{p}.mlp.act", "aten.gelu.default"),
            add(b, f"{p}.mlp", "aten.mul.Tensor"),
            add(b, f"{p}.mlp", "aten.mul.Tensor"),
            add(b, f"{p}.mlp", "aten.add.Tensor"),
            add(b, f"{p}.mlp", "aten.mul.Tensor", Phase.BACKWARD),
        ]
    outside = [add(None, "", "aten.mul.Tensor"), add(None, "norm", "aten.mul.Tensor")]
    graph = Graph(tuple(ops), tuple(tensors), GraphMeta(block_container="model.layers"))
    return graph, blocks, outside, {0: 0, 1: 0}


def test_labels_of_a_captured_graph() -> None:
    graph, blocks, outside, ref_of = _captured_graph()
    labels = Labels(graph, blocks, outside, ref_of)
    got = [labels.op(op.name) for op in blocks[0]]
    assert got == [
        "model.layers[*].mlp.fc",
        "model.layers[*].mlp.act",
        "model.layers[*].mlp.mul[0]",
        "model.layers[*].mlp.mul[1]",
        "model.layers[*].mlp.add",
        "model.layers[*].mlp (backward)",
    ]
    assert [labels.op(op.name) for op in outside] == ["mul", "norm"]
    assert labels.tensor(graph.tensors[blocks[0][1].outputs[0]].name) == "model.layers[*].mlp.act"
    assert labels.op("no_such_op_1") == "no_such_op_1"
    names = [op.name for op in reversed(blocks[0])]
    assert labels.ops_in_order(names) == [op.name for op in blocks[0]]


@pytest.mark.parametrize(
    ("blocks", "total", "want"),
    [
        ((0, 1, 2, 3), 4, "[*]"),
        ((0, 1, 2), 6, "[0-2]"),
        ((6, 0, 2, 4), 8, "[0,2,...,6]"),
        ((3,), 8, ".3"),
        ((0, 1, 5), 8, "[0,1,5]"),
    ],
)
def test_block_spans(blocks: tuple[int, ...], total: int, want: str) -> None:
    assert _span(blocks, total) == want


# --- the compare report ------------------------------------------------------------------------------

GIB = 2**30


def figures(doc: str) -> dict[str, tuple[list[dict[str, Any]], dict[str, Any]]]:
    """Every plotly figure embedded in ``doc``: element id -> (traces, layout)."""
    dec = json.JSONDecoder()
    out = {}
    for m in re.finditer(r'Plotly\.newPlot\(\s*"([^"]+)",\s*', doc):
        data, end = dec.raw_decode(doc, m.end())
        sep = re.match(r"\s*,\s*", doc[end:])
        assert sep is not None
        layout, _ = dec.raw_decode(doc, end + sep.end())
        out[m.group(1)] = (data, layout)
    return out


def assert_offline(doc: str) -> None:
    """Self-contained: plotly.js is in the page, no script is loaded from the network."""
    assert re.search(r"<script[^>]*\bsrc\s*=", doc) is None
    assert "plotly.js v" in doc and "Plotly.newPlot" in doc


@pytest.fixture(scope="module")
def squeezed_compare(tmp_path_factory: pytest.TempPathFactory) -> tuple[PlanContext, dict[str, Any], str]:
    """gpt2-124m on one H100 under a budget most layouts exceed (their peaks reach several times
    it), sequential and joint; the report written as ``coplan compare --html`` writes it."""
    from coplan.cli.report import write_html
    from coplan.cost import CostModel
    from coplan.hardware import load_cluster
    from coplan.models.spec import load_model_spec
    from coplan.search import Options, run_strategy

    spec = load_model_spec("gpt2-124m")
    ctx = PlanContext(
        CostModel(spec=spec), load_cluster("dgx-h100", 1), global_batch=32, seq=1024, budget_bytes=12 * GIB
    )
    seq = run_strategy("sequential", ctx, Options())
    results = {"sequential": seq, "joint": run_strategy("joint", ctx, Options(warm=[seq.plan]))}
    path = tmp_path_factory.mktemp("compare") / "report.html"
    write_html(path, ctx, results)
    return ctx, results, path.read_text(encoding="utf-8")


def test_compare_html_is_self_contained(squeezed_compare: tuple[PlanContext, dict[str, Any], str]) -> None:
    _, _, doc = squeezed_compare
    assert_offline(doc)
    assert "<img" not in doc


def test_compare_plot_marks_the_budget_and_each_chosen_plan(
    squeezed_compare: tuple[PlanContext, dict[str, Any], str],
) -> None:
    from coplan.cli.report import PLOT_ID

    ctx, results, doc = squeezed_compare
    data, _ = figures(doc)[PLOT_ID]
    budget = [t for t in data if t["name"].startswith("memory budget")]
    assert len(budget) == 1 and budget[0]["mode"] == "lines"
    assert budget[0]["y"] == pytest.approx([ctx.budget / GIB] * 2)
    chosen = [t for t in data if t.get("legendgroup") == "chosen"]
    assert [t["name"].split(":")[0] for t in chosen] == list(results)
    for t, r in zip(chosen, results.values(), strict=True):
        assert t["x"] == pytest.approx([r.step_time_s * 1e3]) and len(t["y"]) == 1
        assert t["y"] == pytest.approx([r.estimate.memory.peak_bytes / GIB])
    assert len({t["marker"]["symbol"] for t in chosen}) == len(chosen)  # told apart in the legend


def test_compare_plot_zooms_on_the_budget_not_the_outliers(
    squeezed_compare: tuple[PlanContext, dict[str, Any], str],
) -> None:
    from coplan.cli.report import PLOT_ID

    ctx, results, doc = squeezed_compare
    data, layout = figures(doc)[PLOT_ID]
    cloud = [t for t in data if t["name"].startswith("plans priced")]
    over = [y for t in cloud if "over budget" in t["name"] for y in t["y"]]
    highest = max(over)
    assert highest > 2 * ctx.budget / GIB, "the job must price plans far over its budget"
    lo, hi = layout["yaxis"]["range"]
    assert lo <= min(y for t in cloud for y in t["y"])
    assert ctx.budget / GIB < hi < min(1.5 * ctx.budget / GIB, highest)
    x0, x1 = layout["xaxis"]["range"]  # log10 of ms
    for r in results.values():
        assert x0 < math.log10(r.step_time_s * 1e3) < x1
        assert r.estimate.memory.peak_bytes / GIB < hi
    above = sum(y > hi for y in over)
    assert above > 0
    assert any(f"{above:,} plans lie above" in a["text"] for a in layout["annotations"])
    over_trace = next(t for t in cloud if "over budget" in t["name"])
    fit_trace = next(t for t in cloud if "that fit" in t["name"])
    assert over_trace["marker"]["opacity"] < fit_trace["marker"]["opacity"]  # drawn pale


def test_compare_hover_says_which_plan_a_point_is(
    squeezed_compare: tuple[PlanContext, dict[str, Any], str],
) -> None:
    from coplan.cli.report import PLOT_ID

    _ctx, results, doc = squeezed_compare
    data, _ = figures(doc)[PLOT_ID]
    chosen = [t for t in data if t.get("legendgroup") == "chosen"]
    for t, (name, r) in zip(chosen, results.items(), strict=True):
        (text,) = t["hovertext"]
        p = r.plan.parallel
        assert f"chosen by {name}" in text and r.plan.fingerprint in text
        assert f"TP{p.tp} PP{p.pp} DP{p.dp}" in text and f"microbatch: {p.microbatch}" in text
        assert f"precision: {r.plan.precision.compute}" in text
        assert f"{r.step_time_s * 1e3:.2f} ms" in text
        assert f"{r.estimate.memory.peak_bytes / GIB:.2f} GiB" in text
        for n in r.plan.remat.all_names:
            assert not _mentions(text, n)
    considered = sum(len(r.considered) for r in results.values())
    cloud = [t for t in data if t["name"].startswith("plans priced")]
    assert sum(len(t["hovertext"]) for t in cloud) == sum(len(t["x"]) for t in cloud) == considered
    for t in cloud:
        for x, y, text in zip(t["x"], t["y"], t["hovertext"], strict=True):
            for field in ("layout: TP", "microbatch: ", "recompute: ", "precision: ", "priced by: "):
                assert field in text
            assert f"step time: {x:.2f} ms" in text and f"peak: {y:.2f} GiB" in text


def test_compare_table_names_modules_not_op_ids(
    squeezed_compare: tuple[PlanContext, dict[str, Any], str],
) -> None:
    _ctx, results, doc = squeezed_compare
    table = doc[doc.rindex("<table>") :]
    assert all(name in table for name in results)
    named = [n for r in results.values() for n, _ in r.plan.precision.ops]
    named += [n for r in results.values() for n in r.plan.remat.all_names]
    assert named, "the plans must name ops or tensors for this to test anything"
    for n in named:
        assert not _mentions(table, n)
    assert "[*]" in table


# --- the coupling report's heat maps ---------------------------------------------------------------

STUDY = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "coupling.json"


def _channels(colour: str) -> tuple[float, ...]:
    if colour.startswith("#"):
        return tuple(int(colour[i : i + 2], 16) for i in (1, 3, 5))
    return tuple(float(v) for v in re.findall(r"[\d.]+", colour)[:3])


def _wcag_luminance(rgb: tuple[float, ...]) -> float:
    def lin(c: float) -> float:
        c /= 255
        return c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4

    r, g, b = (lin(c) for c in rgb)
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def _ratio(a: tuple[float, ...], b: tuple[float, ...]) -> float:
    hi, lo = sorted((_wcag_luminance(a), _wcag_luminance(b)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


def _cell_colour(trace: dict[str, Any], layout: dict[str, Any], v: float | None) -> tuple[float, ...]:
    """The colour plotly.js paints a heat-map cell: the scale interpolated in RGB between its
    stops at the value's place in [zmin, zmax]; a cell without a value shows the plot area."""
    if v is None:
        return _channels(layout["plot_bgcolor"])
    t = min(max((v - trace["zmin"]) / (trace["zmax"] - trace["zmin"]), 0.0), 1.0)
    stops = [(float(p), _channels(c)) for p, c in trace["colorscale"]]
    for (p0, c0), (p1, c1) in pairwise(stops):
        if p0 <= t <= p1:
            f = (t - p0) / (p1 - p0) if p1 > p0 else 0.0
            return tuple(a + (b - a) * f for a, b in zip(c0, c1, strict=True))
    raise AssertionError(f"{t} outside the colour scale")


def _study(negative: bool) -> dict[str, Any]:
    data = json.loads(STUDY.read_text(encoding="utf-8"))
    if negative:  # a coupling below zero: the scale turns diverging
        data["pairs"]["fusion+remat"]["mean_joint_over_sequential"] = 0.9
        sc = data["scenarios"][0]
        sc["pairs"]["fusion+remat"]["joint_over_sequential"] = 0.93
    return data


@pytest.mark.parametrize("negative", [False, True])
def test_heat_map_text_contrasts_with_every_cell(negative: bool, tmp_path: Path) -> None:
    from coplan.experiments.coupling_report import write_html

    path = tmp_path / "coupling.html"
    write_html(path, _study(negative), None)
    doc = path.read_text(encoding="utf-8")
    assert_offline(doc)
    maps = {fid: f for fid, f in figures(doc).items() if any(t["type"] == "heatmap" for t in f[0])}
    assert set(maps) == {"coupling-matrix", "coupling-scenarios"}
    for data, layout in maps.values():
        (trace,) = [t for t in data if t["type"] == "heatmap"]
        z = trace["z"]
        assert (min(v for row in z for v in row if v is not None) < 0) == negative
        cells = {(x, y): z[r][c] for r, y in enumerate(trace["y"]) for c, x in enumerate(trace["x"])}
        notes = {(a["x"], a["y"]): a for a in layout["annotations"]}
        assert notes.keys() == cells.keys()  # every cell says its figure
        lightness = set()
        for key, v in cells.items():
            cell = _cell_colour(trace, layout, v)
            text = _channels(notes[key]["font"]["color"])
            assert _ratio(cell, text) >= 4.5, (key, v, cell, text)
            lightness.add(text)
        assert len(lightness) == 2  # dark cells and light cells both occur: the text colour follows them


def test_text_colour_reads_on_any_colour() -> None:
    from coplan.experiments.coupling_report import DIVERGING, SEQUENTIAL, colour_at, text_colour

    for scale in (SEQUENTIAL, DIVERGING):
        for i in range(201):
            cell = colour_at(scale, i / 200)
            assert _ratio(cell, _channels(text_colour(cell))) >= 4.5
