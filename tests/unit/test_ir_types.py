"""IR value types: sizes, construction-time validation, ``relink`` and the derived views of a graph."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from coplan.errors import GraphError
from coplan.ir.checker import check, validate
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
    dtype_bytes,
    relink,
)

F32 = "float32"
META = GraphMeta()


def _t(
    tid: int, shape: tuple[int, ...], role: TensorRole = TensorRole.ACTIVATION, dtype: str = F32, **kw: Any
) -> Tensor:
    return Tensor(id=tid, name=f"t{tid}", shape=shape, dtype=dtype, role=role, **kw)


def _op(
    oid: int,
    target: str,
    kind: OpKind,
    inputs: tuple[int, ...],
    outputs: tuple[int, ...],
    phase: Phase = Phase.FORWARD,
    **kw: Any,
) -> Op:
    return Op(
        id=oid, name=f"op{oid}", target=target, kind=kind, inputs=inputs, outputs=outputs, phase=phase, **kw
    )


# Tensor --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shape", "dtype", "numel", "nbytes"),
    [
        ((2, 3), "float32", 6, 24),
        ((2, 3), "float64", 6, 48),
        ((4, 5), "bfloat16", 20, 40),
        ((7,), "float16", 7, 14),
        ((3, 3), "float8_e4m3fn", 9, 9),
        ((2, 2, 2), "int64", 8, 64),
        ((5,), "int32", 5, 20),
        ((10,), "bool", 10, 10),
        ((3,), "complex64", 3, 24),
        ((), "float32", 1, 4),  # a scalar has one element
        ((0, 5), "float32", 0, 0),  # an empty tensor has none
    ],
)
def test_tensor_numel_and_nbytes(shape: tuple[int, ...], dtype: str, numel: int, nbytes: int) -> None:
    t = _t(0, shape, dtype=dtype)
    assert t.numel == numel
    assert t.nbytes == nbytes
    assert t.nbytes == t.numel * DTYPE_BYTES[dtype]


def test_dtype_bytes() -> None:
    assert dtype_bytes("bfloat16") == 2
    assert dtype_bytes("tf32") == 4
    with pytest.raises(GraphError, match="unknown dtype 'float128'"):
        dtype_bytes("float128")


@pytest.mark.parametrize("shape", [(-1,), (2, -3), (0, 4, -1)])
def test_tensor_rejects_negative_dims(shape: tuple[int, ...]) -> None:
    with pytest.raises(GraphError, match="negative dimension"):
        _t(0, shape)


def test_tensor_rejects_unknown_dtype() -> None:
    with pytest.raises(GraphError, match="unknown dtype"):
        _t(0, (2,), dtype="float128")


def test_tensor_rejects_aliasing_itself() -> None:
    with pytest.raises(GraphError, match="aliases itself"):
        _t(3, (2,), alias_of=3)


def test_storage_id_is_the_alias_root() -> None:
    assert _t(0, (4,)).storage_id == 0
    assert _t(5, (4,), alias_of=2).storage_id == 2


def test_tensor_is_frozen() -> None:
    t = _t(0, (2,))
    with pytest.raises(AttributeError):
        t.shape = (3,)  # type: ignore[misc]


# Op ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cost", ["flops", "vector_flops", "bytes_read", "bytes_written"])
def test_op_rejects_negative_costs(cost: str) -> None:
    with pytest.raises(GraphError, match="negative cost"):
        _op(0, "aten.add.Tensor", OpKind.ELEMENTWISE, (0,), (1,), Phase.FORWARD, **{cost: -1})


def test_op_accepts_zero_and_positive_costs() -> None:
    op = _op(
        0,
        "aten.mm.default",
        OpKind.MATMUL,
        (0, 1),
        (2,),
        flops=0,
        vector_flops=3,
        bytes_read=8,
        bytes_written=4,
    )
    assert (op.flops, op.vector_flops, op.bytes_read, op.bytes_written) == (0, 3, 8, 4)


@pytest.mark.parametrize("phase", [Phase.FORWARD, Phase.OPTIMIZER])
def test_forward_op_only_on_backward_ops(phase: Phase) -> None:
    with pytest.raises(GraphError, match="only backward ops link to a forward op"):
        _op(1, "aten.mul.Tensor", OpKind.ELEMENTWISE, (0,), (1,), phase=phase, forward_op=0)


def test_backward_op_may_link_to_forward_op() -> None:
    op = _op(1, "aten.mul.Tensor", OpKind.ELEMENTWISE, (0,), (1,), phase=Phase.BACKWARD, forward_op=0)
    assert op.forward_op == 0


# Graph ---------------------------------------------------------------------------------------------


def _chain() -> Graph:
    """x (input) -> relu -> a; a + x -> b."""
    tensors = [_t(0, (2, 3), TensorRole.INPUT), _t(1, (2, 3)), _t(2, (2, 3))]
    ops = [
        _op(0, "aten.relu.default", OpKind.ELEMENTWISE, (0,), (1,)),
        _op(1, "aten.add.Tensor", OpKind.ELEMENTWISE, (1, 0), (2,)),
    ]
    return relink(ops, tensors, META, (2,))


def test_graph_rejects_op_id_out_of_place() -> None:
    g = _chain()
    with pytest.raises(GraphError, match="id 1 at position 0"):
        Graph(ops=(g.ops[1], g.ops[0]), tensors=g.tensors)
    with pytest.raises(GraphError, match="id 5 at position 1"):
        Graph(ops=(g.ops[0], replace(g.ops[1], id=5)), tensors=g.tensors)


def test_graph_rejects_tensor_id_out_of_place() -> None:
    g = _chain()
    with pytest.raises(GraphError, match="id 2 at position 1"):
        Graph(ops=g.ops, tensors=(g.tensors[0], g.tensors[2], g.tensors[1]))


@pytest.mark.parametrize("bad", [3, -1, 100])
def test_graph_rejects_bad_outputs(bad: int) -> None:
    g = _chain()
    with pytest.raises(GraphError, match=f"graph output {bad} is not a tensor"):
        Graph(ops=g.ops, tensors=g.tensors, outputs=(2, bad))
    with pytest.raises(GraphError):
        relink(g.ops, g.tensors, META, (bad,))


def test_relink_recomputes_producer_and_consumers() -> None:
    tensors = [
        _t(0, (2, 3), TensorRole.INPUT, producer=7, consumers=(9,)),  # stale links are overwritten
        _t(1, (2, 3), producer=None, consumers=()),
        _t(2, (2, 3), producer=0, consumers=(0, 1)),
        _t(3, (2, 3)),  # never read
    ]
    ops = [
        _op(0, "aten.relu.default", OpKind.ELEMENTWISE, (0,), (1,)),
        _op(1, "aten.mul.Tensor", OpKind.ELEMENTWISE, (1, 1), (2,)),  # reads the same tensor twice
        _op(2, "aten.add.Tensor", OpKind.ELEMENTWISE, (0, 2), (3,)),
    ]
    g = relink(ops, tensors, META, (3,))
    assert [(t.producer, t.consumers) for t in g.tensors] == [
        (None, (0, 2)),
        (0, (1,)),  # listed once although op 1 reads it twice
        (1, (2,)),
        (2, ()),
    ]
    assert g.outputs == (3,)
    assert g.meta is META
    assert check(g) == []
    # Everything else about the tensors is kept.
    assert [replace(t, producer=None, consumers=()) for t in g.tensors] == [
        replace(t, producer=None, consumers=()) for t in tensors
    ]


def test_relink_is_idempotent() -> None:
    g = _chain()
    assert relink(g.ops, g.tensors, g.meta, g.outputs) == g


def test_stale_links_without_relink_are_caught() -> None:
    g = _chain()
    stale = replace(g, tensors=(replace(g.tensors[0], consumers=()), *g.tensors[1:]))
    assert {v.rule for v in check(stale)} == {"edges"}
    with pytest.raises(GraphError, match=r"\[edges\]"):
        validate(stale)
    assert validate(g) is g


def test_check_rejects_unknown_rule_names() -> None:
    with pytest.raises(ValueError, match="unknown checker rules"):
        check(_chain(), skip=["no_such_rule"])
    stale = replace(_chain(), tensors=(replace(_chain().tensors[0], consumers=()), *_chain().tensors[1:]))
    assert check(stale, skip=["edges"]) == []


# activation_bytes ----------------------------------------------------------------------------------


def _view_graph(backward_reads: tuple[int, ...], view_shape: tuple[int, ...] = (8, 4)) -> Graph:
    """x (input, 4x8) -> relu -> a (4x8); a -> view v (aliases a); a backward op reads ``backward_reads``.

    Tensors: 0 x, 1 a, 2 v, 3 grad (the backward op's output), 4 w (a parameter read by backward).
    """
    tensors = [
        _t(0, (4, 8), TensorRole.INPUT),
        _t(1, (4, 8)),
        _t(2, view_shape, alias_of=1),
        _t(3, (4, 8), TensorRole.GRADIENT),
        _t(4, (4, 8), TensorRole.PARAMETER, param_name="w"),
    ]
    ops = [
        _op(0, "aten.relu.default", OpKind.ELEMENTWISE, (0,), (1,)),
        _op(1, "aten.view.default", OpKind.VIEW, (1,), (2,), args=str(view_shape)),
        _op(2, "relu_backward", OpKind.ELEMENTWISE, backward_reads, (3,), phase=Phase.BACKWARD, forward_op=0),
    ]
    g = relink(ops, tensors, META)
    return mark_saved(g, (3,))


def test_activation_bytes_counts_a_saved_views_base_once() -> None:
    g = _view_graph(backward_reads=(1, 2))
    assert check(g) == []
    assert [t.id for t in g.saved_tensors()] == [1, 2]
    assert g.activation_bytes == g.tensors[1].nbytes == 4 * 8 * 4


def test_activation_bytes_of_a_saved_slice_is_its_whole_base() -> None:
    g = _view_graph(backward_reads=(2,), view_shape=(2, 8))
    assert check(g) == []
    assert [t.id for t in g.saved_tensors()] == [2]
    assert g.tensors[2].nbytes == 64
    assert g.activation_bytes == g.tensors[1].nbytes == 128


def test_activation_bytes_exclude_inputs_and_parameters() -> None:
    g = _view_graph(backward_reads=(0, 4))
    assert check(g) == []
    assert {t.id for t in g.saved_tensors()} == {0, 4}  # saved, but they live in memory anyway
    assert g.activation_bytes == 0
    g = _view_graph(backward_reads=(0, 2, 4))
    assert g.activation_bytes == 128


def test_mark_saved_flags_only_values_read_by_backward() -> None:
    g = _view_graph(backward_reads=(1,))
    assert [t.saved_for_backward for t in g.tensors] == [False, True, False, False, False]
    assert g.outputs == (3,)


# parameters ----------------------------------------------------------------------------------------


def _sgd_graph() -> Graph:
    """y = x @ w; backward gives dw; the optimizer writes w' (an update of w, sharing its storage)."""
    tensors = [
        _t(0, (2, 3), TensorRole.INPUT),
        _t(1, (3, 4), TensorRole.PARAMETER, param_name="w"),
        _t(2, (2, 4)),
        _t(3, (2, 4), TensorRole.GRADIENT),
        _t(4, (3, 4), TensorRole.GRADIENT, grad_of=1),
        _t(5, (3, 4), TensorRole.PARAMETER, alias_of=1, updates=1, param_name="w"),
        _t(6, (4,), TensorRole.BUFFER, param_name="b"),
    ]
    ops = [
        _op(0, "aten.mm.default", OpKind.MATMUL, (0, 1), (2,), flops=2 * 2 * 3 * 4),
        _op(1, "aten.add.Tensor", OpKind.ELEMENTWISE, (2, 6), (3,), phase=Phase.BACKWARD, forward_op=0),
        _op(
            2,
            "mm_weight_grad",
            OpKind.MATMUL,
            (0, 3),
            (4,),
            phase=Phase.BACKWARD,
            forward_op=0,
            flops=2 * 2 * 3 * 4,
        ),
        _op(3, "sgd", OpKind.OPTIMIZER, (1, 4), (5,), phase=Phase.OPTIMIZER, vector_flops=24),
    ]
    return mark_saved(relink(ops, tensors, META), (2, 5))


def test_parameters_exclude_updated_versions() -> None:
    g = _sgd_graph()
    assert check(g) == []
    assert [t.id for t in g.tensors_with(TensorRole.PARAMETER)] == [1, 5]
    assert [t.id for t in g.parameters] == [1]
    assert g.param_count == 12
    assert g.tensors[5].producer == 3


def test_graph_views() -> None:
    g = _sgd_graph()
    assert g.flops == 96
    assert g.flops_by_phase() == {Phase.FORWARD: 48, Phase.BACKWARD: 48, Phase.OPTIMIZER: 0}
    assert [op.id for op in g.ops_in(Phase.BACKWARD)] == [1, 2]
    assert g.producer(5) is g.ops[3]
    assert g.producer(g.tensors[0]) is None
    assert [t.id for t in g.input_tensors(g.ops[3])] == [1, 4]
    assert [t.id for t in g.output_tensors(g.ops[0])] == [2]
    assert g.blocks == ()
    blocked = replace(g, ops=tuple(replace(op, block=op.id % 2) for op in g.ops))
    assert blocked.blocks == (0, 1)
    assert [op.id for op in blocked.block_ops(1)] == [1, 3]


# --- dropout in the synthetic IR -----------------------------------------------------------------


def _gpt(**kw: Any) -> Any:
    from coplan.models.spec import ModelSpec

    return ModelSpec(name="d", n_layers=2, d_model=64, n_heads=4, vocab_size=128, seq_len=32, **kw)


def test_zero_dropout_builds_the_same_graph() -> None:
    from coplan.capture.synthetic import build_graph
    from coplan.ir.fingerprint import fingerprint

    plain = build_graph(_gpt(), 2, 32)
    zero = build_graph(_gpt(hidden_dropout=0.0, attention_dropout=0.0), 2, 32)
    assert fingerprint(plain) == fingerprint(zero)
    assert not any(op.target.startswith("dropout") for op in plain.ops)


def test_dropout_keeps_one_byte_masks_and_the_attention_rng_state() -> None:
    from coplan.capture.synthetic import build_graph

    b, s, d, layers = 2, 32, 64, 2
    plain = build_graph(_gpt(), b, s)
    drop = build_graph(_gpt(hidden_dropout=0.1, attention_dropout=0.1), b, s)
    assert check(drop) == []
    # dropout adds no matrix FLOPs and no parameters
    assert drop.flops == plain.flops and drop.param_count == plain.param_count
    masks = [t for t in drop.tensors if t.dtype == "bool"]
    assert len(masks) == 1 + 2 * layers  # embedding, and after attention and MLP in each block
    assert all(t.saved_for_backward and t.nbytes == b * s * d for t in masks)
    rng = [t for t in drop.tensors if t.name.endswith("rng_state")]
    assert len(rng) == layers and all(t.saved_for_backward and t.nbytes == 16 for t in rng)
    # saved bytes: the masks and the rng states; the dropped values replace the pre-dropout ones
    assert drop.activation_bytes - plain.activation_bytes == (1 + 2 * layers) * b * s * d + 16 * layers
    assert {op.args for op in drop.ops if op.target == "dropout"} == {"p=0.1"}
    bwd = [op for op in drop.ops if op.target == "dropout_bwd"]
    assert len(bwd) == 1 + 2 * layers and all(op.forward_op is not None for op in bwd)


def test_attention_dropout_probability_is_read_from_synthetic_and_captured_args() -> None:
    from coplan.capture.synthetic import build_graph
    from coplan.ir.oprules import attention_dropout

    g = build_graph(_gpt(attention_dropout=0.25), 1, 32)
    attn = next(op for op in g.ops if op.kind is OpKind.ATTENTION and op.phase is Phase.FORWARD)
    assert attention_dropout(attn) == 0.25
    captured = replace(
        attn, target="aten._scaled_dot_product_flash_attention.default", args="%,%,%,0.1,True;"
    )
    assert attention_dropout(captured) == 0.1
    assert attention_dropout(replace(attn, args="")) == 0.0


def test_spec_rejects_dropout_outside_zero_one() -> None:
    from coplan.errors import SpecError

    with pytest.raises(SpecError, match="hidden_dropout"):
        _gpt(hidden_dropout=1.0)
    with pytest.raises(SpecError, match="attention_dropout"):
        _gpt(attention_dropout=-0.1)
