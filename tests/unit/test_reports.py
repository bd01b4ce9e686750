"""What people read: plan summaries name ops by where they are in the model, the ``compare``
HTML plot zooms on the budget and the chosen plans and says on hover which plan a point is, and
the coupling heat map's text stays readable on every cell. Both HTML files open offline."""

from __future__ import annotations

import json
import re
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
