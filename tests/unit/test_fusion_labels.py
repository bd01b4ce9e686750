"""Backward GEMMs labelled with the one IR gradient op they compute, single process on a CPU.

Both backward matmuls of a linear carry its forward op's autograd sequence number; the labeller
tells the input gradient (``gy @ w``, shaped like the linear's input) from the weight gradient
(``gy.T @ x``, shaped like the weight). The graphs are labelled and run eagerly (no Inductor
compile), as in ``test_apply_llama.test_every_plan_op_labels_a_node_of_its_graph``.
"""

from __future__ import annotations

import pytest
import torch
from apply_steps import spied_step
from torch import fx

from coplan.apply import fusion
from coplan.apply.predict import make_context, plan_for
from coplan.hardware import load_cluster
from coplan.ir.types import Graph, Phase
from coplan.models.spec import PRESETS

_MATMULS = (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm)
_GEMM_GRADS = ("linear_bwd_input", "linear_bwd_weight")


def _backward_graph(model: str, batch: int, seq: int) -> tuple[fx.GraphModule, Graph]:
    """(the labelled backward graph, the plan's IR) of one step of ``model`` under its greedy
    bf16 plan for ``batch`` x ``seq``."""
    from coplan.search.space import fusion_option

    spec = PRESETS[model]
    ctx = make_context(spec, load_cluster("cpu"), batch, seq)
    plan = plan_for(ctx, compute="bf16").with_(fusion=fusion_option(ctx, "greedy"))
    graphs: dict[str, fx.GraphModule] = {}
    be = spied_step(spec, plan, batch, seq, lambda gm, phase: graphs.__setitem__(phase, gm))
    return graphs["backward"], be.ir


def _gemm_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and fusion._packet(n.target) in _MATMULS]


def _block0_linears(ir: Graph) -> dict[str, tuple[str, str, tuple[int, ...]]]:
    """Module path of every linear of block 0 -> (its input-gradient op, its weight-gradient op,
    the weight's shape)."""
    out: dict[str, tuple[str, str, tuple[int, ...]]] = {}
    for op in ir.ops:
        if op.phase is Phase.FORWARD and op.target == "linear" and op.block == 0:
            grads = {b.target: b for b in ir.ops if b.forward_op == op.id and b.target in _GEMM_GRADS}
            weight = ir.tensors[op.inputs[1]].shape
            out[op.module_path] = (grads[_GEMM_GRADS[0]].name, grads[_GEMM_GRADS[1]].name, weight)
    return out


def _reaches_output(node: fx.Node) -> bool:
    """Whether ``node``'s value is returned by its graph through views and casts only (a
    parameter's gradient is; an activation's flows on into the next op's backward)."""
    todo, seen = [node], set()
    while todo:
        n = todo.pop()
        for user in n.users:
            if user.op == "output":
                return True
            if user not in seen and fusion._packet(user.target) in fusion._PASS_THROUGH:
                seen.add(user)
                todo.append(user)
    return False


@pytest.mark.parametrize("model", ["gpt-tiny", "llama-tiny"])
def test_backward_gemms_carry_their_own_gradient_op(model):
    """At 24 tokens (no width of either model) the shapes name the GEMMs: for every linear of
    block 0 the input-gradient op labels the one node shaped like its input (tokens x in), the
    weight-gradient op the one shaped like its weight; every backward GEMM carries one label."""
    batch, seq = 2, 12
    gm, ir = _backward_graph(model, batch, seq)
    nodes = _gemm_nodes(gm)
    by_name = {op.name: op for op in ir.ops}
    for n in nodes:
        gemm = [m for m in fusion._marks(n) if by_name[m].target in _GEMM_GRADS]
        assert len(gemm) == 1, (n.name, sorted(fusion._marks(n)))
    linears = _block0_linears(ir)
    assert len(linears) == (4 if model == "gpt-tiny" else 5)
    for module, (grad_in, grad_w, (n_out, n_in)) in linears.items():
        inputs = [n for n in nodes if grad_in in fusion._marks(n)]
        weights = [n for n in nodes if grad_w in fusion._marks(n)]
        assert [tuple(n.meta["val"].shape) for n in inputs] == [(batch * seq, n_in)], module
        assert [tuple(n.meta["val"].shape) for n in weights] == [(n_out, n_in)], module


def test_square_backward_gemms_are_told_apart_by_their_operands():
    """gpt-tiny at 64 tokens: the attention's output projection is 64 x 64 and so are both of its
    gradients, so only the operands tell them apart. The weight-gradient label goes to the GEMM
    whose value the graph returns (a parameter's gradient), the input-gradient label to the other."""
    gm, ir = _backward_graph("gpt-tiny", 2, 32)
    nodes = _gemm_nodes(gm)
    square = 0
    for module, (grad_in, grad_w, _) in _block0_linears(ir).items():
        (inp,) = [n for n in nodes if grad_in in fusion._marks(n)]
        (wgt,) = [n for n in nodes if grad_w in fusion._marks(n)]
        assert inp is not wgt, module
        assert _reaches_output(wgt) and not _reaches_output(inp), module
        square += inp.meta["val"].shape == wgt.meta["val"].shape
    assert square >= 2  # attn.c_proj (64 x 64) and mlp.c_proj (64 x 256 both ways)
