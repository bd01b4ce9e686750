"""Properties of the IR over generated graphs: valid graphs pass the checker, the fingerprint is
deterministic and changes under any single mutation, and structural mutations are caught by the
rule they break.

Two sources of graphs: small hand-made training steps (a random DAG of elementwise ops and matmuls
over a few inputs, its backward linked op by op, an optimizer update of the weight), built through
``relink``; and ``build_graph`` over small random ``ModelSpec``s.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coplan.capture.synthetic import build_graph
from coplan.ir.checker import check
from coplan.ir.fingerprint import fingerprint
from coplan.ir.saved import mark_saved
from coplan.ir.types import (
    DTYPE_BYTES,
    Graph,
    GraphMeta,
    Op,
    OpKind,
    Phase,
    Tensor,
    TensorRole,
    relink,
)
from coplan.models.spec import PRESETS, ModelSpec

FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SPECS = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])

BINARY = ("aten.add.Tensor", "aten.mul.Tensor", "aten.sub.Tensor")
UNARY = ("aten.relu.default", "aten.neg.default", "aten.tanh.default")


# Hand-made graphs ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Recipe:
    """Every choice behind one hand-made graph; ``build`` turns it into the same graph every time.

    ``fwd`` items are (kind, target, operands): ("bin", target, (a, b)), ("un", target, (a,)),
    ("mm", "aten.mm.default", (a,)), ("view", "aten.view.default", (a,)), where a and b index the pool
    of (rows, cols) values available so far (inputs, then each op's output).
    """

    rows: int
    cols: int
    dtype: str
    n_inputs: int
    fwd: tuple[tuple[str, str, tuple[int, ...]], ...]

    @property
    def has_mm(self) -> bool:
        return any(step[0] == "mm" for step in self.fwd)


@st.composite
def recipes(draw: st.DrawFn, force_mm: bool = False) -> Recipe:
    rows, cols = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    dtype = draw(st.sampled_from(["float32", "bfloat16", "float16"]))
    n_inputs = draw(st.integers(1, 3))
    n_fwd = draw(st.integers(1, 6))
    mm_at = draw(st.integers(0, n_fwd - 1)) if force_mm else -1
    pool = n_inputs
    steps: list[tuple[str, str, tuple[int, ...]]] = []
    for i in range(n_fwd):
        kind = "mm" if i == mm_at else draw(st.sampled_from(["bin", "un", "mm", "view"]))
        a = draw(st.integers(0, pool - 1))
        if kind == "bin":
            steps.append(("bin", draw(st.sampled_from(BINARY)), (a, draw(st.integers(0, pool - 1)))))
        elif kind == "un":
            steps.append(("un", draw(st.sampled_from(UNARY)), (a,)))
        else:
            steps.append((kind, f"aten.{kind}.default", (a,)))
        pool += 1
    return Recipe(rows, cols, dtype, n_inputs, tuple(steps))


class _Builder:
    def __init__(self, dtype: str) -> None:
        self.dtype = dtype
        self.tensors: list[Tensor] = []
        self.ops: list[Op] = []

    def tensor(self, shape: tuple[int, ...], role: TensorRole, **kw: Any) -> int:
        tid = len(self.tensors)
        self.tensors.append(Tensor(id=tid, name=f"t{tid}", shape=shape, dtype=self.dtype, role=role, **kw))
        return tid

    def op(
        self, target: str, kind: OpKind, phase: Phase, inputs: list[int], outputs: list[int], **kw: Any
    ) -> int:
        oid = len(self.ops)
        self.ops.append(
            Op(
                id=oid,
                name=f"op{oid}",
                target=target,
                kind=kind,
                inputs=tuple(inputs),
                outputs=tuple(outputs),
                phase=phase,
                **kw,
            )
        )
        return oid


def build(recipe: Recipe) -> Graph:
    """A valid training step: forward ops, backward ops in reverse (each linked to its forward op,
    gradients of values used twice summed), an SGD update of the weight if it got a gradient."""
    r, c = recipe.rows, recipe.cols
    shape = (r, c)
    b = _Builder(recipe.dtype)
    pool = [b.tensor(shape, TensorRole.INPUT) for _ in range(recipe.n_inputs)]
    w = b.tensor((c, c), TensorRole.PARAMETER, param_name="w") if recipe.has_mm else None
    fwd: list[tuple[str, int, list[int], int]] = []  # (kind, op id, inputs, output)
    for kind, target, operands in recipe.fwd:
        ins = [pool[i] for i in operands]
        if kind == "view":
            root = b.tensors[ins[0]].storage_id
            out = b.tensor(shape, TensorRole.ACTIVATION, alias_of=root)
            oid = b.op(target, OpKind.VIEW, Phase.FORWARD, ins, [out], args=str(shape))
        else:
            out = b.tensor(shape, TensorRole.ACTIVATION)
            if kind == "mm":
                assert w is not None
                ins = [ins[0], w]
                oid = b.op(target, OpKind.MATMUL, Phase.FORWARD, ins, [out], flops=2 * r * c * c)
            else:
                oid = b.op(target, OpKind.ELEMENTWISE, Phase.FORWARD, ins, [out])
        fwd.append((kind, oid, ins, out))
        pool.append(out)

    _, last_op, _, last = fwd[-1]
    seed = b.tensor(shape, TensorRole.GRADIENT)
    b.op("aten.ones_like.default", OpKind.CREATION, Phase.BACKWARD, [last], [seed], forward_op=last_op)
    grad: dict[int, int] = {last: seed}

    def accumulate(x: int, gx: int, fwd_op: int) -> None:
        prev = grad.get(x)
        if prev is None:
            grad[x] = gx
            return
        s = b.tensor(b.tensors[x].shape, TensorRole.GRADIENT)
        b.op("aten.add.Tensor", OpKind.ELEMENTWISE, Phase.BACKWARD, [prev, gx], [s], forward_op=fwd_op)
        grad[x] = s

    for kind, oid, ins, out in reversed(fwd):
        gy = grad.get(out)
        if gy is None:  # not on the path to the last value
            continue
        if kind == "mm":
            assert w is not None
            x = ins[0]
            gx = b.tensor(shape, TensorRole.GRADIENT)
            b.op(
                "aten.mm.default",
                OpKind.MATMUL,
                Phase.BACKWARD,
                [gy, w],
                [gx],
                forward_op=oid,
                flops=2 * r * c * c,
            )
            gw = b.tensor((c, c), TensorRole.GRADIENT)
            b.op(
                "mm_weight_grad",
                OpKind.MATMUL,
                Phase.BACKWARD,
                [x, gy],
                [gw],
                forward_op=oid,
                flops=2 * r * c * c,
            )
            accumulate(w, gw, oid)
            accumulate(x, gx, oid)
        elif kind == "view":
            gx = b.tensor(shape, TensorRole.GRADIENT, alias_of=b.tensors[gy].storage_id)
            b.op(
                "aten.view.default", OpKind.VIEW, Phase.BACKWARD, [gy], [gx], forward_op=oid, args=str(shape)
            )
            accumulate(ins[0], gx, oid)
        else:
            distinct = list(dict.fromkeys(ins))
            gxs = [b.tensor(shape, TensorRole.GRADIENT) for _ in distinct]
            target = "aten.mul.Tensor" if kind == "bin" else "aten.threshold_backward.default"
            b.op(target, OpKind.ELEMENTWISE, Phase.BACKWARD, [gy, *ins], gxs, forward_op=oid)
            for x, gx in zip(distinct, gxs, strict=True):
                accumulate(x, gx, oid)

    outputs = [last]
    if w is not None and w in grad:
        gw = grad[w]
        b.tensors[gw] = replace(b.tensors[gw], grad_of=w)
        w1 = b.tensor((c, c), TensorRole.PARAMETER, alias_of=w, updates=w, param_name="w")
        b.op("sgd", OpKind.OPTIMIZER, Phase.OPTIMIZER, [w, gw], [w1], args="lr=0.1")
        outputs.append(w1)
    g = relink(b.ops, b.tensors, GraphMeta(source="hand"), tuple(outputs))
    return mark_saved(g, g.outputs)


# Small model specs ---------------------------------------------------------------------------------


@st.composite
def model_specs(draw: st.DrawFn) -> ModelSpec:
    position = draw(st.sampled_from(["learned", "rope"]))
    n_heads = draw(st.integers(1, 4))
    head_dim = draw(st.sampled_from([2, 4] if position == "rope" else [2, 3, 4]))
    n_kv_heads = draw(st.sampled_from([None, *(k for k in range(1, n_heads + 1) if n_heads % k == 0)]))
    n_experts = draw(st.sampled_from([0, 0, 2, 3, 4]))
    top_k = draw(st.integers(1, n_experts)) if n_experts > 1 else 1
    return ModelSpec(
        n_layers=draw(st.integers(1, 3)),
        d_model=n_heads * head_dim,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        vocab_size=draw(st.integers(4, 32)),
        seq_len=draw(st.integers(2, 16)),
        ffn_hidden=draw(st.one_of(st.none(), st.integers(1, 24))),
        activation=draw(st.sampled_from(["gelu", "swiglu"])),
        norm=draw(st.sampled_from(["layernorm", "rmsnorm"])),
        position=position,
        tied_embeddings=draw(st.booleans()),
        # MoE with biases does not build (see test_moe_with_bias_builds below).
        bias=draw(st.booleans()),
        n_experts=n_experts,
        top_k=top_k,
        capacity_factor=draw(st.sampled_from([0.5, 1.0, 1.5])),
    )


@st.composite
def spec_graphs(draw: st.DrawFn, min_layers: int = 1) -> tuple[ModelSpec, int, int]:
    spec = draw(model_specs())
    if spec.n_layers < min_layers:
        spec = replace(spec, n_layers=min_layers)
    batch = draw(st.integers(1, 2))
    seq = draw(st.integers(1, spec.seq_len))
    return spec, batch, seq


# Mutations -----------------------------------------------------------------------------------------


def _rules(g: Graph) -> set[str]:
    return {v.rule for v in check(g)}


def _with_tensor(g: Graph, tid: int, **changes: Any) -> Graph:
    tensors = list(g.tensors)
    tensors[tid] = replace(tensors[tid], **changes)
    return relink(g.ops, tensors, g.meta, g.outputs)


def _with_op(g: Graph, oid: int, **changes: Any) -> Graph:
    ops = list(g.ops)
    ops[oid] = replace(ops[oid], **changes)
    return relink(ops, g.tensors, g.meta, g.outputs)


def _other(values: list[object], current: object, data: st.DataObject) -> object:
    return data.draw(st.sampled_from([v for v in values if v != current]))


def _grown(shape: tuple[int, ...], data: st.DataObject) -> tuple[int, ...]:
    how = data.draw(st.sampled_from(["grow", "append", "drop"] if shape else ["append"]))
    if how == "append":
        return (*shape, data.draw(st.integers(1, 3)))
    if how == "drop":
        return shape[:-1]
    i = data.draw(st.integers(0, len(shape) - 1))
    return (*shape[:i], shape[i] + data.draw(st.integers(1, 3)), *shape[i + 1 :])


def _tensor_mutations(g: Graph, tid: int, data: st.DataObject) -> dict[str, Callable[[], Graph]]:
    t = g.tensors[tid]
    others = [i for i in range(len(g.tensors)) if i != tid]
    return {
        "shape": lambda: _with_tensor(g, tid, shape=_grown(t.shape, data)),
        "dtype": lambda: _with_tensor(g, tid, dtype=_other(list(DTYPE_BYTES), t.dtype, data)),
        "role": lambda: _with_tensor(g, tid, role=_other(list(TensorRole), t.role, data)),
        "saved": lambda: _with_tensor(g, tid, saved_for_backward=not t.saved_for_backward),
        "param_name": lambda: _with_tensor(g, tid, param_name=t.param_name + "_x"),
        "alias_of": lambda: _with_tensor(g, tid, alias_of=_other([None, *others], t.alias_of, data)),
        "grad_of": lambda: _with_tensor(g, tid, grad_of=_other([None, *others], t.grad_of, data)),
        "updates": lambda: _with_tensor(g, tid, updates=_other([None, *others], t.updates, data)),
    }


def _op_mutations(g: Graph, oid: int, data: st.DataObject) -> dict[str, Callable[[], Graph]]:
    op = g.ops[oid]
    muts: dict[str, Callable[[], Graph]] = {
        "target": lambda: _with_op(g, oid, target=op.target + "_x"),
        "kind": lambda: _with_op(g, oid, kind=_other(list(OpKind), op.kind, data)),
        "args": lambda: _with_op(g, oid, args=op.args + ";x"),
        "module_path": lambda: _with_op(g, oid, module_path=op.module_path + ".x"),
        "block": lambda: _with_op(g, oid, block=_other([None, 0, 1, 7], op.block, data)),
    }
    if op.forward_op is None:
        muts["phase"] = lambda: _with_op(g, oid, phase=_other(list(Phase), op.phase, data))
    else:
        fwd_ops = [o.id for o in g.ops_in(Phase.FORWARD) if o.id != op.forward_op]
        if fwd_ops:
            muts["forward_op"] = lambda: _with_op(g, oid, forward_op=data.draw(st.sampled_from(fwd_ops)))
    if op.inputs != op.inputs[::-1]:
        muts["input_order"] = lambda: _with_op(g, oid, inputs=op.inputs[::-1])
    return muts


def _mutate_anything(g: Graph, data: st.DataObject) -> tuple[str, Graph]:
    if data.draw(st.booleans(), label="mutate a tensor"):
        tid = data.draw(st.integers(0, len(g.tensors) - 1), label="tensor")
        muts = _tensor_mutations(g, tid, data)
    else:
        oid = data.draw(st.integers(0, len(g.ops) - 1), label="op")
        muts = _op_mutations(g, oid, data)
    name = data.draw(st.sampled_from(sorted(muts)), label="mutation")
    return name, muts[name]()


def _rewire_to_later(g: Graph, data: st.DataObject) -> Graph:
    oid = data.draw(st.sampled_from([op.id for op in g.ops if op.inputs]), label="op")
    later = [t for op in g.ops[oid:] for t in op.outputs]
    pos = data.draw(st.integers(0, len(g.ops[oid].inputs) - 1), label="input")
    inputs = list(g.ops[oid].inputs)
    inputs[pos] = data.draw(st.sampled_from(later), label="later tensor")
    return _with_op(g, oid, inputs=tuple(inputs))


def _drop_forward_link(g: Graph, data: st.DataObject) -> Graph:
    oid = data.draw(st.sampled_from([op.id for op in g.ops_in(Phase.BACKWARD)]), label="backward op")
    return _with_op(g, oid, forward_op=None)


# Hand-made graphs: properties ----------------------------------------------------------------------


@FAST
@given(recipes())
def test_hand_graphs_are_valid(recipe: Recipe) -> None:
    g = build(recipe)
    assert check(g) == []
    # Links are derived: rebuilding from stale ones gives the same graph.
    stale = [replace(t, producer=None, consumers=()) for t in g.tensors]
    assert relink(g.ops, stale, g.meta, g.outputs) == g
    assert relink(g.ops, g.tensors, g.meta, g.outputs) == g
    # The weight's update is not a second parameter.
    assert [t.param_name for t in g.parameters] == (["w"] if recipe.has_mm else [])
    # Saved activations, each storage once, never more than all activations together.
    acts = [t for t in g.tensors if t.role is TensorRole.ACTIVATION and t.alias_of is None]
    assert 0 <= g.activation_bytes <= sum(t.nbytes for t in acts)
    assert g.activation_bytes % (recipe.rows * recipe.cols * DTYPE_BYTES[recipe.dtype]) == 0


@FAST
@given(recipes())
def test_hand_fingerprint_is_deterministic(recipe: Recipe) -> None:
    g1, g2 = build(recipe), build(recipe)
    assert g1 == g2
    assert fingerprint(g1) == fingerprint(g2)
    assert len(fingerprint(g1)) == 16
    assert fingerprint(g1, length=64).startswith(fingerprint(g1))


@FAST
@given(recipes(), st.data())
def test_labels_costs_and_metadata_do_not_change_the_fingerprint(recipe: Recipe, data: st.DataObject) -> None:
    g = build(recipe)
    renamed = replace(
        g,
        ops=tuple(
            replace(op, name=op.name + "'", flops=op.flops + 1, vector_flops=7, bytes_read=3, bytes_written=5)
            for op in g.ops
        ),
        tensors=tuple(replace(t, name="x" + t.name) for t in g.tensors),
        meta=GraphMeta(model="other", source="capture", optimizer="AdamW", capture_s=1.5),
    )
    assert check(renamed) == []
    assert fingerprint(renamed) == fingerprint(g)


@FAST
@given(recipes(), st.data())
def test_any_single_mutation_changes_the_fingerprint(recipe: Recipe, data: st.DataObject) -> None:
    g = build(recipe)
    name, mutated = _mutate_anything(g, data)
    assert mutated != g, name
    assert fingerprint(mutated) != fingerprint(g), name


@FAST
@given(recipes(), st.data())
def test_graph_outputs_are_in_the_fingerprint(recipe: Recipe, data: st.DataObject) -> None:
    g = build(recipe)
    extra = data.draw(st.sampled_from([t.id for t in g.tensors if t.id not in g.outputs]))
    assert fingerprint(replace(g, outputs=(*g.outputs, extra))) != fingerprint(g)


@FAST
@given(recipes(), st.data())
def test_shape_and_dtype_changes_change_the_fingerprint(recipe: Recipe, data: st.DataObject) -> None:
    g = build(recipe)
    tid = data.draw(st.integers(0, len(g.tensors) - 1))
    muts = _tensor_mutations(g, tid, data)
    assert fingerprint(muts["shape"]()) != fingerprint(g)
    assert fingerprint(muts["dtype"]()) != fingerprint(g)


@FAST
@given(recipes(), st.data())
def test_reading_a_later_value_is_a_cycle(recipe: Recipe, data: st.DataObject) -> None:
    g = build(recipe)
    mutated = _rewire_to_later(g, data)
    assert "acyclic" in _rules(mutated)
    assert fingerprint(mutated) != fingerprint(g)


@FAST
@given(recipes(), st.data())
def test_unlinked_backward_op_is_caught(recipe: Recipe, data: st.DataObject) -> None:
    g = build(recipe)
    mutated = _drop_forward_link(g, data)
    assert _rules(mutated) == {"backward_links"}
    assert fingerprint(mutated) != fingerprint(g)


@FAST
@given(recipes(force_mm=True), st.data())
def test_broken_matmul_shapes_are_caught(recipe: Recipe, data: st.DataObject) -> None:
    g = build(recipe)
    mm = data.draw(st.sampled_from([op for op in g.ops if op.target == "aten.mm.default"]), label="mm")
    tid = data.draw(st.sampled_from([*mm.inputs, *mm.outputs]), label="tensor")
    t = g.tensors[tid]
    bump = data.draw(st.integers(0, 1), label="dim")
    shape = tuple(d + 1 if i == bump else d for i, d in enumerate(t.shape))
    mutated = _with_tensor(g, tid, shape=shape)
    assert "shapes" in _rules(mutated)
    assert fingerprint(mutated) != fingerprint(g)


# Graphs built from model specs ---------------------------------------------------------------------


@SPECS
@given(spec_graphs())
def test_spec_graphs_are_valid(args: tuple[ModelSpec, int, int]) -> None:
    spec, batch, seq = args
    g = build_graph(spec, batch, seq)
    assert check(g) == []
    assert g.blocks == tuple(range(spec.n_layers))
    assert relink(g.ops, g.tensors, g.meta, g.outputs) == g
    names = [t.param_name for t in g.parameters]
    assert len(names) == len(set(names))
    updated = [t for t in g.tensors_with(TensorRole.PARAMETER) if t.updates is not None]
    assert len(updated) == len(names)
    assert not {t.id for t in updated} & {t.id for t in g.parameters}
    assert g.activation_bytes > 0


@SPECS
@given(spec_graphs())
def test_spec_fingerprint_is_deterministic(args: tuple[ModelSpec, int, int]) -> None:
    spec, batch, seq = args
    g1, g2 = build_graph(spec, batch, seq), build_graph(spec, batch, seq)
    assert fingerprint(g1) == fingerprint(g2)
    assert fingerprint(build_graph(replace(spec, name="renamed"), batch, seq)) == fingerprint(g1)
    assert fingerprint(build_graph(replace(spec, n_layers=spec.n_layers + 1), batch, seq)) != fingerprint(g1)
    assert fingerprint(build_graph(spec, batch + 1, seq)) != fingerprint(g1)


@SPECS
@given(spec_graphs(), st.data())
def test_spec_mutations(args: tuple[ModelSpec, int, int], data: st.DataObject) -> None:
    spec, batch, seq = args
    g = build_graph(spec, batch, seq)
    fp = fingerprint(g)
    name, mutated = _mutate_anything(g, data)
    assert fingerprint(mutated) != fp, name
    mutated = _rewire_to_later(g, data)
    assert "acyclic" in _rules(mutated)
    assert fingerprint(mutated) != fp
    mutated = _drop_forward_link(g, data)
    assert _rules(mutated) == {"backward_links"}
    assert fingerprint(mutated) != fp


@SPECS
@given(spec_graphs(min_layers=2), st.data())
def test_a_block_differing_from_block_0_is_caught(
    args: tuple[ModelSpec, int, int], data: st.DataObject
) -> None:
    spec, batch, seq = args
    g = build_graph(spec, batch, seq)
    b = data.draw(st.integers(1, spec.n_layers - 1), label="block")
    op = data.draw(st.sampled_from(g.block_ops(b)), label="op")
    how = data.draw(st.sampled_from(["target", "module_path", "drop"]), label="how")
    if how == "target":
        mutated = _with_op(g, op.id, target=op.target + "_x")
    elif how == "module_path":
        mutated = _with_op(g, op.id, module_path=op.module_path + ".x")
    else:  # the op leaves the block
        mutated = _with_op(g, op.id, block=None)
    assert "blocks" in _rules(mutated)
    assert fingerprint(mutated) != fingerprint(g)


# Across processes ----------------------------------------------------------------------------------


def test_fingerprint_is_identical_across_processes() -> None:
    code = (
        "from coplan.capture.synthetic import build_graph\n"
        "from coplan.ir.fingerprint import fingerprint\n"
        "from coplan.models.spec import PRESETS\n"
        "print(fingerprint(build_graph(PRESETS['gpt-tiny'], 2, 32)))\n"
    )
    here = fingerprint(build_graph(PRESETS["gpt-tiny"], 2, 32))
    env = {**os.environ, "PYTHONHASHSEED": "12345"}  # string hashing differs from this process
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120, check=True
    )
    assert out.stdout.strip() == here


# Regressions of bugs found by these properties -------------------------------------------------


def test_moe_with_bias_builds() -> None:
    spec = ModelSpec(n_layers=1, d_model=8, n_heads=2, vocab_size=16, seq_len=8, n_experts=2, bias=True)
    g = build_graph(spec, 1, 4)
    assert check(g) == []
    assert g.param_count == spec.param_count()


def test_layernorm_without_bias_param_count() -> None:
    spec = ModelSpec(n_layers=2, d_model=8, n_heads=2, vocab_size=16, seq_len=8, bias=False)
    assert build_graph(spec, 1, 4).param_count == spec.param_count()
