"""Compiling the partitioned graphs: eager kernels, or Inductor constrained to the plan's groups.

A plan without fusion groups is eager execution (one kernel per op, what an unfused plan prices):
the FX graph runs op by op. A plan with groups is compiled by Inductor (``compile_fx_inner``, the
entry Inductor itself uses for each half of a partitioned graph), whose scheduler asks, for every
pair of nodes it considers fusing, whether the plan allows it
(``torch._inductor.choices.InductorChoices.can_fuse``). The rule: two scheduler nodes may fuse only
when every plan op they implement lies in one plan group (an op in no group stays alone); a node
that implements no plan op (a view, a cast, the index arithmetic of a loss) is free to fuse with
anything, because the IR gives it no kernel of its own.

Which plan op an FX node implements: forward nodes are matched to the IR's forward ops as the
partitioner matches them (module path, op family, order: ``names``): an anchor node, or for a
module-level op with no anchor (RoPE, a decomposed RMSNorm: ``names.COMPOSITES``) every node of its
module. Backward nodes carry the autograd sequence number of the forward node they differentiate
(``meta["seq_nr"]``), which leads to that op's backward ops in the IR: an anchor's narrowed by the
aten op's family (``gelu_backward`` is the IR's ``gelu_bwd``; an ``mm`` is one of the linear's two
gradient GEMMs, told apart by the axis along which it contracts the output gradient: its features
for the input gradient, its tokens for the weight gradient; ``_gemm_gradient``), a module-level
op's taking every node of its nodes' backward. Gradient
accumulation (an ``add`` of two gradients of one tensor) carries no usable sequence number (the
engine records it under the loss's); it is read from what it sums: gradients of one op are that
op's own (RoPE's two uses of its input), gradients from different ops are the IR's backward ``add``
of the op they lead to.

After fusion the final kernels are read back (Inductor's ``_post_fusion_custom_pass``), and a
planned group is *honoured* when the ops of it that this graph implements share one kernel with no
plan op from outside the group. A group fusing a GEMM with pointwise work is honoured only where
Inductor generates the GEMM itself; as a library call (the default) it is reported not honoured.
The optimizer is not compiled: its groups are honoured when the runner uses the fused AdamW kernel
(``fused_optimizer``). Inductor's FX-graph cache is off while compiling so that every graph is
scheduled under its plan's rule (a cached kernel could come from another plan's compilation).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from contextlib import nullcontext
from dataclasses import replace
from operator import getitem
from typing import Any

import torch
from torch import fx

from coplan.apply.names import (
    ATEN_ANCHORS,
    COMPOSITES,
    _composites,
    _forward_ops,
    _match,
    block_prefix,
    relative_to_block,
)
from coplan.fusion_log import refusals
from coplan.ir.types import Graph, Op, Phase
from coplan.plan.types import Plan

aten = torch.ops.aten

#: IR backward op target -> the aten ops (packets) of the backward graph that compute it
_BWD_FAMILIES: dict[str, tuple[object, ...]] = {
    "linear_bwd_input": (aten.mm, aten.bmm),
    "linear_bwd_weight": (aten.mm, aten.bmm, aten.sum),
    "gelu_bwd": (aten.gelu_backward,),
    "silu_bwd": (aten.silu_backward,),
    "mul_bwd": (aten.mul,),
    "norm_bwd": (aten.native_layer_norm_backward, aten._fused_rms_norm_backward),
    "attention_bwd": (
        aten._scaled_dot_product_flash_attention_for_cpu_backward,
        aten._scaled_dot_product_flash_attention_backward,
        aten._scaled_dot_product_efficient_attention_backward,
        aten._scaled_dot_product_cudnn_attention_backward,
    ),
    "embedding_bwd": (aten.embedding_dense_backward,),
    "log_softmax_bwd": (aten._log_softmax_backward_data,),
    "nll_loss_bwd": (aten.nll_loss_backward,),
    "add": (aten.add,),
}

_GEMMS = frozenset({"linear", "linear_bwd_input", "linear_bwd_weight"})
META = "coplan_ops"  # key in node.meta["custom"]: the plan ops (names) an FX node implements


def _is_forward(node: fx.Node) -> bool:
    return node.meta.get("partitioner_tag") != "is_backward"


def _mark(node: fx.Node, names: frozenset[str]) -> None:
    # kept in meta["custom"], which FX copies onto the nodes a decomposition makes of this one
    node.meta["custom"] = {**(node.meta.get("custom") or {}), META: sorted(names)}


def _marks(node: Any) -> frozenset[str]:
    custom = getattr(node, "meta", {}).get("custom") or {}
    return frozenset(custom.get(META, ()))


def _packet(target: object) -> object:
    return getattr(target, "overloadpacket", target)


def _op_nodes(ops: Sequence[Op], nodes: Sequence[fx.Node]) -> dict[int, tuple[list[fx.Node], bool]]:
    """IR op id -> (the nodes that implement it, whether it is module-level): an anchor, else
    (RoPE, a decomposed RMSNorm) every call node of its module."""
    anchors = _match(ops, nodes, ATEN_ANCHORS, lambda n: n.target)
    out: dict[int, tuple[list[fx.Node], bool]] = {i: ([n], False) for i, n in anchors.items()}
    rest = [op for op in ops if op.id not in anchors]
    for i, region in _composites(rest, nodes, COMPOSITES, outputs=False).items():
        out[i] = ([n for n in region if n.op == "call_function"], True)
    return out


def label_forward(gm: fx.GraphModule, ir: Graph) -> dict[int, int]:
    """Mark every forward node that implements an IR op (an anchor, or every node of a
    module-level op); returns {autograd seq_nr: IR op id} for the backward graph of the same region.

    A sequence number is handed to an op only when it names that op's nodes alone: RoPE's slices
    share theirs with the attention's transpose before them, whose gradient is not RoPE's; an op
    without backward ops (``arange``) gives way to one with them (the embedding sharing its number).
    """
    ops = _forward_ops(ir)
    nodes = list(gm.graph.nodes)
    found = _op_nodes(ops, nodes)
    if not found:  # a region traced from a block's own forward (FSDP2): names relative to it
        found = _op_nodes(relative_to_block(ops, block_prefix(ir)), nodes)
    has_bwd = {op.forward_op for op in ir.ops if op.phase is Phase.BACKWARD}
    where: dict[fx.Node, int] = {}
    for op_id, (op_nodes, _) in found.items():
        _mark_all(op_nodes, frozenset({ir.ops[op_id].name}))
        where.update((n, op_id) for n in op_nodes)
    others: set[int] = set()  # numbers of call nodes that implement no op
    for n in nodes:
        nr = n.meta.get("seq_nr")
        if isinstance(nr, int) and n.op == "call_function" and n not in where and n.target is not getitem:
            others.add(nr)
    claims: dict[int, set[int]] = {}
    for op_id, (op_nodes, composite) in found.items():
        for n in op_nodes:
            nr = n.meta.get("seq_nr")
            if isinstance(nr, int) and op_id in has_bwd and not (composite and nr in others):
                claims.setdefault(nr, set()).add(op_id)
    return {nr: next(iter(ids)) for nr, ids in claims.items() if len(ids) == 1}


def _mark_all(nodes: Iterable[fx.Node], names: frozenset[str]) -> None:
    for n in nodes:
        _mark(n, names)


#: ops that move or retype a value without computing one: a gradient is traced back through them
_PASS_THROUGH = frozenset(
    {
        aten.view,
        aten._unsafe_view,
        aten.reshape,
        aten.t,
        aten.transpose,
        aten.permute,
        aten.expand,
        aten.squeeze,
        aten.unsqueeze,
        aten.slice,
        aten.clone,
        aten.alias,
        aten.detach,
        aten._to_copy,
        torch.ops.prims.convert_element_type,
        getitem,
    }
)


def _source_marks(node: Any, depth: int = 8) -> frozenset[str]:
    """The plan ops of the node that computed ``node``'s value (through views and casts)."""
    while isinstance(node, fx.Node) and depth > 0:
        marks = _marks(node)
        if marks or _packet(node.target) not in _PASS_THROUGH or not node.args:
            return marks
        node, depth = node.args[0], depth - 1
    return frozenset()


def label_backward(gm: fx.GraphModule, ir: Graph, seq: dict[int, int]) -> None:
    """Mark backward nodes with the IR backward ops they compute (see the module docstring)."""
    bwd: dict[int, list[Op]] = {}
    for op in ir.ops:
        if op.phase is Phase.BACKWARD and op.forward_op is not None:
            bwd.setdefault(op.forward_op, []).append(op)
    # a forward op with several sequence numbers was module-level: all its backward is its own
    numbers: dict[int, int] = {}
    for op_id in seq.values():
        numbers[op_id] = numbers.get(op_id, 0) + 1
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and not _is_forward(n)]
    tangent = _from_tangents(gm)
    for node in nodes:
        fwd = seq.get(node.meta.get("seq_nr", -1))
        if fwd is None:
            continue
        own = [op for op in bwd.get(fwd, ()) if op.target != "add"]
        if numbers[fwd] > 1:
            names = frozenset(op.name for op in own)
        else:
            pkt = _packet(node.target)
            ops = [op for op in bwd.get(fwd, ()) if pkt in _BWD_FAMILIES.get(op.target, ())]
            if pkt in _MATMULS and len(ops) > 1:
                ops = _gemm_gradient(node, ops, ir, tangent) or ops
            names = frozenset(op.name for op in ops)
        if names:
            _mark(node, names)
    _label_accumulation(nodes, ir, bwd)


_MATMULS = frozenset({aten.mm, aten.addmm, aten.bmm})
_INPUT, _WEIGHT = "_bwd_input", "_bwd_weight"  # suffixes of the IR's two gradient GEMMs of a matmul


def _from_tangents(gm: fx.GraphModule) -> set[fx.Node]:
    """The nodes of a backward graph whose value depends on an incoming gradient (AOTAutograd's
    ``tangents_*`` inputs): a gradient GEMM reads exactly one such operand, the output gradient;
    the other is a forward value (the weight, or the saved or recomputed input)."""
    out: set[fx.Node] = set()
    for n in gm.graph.nodes:
        seed = n.op == "placeholder" and n.name.startswith("tangents")
        if seed or any(a in out for a in n.all_input_nodes):
            out.add(n)
    return out


def _shape(node: Any) -> tuple[int, ...] | None:
    val = getattr(node, "meta", {}).get("val")
    shape = getattr(val, "shape", None)
    try:
        return None if shape is None else tuple(int(d) for d in shape)
    except (TypeError, ValueError):  # symbolic sizes
        return None


def _feature_axis(node: fx.Node, depth: int = 16) -> int | None:
    """Which axis of ``node`` holds the last axis (the features) of the value it views: traced
    back through views, casts and transposes to the node that computed it; None when a view
    reshapes that axis or the chain cannot be followed."""
    chain: list[fx.Node] = []
    src: Any = node
    while (
        isinstance(src, fx.Node)
        and src.op == "call_function"
        and src.target is not getitem
        and _packet(src.target) in _PASS_THROUGH
        and src.args
        and len(chain) < depth
    ):
        chain.append(src)
        src = src.args[0]
    shape = _shape(src)
    if not shape:
        return None
    axis = len(shape) - 1
    for n in reversed(chain):
        new, pkt = _shape(n), _packet(n.target)
        if new is None:
            return None
        if pkt in (aten.t, aten.transpose, aten.permute):
            perm = _permutation(n, len(shape))
            if perm is None:
                return None
            axis = perm.index(axis)
        elif new != shape:  # a view or expand: the features stay last only while their size does
            if axis != len(shape) - 1 or not new or new[-1] != shape[-1]:
                return None
            axis = len(new) - 1
        shape = new
    return axis


def _permutation(node: fx.Node, ndim: int) -> list[int] | None:
    """The axes of a ``t``, ``transpose`` or ``permute`` node's input, in its output's order."""
    pkt = _packet(node.target)
    if pkt is aten.permute:
        dims = node.args[1] if len(node.args) > 1 else None
        if not isinstance(dims, (list, tuple)):
            return None
        ints = [d for d in dims if isinstance(d, int)]
        return [d % ndim for d in ints] if len(ints) == len(dims) == ndim else None
    if ndim < 2:
        return list(range(ndim))  # t of a vector
    pair = (0, 1) if pkt is aten.t else node.args[1:3]
    if len(pair) != 2 or not all(isinstance(d, int) for d in pair):
        return None
    d0, d1 = (int(d) % ndim for d in pair if isinstance(d, int))
    perm = list(range(ndim))
    perm[d0], perm[d1] = d1, d0
    return perm


def _gemm_gradient(node: fx.Node, ops: Sequence[Op], ir: Graph, tangent: set[fx.Node]) -> list[Op] | None:
    """Which of a matmul's two gradient GEMMs (the IR's ``*_bwd_input``, ``*_bwd_weight``) the
    backward matmul ``node`` computes, or None when that cannot be told.

    For ``y = x @ w.T`` with output gradient ``gy`` (tokens x out): the input gradient ``gy @ w``
    contracts ``gy`` over its features, the weight gradient ``gy.T @ x`` over its tokens. So the
    operand that carries ``gy`` (the one that depends on the tangents) decides, by whether its
    contracted axis is ``gy``'s feature axis, whatever the shapes (square weights, tokens equal
    to a width). Where that operand cannot be followed, the output's shape decides when only
    one of the two fits it: the weight's shape (or its transpose), or the input's (its last axis
    the weight's input width); where the two tests disagree, nothing is decided."""
    inputs = [op for op in ops if op.target.endswith(_INPUT)]
    weights = [op for op in ops if op.target.endswith(_WEIGHT)]
    if len(inputs) != 1 or len(weights) != 1:
        return None
    a, b = node.args[-2:]
    role: str | None = None
    if isinstance(a, fx.Node) and isinstance(b, fx.Node) and (a in tangent) != (b in tangent):
        grad = a if a in tangent else b
        axis, shape = _feature_axis(grad), _shape(grad)
        if axis is not None and shape is not None and len(shape) >= 2:
            contracted = len(shape) - 1 if grad is a else len(shape) - 2
            other = len(shape) - 2 if grad is a else len(shape) - 1
            role = _INPUT if axis == contracted else _WEIGHT if axis == other else None
    left = _shape(a)
    by_shape = _role_by_shape(
        _shape(node), left[-1] if left else None, ir.tensors[weights[0].outputs[0]].shape
    )
    if role is None:
        role = by_shape
    elif by_shape is not None and by_shape != role:
        return None  # the operands and the shape disagree: something unforeseen, keep both
    if role is None:
        return None
    return inputs if role == _INPUT else weights


def _role_by_shape(out: tuple[int, ...] | None, inner: int | None, weight: tuple[int, ...]) -> str | None:
    """``_INPUT`` or ``_WEIGHT`` when only one of them fits a gradient GEMM's output shape and
    contracted size ``inner``: the input gradient (tokens x in) contracts the weight's output
    width, the weight gradient is shaped like the weight (or its transpose)."""
    if not out or len(out) < 2 or len(weight) < 2 or inner is None:
        return None
    n_out, n_in = weight[-2:]
    fits_weight = out[-2:] in ((n_out, n_in), (n_in, n_out))
    fits_input = out[-1] == n_in and inner == n_out
    if fits_weight == fits_input:
        return None
    return _WEIGHT if fits_weight else _INPUT


def _label_accumulation(nodes: Sequence[fx.Node], ir: Graph, bwd: dict[int, list[Op]]) -> None:
    """Mark the unmarked gradient sums (``aten.add`` of two gradients, or ``aten.cat`` of the
    pieces of one, a split's backward) by what they combine: gradients of one op only are that
    op's (its input read twice inside it); gradients of several are the IR's backward ``add`` of
    one of those ops, when exactly one of them has such an op still unclaimed (LLaMA's fused QKV
    output: q and k reach it through RoPE, v from attention, and the IR sums them after RoPE). The
    sums are visited in graph order, so a sum inside an op is marked before the sums that read it."""
    by_name = {op.name: op for op in ir.ops}
    adds = {fwd: [op for op in ops if op.target == "add"] for fwd, ops in bwd.items()}
    claimed: set[str] = {m for n in nodes for m in _marks(n)}
    for node in nodes:
        if _packet(node.target) not in (aten.add, aten.cat) or _marks(node):
            continue
        args = node.args[0] if _packet(node.target) is aten.cat else node.args
        sources = (
            [_source_marks(a) for a in args if isinstance(a, fx.Node)] if isinstance(args, Sequence) else []
        )
        # a gradient already summed by an IR add is no evidence of which op this sum belongs to
        evidence = [frozenset(m for m in src if by_name[m].target != "add") for src in sources]
        fwds = {by_name[m].forward_op for e in evidence for m in e}
        if not fwds or None in fwds:
            continue
        if len(fwds) == 1 and len(evidence) >= 2 and all(evidence):
            _mark(node, frozenset().union(*evidence))  # inside one op's backward
            continue
        cands = [op.name for f in fwds if f is not None for op in adds.get(f, ()) if op.name not in claimed]
        if len(cands) == 1:
            _mark(node, frozenset(cands))
            claimed.add(cands[0])


def expand_groups(plan: Plan, ir: Graph) -> list[tuple[str, ...]]:
    """The plan's groups for every block: a group names ops of its template's reference block and
    applies at the same positions of every block of that template (blocks with the same op
    sequence, as ``plan.context.BlockIndex`` expands them for pricing); groups outside blocks are
    themselves. One entry per fused kernel the plan asks for in a step."""
    return [g for g, _ in expand_groups_from(plan, ir)]


def expand_groups_from(plan: Plan, ir: Graph) -> list[tuple[tuple[str, ...], int]]:
    """``expand_groups`` with, for each kernel, the index of the plan group it comes from."""
    blocks: dict[int, list[Op]] = {}
    for op in ir.ops:
        if op.block is not None:
            blocks.setdefault(op.block, []).append(op)
    where = {op.name: (b, i) for b, ops in blocks.items() for i, op in enumerate(ops)}
    sig = {b: tuple(op.target for op in ops) for b, ops in blocks.items()}
    out: list[tuple[tuple[str, ...], int]] = []
    for j, g in enumerate(plan.fusion.groups):
        refs = {where[n][0] if n in where else None for n in g}
        if refs == {None} or len(refs) > 1:
            out.append((tuple(g), j))
            continue
        ref = next(iter(refs))
        assert ref is not None
        pos = [where[n][1] for n in g]
        out.extend(
            (tuple(ops[i].name for i in pos), j) for b, ops in sorted(blocks.items()) if sig[b] == sig[ref]
        )
    return out


def as_run(plan: Plan, ir: Graph, records: Sequence[dict[str, Any]]) -> Plan | None:
    """``plan`` with the groups a run did not honour left apart: what its compiled step ran, as
    far as a plan can say it (a group counts as run only where every block's copy was honoured:
    the cost model prices a block template once). None where the records' groups are not this
    plan's expansion over ``ir`` (another graph's numbering)."""
    bad = not_honoured(records)
    if not bad:
        return plan
    expanded = expand_groups_from(plan, ir)
    drop: set[int] = set()
    for b in bad:
        i = int(b["group"])
        if i >= len(expanded) or (b["ops"] and tuple(b["ops"]) != expanded[i][0]):
            return None
        drop.add(expanded[i][1])
    kept = tuple(g for j, g in enumerate(plan.fusion.groups) if j not in drop)
    return plan.with_(fusion=replace(plan.fusion, groups=kept))


def _group_of(groups: Sequence[tuple[str, ...]]) -> dict[str, int]:
    return {name: i for i, g in enumerate(groups) for name in g}


def _ops_of(snode: Any) -> frozenset[str]:
    """Plan ops implemented by an Inductor scheduler node (fused or not), from its IR nodes' FX
    origins."""
    out: set[str] = set()
    for n in snode.get_nodes():
        buf = getattr(n, "node", None)
        for origin in getattr(buf, "origins", ()) or ():
            out |= _marks(origin)
    return frozenset(out)


def allowed(ops: Iterable[str], group_of: dict[str, int]) -> bool:
    """True when ``ops`` may share a kernel: all in one plan group (an op in none stays alone)."""
    keys = {group_of.get(o, o) for o in ops}
    return len(keys) <= 1


def honoured(kernels: Sequence[frozenset[str]], groups: Sequence[tuple[str, ...]]) -> dict[str, Any]:
    """Which of the (expanded) planned groups the final kernels of one graph honour, by index
    (groups with no op in this graph are in neither list)."""
    group_of = _group_of(groups)
    ok: list[int] = []
    bad: list[int] = []
    for i, g in enumerate(groups):
        here = {o for k in kernels for o in k} & set(g)
        if not here:
            continue
        good = any(here <= k and all(group_of.get(o) == i for o in k) for k in kernels)
        (ok if good else bad).append(i)
    return {"honoured": ok, "not_honoured": bad}


def compile_graph(
    gm: fx.GraphModule, inputs: Sequence[Any], plan: Plan, ir: Graph, phase: str, seq: dict[int, int]
) -> tuple[Callable[..., Any], dict[str, Any] | None]:
    """(boxed callable, fusion record or None) for one half of a partitioned region. ``seq`` is
    shared by the two halves of a region: the forward fills it, the backward reads it."""
    from functorch.compile import make_boxed_func

    if not plan.fusion.groups:
        return make_boxed_func(gm), None
    if phase == "forward":
        seq.update(label_forward(gm, ir))
    else:
        label_backward(gm, ir, seq)
    groups = expand_groups(plan, ir)
    by_name = {op.name: op for op in ir.ops}
    gemm_epilogues = any(
        by_name[n].target in _GEMMS for g in groups for n in g if n in by_name and len(g) > 1
    )
    return _inductor(gm, inputs, groups, phase, gemm_epilogues)


class _PlanChoices:
    """Inductor's default heuristics, with the plan's rule in front of every fusion."""

    def __init__(self, base: Any, group_of: dict[str, int]) -> None:
        self._base = base
        self._group_of = group_of
        self.vetoed = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._base, name)

    def can_fuse(self, scheduler: Any, node1: Any, node2: Any, shared_data_score: int) -> bool:
        if not allowed(_ops_of(node1) | _ops_of(node2), self._group_of):
            self.vetoed += 1
            return False
        return bool(self._base.can_fuse(scheduler, node1, node2, shared_data_score))


def _inductor(
    gm: fx.GraphModule,
    inputs: Sequence[Any],
    groups: list[tuple[str, ...]],
    phase: str,
    gemm_epilogues: bool = False,
) -> tuple[Callable[..., Any], dict[str, Any]]:
    from torch._inductor import config
    from torch._inductor.choices import InductorChoices
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.virtualized import V

    choices = _PlanChoices(InductorChoices(), _group_of(groups))
    kernels: list[frozenset[str]] = []
    library: list[frozenset[str]] = []  # plan ops of kernels that are library calls (extern)
    member_ops: dict[str, frozenset[str]] = {}

    def read_back(nodes: list[Any]) -> list[Any]:
        kernels.extend(_ops_of(n) for n in nodes)
        library.extend(_ops_of(n) for n in nodes if _is_library(n))
        for n in nodes:
            for m in n.get_nodes():
                member_ops[m.get_name()] = _ops_of(m)
        return nodes

    settings: dict[str, Any] = {
        "fx_graph_cache": False,
        "fx_graph_remote_cache": False,
        "_post_fusion_custom_pass": read_back,
    }
    if gemm_epilogues and any(isinstance(x, torch.Tensor) and x.is_cuda for x in inputs):
        # a plan fusing pointwise work into GEMMs needs GEMMs Inductor generates itself (Triton
        # templates, autotuned against the library call): a cuBLAS call takes no epilogue
        # (autotuned in a subprocess: a template that faults on one shape must not take down the
        # training process's CUDA context, which a fault in-process does)
        settings |= {
            "max_autotune_gemm": True,
            "max_autotune_gemm_backends": "TRITON,ATEN",
            # unless the user's environment says otherwise (Inductor's own variable): on one
            # H200 (torch 2.11) most templates failed to benchmark in the subprocess
            "autotune_in_subproc": os.environ.get("TORCHINDUCTOR_AUTOTUNE_IN_SUBPROC", "1") == "1",
        }
    patch = config.patch(settings)
    gm = _decompose(gm, inputs)
    with patch, V.set_choices_handler(choices), refusals() as logged:
        compiled = compile_fx_inner(gm, list(inputs), is_backward=phase == "backward")
    found = honoured([k for k in kernels if k], groups)
    refused = resolved(logged, member_ops)
    why = {
        str(i): {"ops": list(groups[i]), "reason": why_not_honoured(groups[i], refused, library)}
        for i in found["not_honoured"]
    }
    info = {
        "phase": phase,
        "groups_planned": len(groups),
        "groups_honoured": len(found["honoured"]),
        "honoured": found["honoured"],
        "not_honoured": found["not_honoured"],
        "why_not": why,
        "kernels": sum(1 for k in kernels if k),
        "vetoed": choices.vetoed,
    }

    def run(args: list[Any]) -> Any:
        return compiled(args)

    run._boxed_call = True  # type: ignore[attr-defined]
    return run, info


def _is_library(snode: Any) -> bool:
    from torch._inductor import scheduler

    return isinstance(snode, scheduler.ExternKernelSchedulerNode)


#: one refusal to fuse: (plan ops of one node, of the other, Inductor's reason)
Refusal = tuple[frozenset[str], frozenset[str], str]


def resolved(records: Sequence[tuple[str, str, str]], member_ops: dict[str, frozenset[str]]) -> list[Refusal]:
    """Inductor's refusals (``coplan.fusion_log``) as (plan ops of one side, of the other, reason);
    a fused node's name joins its members' with ``_``."""

    def ops(name: str) -> frozenset[str]:
        return frozenset(o for m in name.split("_") for o in member_ops.get(m, frozenset()))

    return [(ops(a), ops(b), r) for a, b, r in records]


def why_not_honoured(
    group: Sequence[str],
    refusals: Sequence[Refusal],
    library: Sequence[frozenset[str]],
) -> str:
    """Why Inductor did not put ``group``'s ops in one kernel: its own reason for refusing to fuse
    two nodes that both hold ops of the group, where it logged one; a GEMM of the group run as a
    library call (no epilogue or prologue fuses into it); else that no reason was logged."""
    mine = set(group)
    reasons = [r for a, b, r in refusals if a & mine and b & mine and not (a | b) - mine]
    if reasons:
        return f"Inductor: {reasons[-1]}"
    gemm = next((k for k in library if k & mine), None)
    if gemm is not None:
        return (
            f"{', '.join(sorted(gemm & mine))} ran as a library call: pointwise work fuses into a "
            "GEMM only through Inductor's GEMM templates (max_autotune, CUDA)"
        )
    return "Inductor kept the ops apart and logged no reason"


def _decompose(gm: fx.GraphModule, inputs: Sequence[Any]) -> fx.GraphModule:
    """``gm`` retraced through Inductor's decomposition table (Inductor lowers decomposed graphs;
    the partitioner had to see the undecomposed ops to find the plan's tensors). Every new node
    keeps the marks of the node it came from."""
    from torch._guards import detect_fake_mode
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx import traceback as fx_traceback
    from torch.fx.experimental.proxy_tensor import make_fx

    fake = detect_fake_mode(list(inputs))

    def run(*args: Any) -> Any:
        return fx.Interpreter(gm).run(*args)

    with fx_traceback.preserve_node_meta(), fake if fake is not None else nullcontext():
        return make_fx(run, decomposition_table=select_decomp_table())(*inputs)


def optimizer_record(plan: Plan, ir: Graph, fused: bool) -> dict[str, Any] | None:
    """The fusion record of the optimizer step (not compiled: its groups are honoured when the
    fused AdamW kernel runs the whole update), or None when the plan fuses no optimizer ops."""
    opt = {op.name for op in ir.ops if op.phase is Phase.OPTIMIZER}
    groups = expand_groups(plan, ir)
    mine = [i for i, g in enumerate(groups) if set(g) & opt]
    if not mine:
        return None
    return {
        "phase": "optimizer",
        "groups_planned": len(groups),
        "groups_honoured": len(mine) if fused else 0,
        "honoured": mine if fused else [],
        "not_honoured": [] if fused else mine,
        "why_not": {}
        if fused
        else {
            str(i): {
                "ops": list(groups[i]),
                "reason": "the optimizer's groups need the fused AdamW kernel, which this run did not use",
            }
            for i in mine
        },
    }


def not_honoured(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each planned group no compiled graph honoured (``honoured_total``'s complement), with its ops
    and the reason the first graph that split it gives."""
    good = {i for r in records for i in r.get("honoured", ())}
    bad = sorted({i for r in records for i in r.get("not_honoured", ())} - good)
    out = []
    for i in bad:
        why = next((r["why_not"][str(i)] for r in records if str(i) in r.get("why_not", {})), None)
        out.append({"group": i, "ops": why["ops"] if why else [], "reason": why["reason"] if why else ""})
    return out


def honoured_total(records: Sequence[dict[str, Any]]) -> tuple[int, int]:
    """(groups planned, groups honoured) over a run's records: a group is honoured when some
    compiled graph honoured it and none split it."""
    if not records:
        return 0, 0
    good = {i for r in records for i in r.get("honoured", ())}
    bad = {i for r in records for i in r.get("not_honoured", ())}
    return int(records[0]["groups_planned"]), len(good - bad)
