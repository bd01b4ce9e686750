"""An AOTAutograd partitioner that saves for backward exactly what the plan keeps.

AOTAutograd traces forward and backward into one joint graph and lets a *partitioner* cut it: the
values the forward returns for the backward are saved, everything else the backward needs is
recomputed there from the saved values. PyTorch's ``default_partition`` saves what eager autograd
saves; ``min_cut_rematerialization_partition`` picks its own set by a min cut. This one takes the
set from the plan: every activation the IR marks ``saved_for_backward`` (the set the cost model
prices) is saved unless the plan recomputes it; parameters, the batch and values computed from
parameters alone (16-bit weight copies, transposes) are saved too (they are not activations: the
cost model counts them as parameters). Anything else backward reads is recomputed from those, by
``_extract_fwd_bwd_modules`` (the same extraction both PyTorch partitioners use), and the recompute
is reordered next to its first use (``reordering_to_mimic_autograd_engine``) so that recomputed
values live only as long as eager checkpointing would keep them.

The result of every cut is recorded in a ``Cut`` so that the runtime can measure what is really
saved (the forward's extra outputs, by storage) and the report can say which plan names had no
node in the real graph.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx
from torch._functorch import partitioners as P

from coplan.apply.names import is_plan_cast, map_saved, per_block, saved_tensor_names
from coplan.ir.types import Graph

#: kinds of saved values: activations are what the plan decides (and what is measured against the
#: cost model's activation bytes); the others are parameters or the batch, kept in any plan
ACTIVATION, PARAM, INPUT = "activation", "param", "input"


@dataclass(frozen=True, slots=True)
class Cut:
    """One compiled region's partition: which IR names were saved, recomputed or not found, and
    the kind of each value the forward returns for backward (by output position)."""

    saved: tuple[str, ...]
    recomputed: tuple[str, ...]
    missing: tuple[str, ...]
    num_fwd_outputs: int
    saved_kinds: tuple[str, ...]  # one per saved tensor output, after the forward outputs
    saved_names: tuple[str | None, ...]  # the IR name of each saved output (None: not an IR tensor)
    recompute_ops: int = 0  # forward ops copied into backward


@dataclass
class Partitioner:
    """``partition_fn`` for ``aot_autograd``: cut the joint graph as the plan says.

    ``param_flags`` is set by the backend before each region is traced (which primals are
    parameters); ``cuts`` collects one ``Cut`` per region.
    """

    graph: Graph
    recompute: frozenset[str]
    param_flags: Sequence[bool] = ()
    float_flags: Sequence[bool] = ()
    cuts: list[Cut] = field(default_factory=list)

    def __call__(
        self, joint: fx.GraphModule, joint_inputs: Any, *, num_fwd_outputs: int, **kwargs: Any
    ) -> tuple[fx.GraphModule, fx.GraphModule]:
        ir_saved = saved_tensor_names(self.graph)
        drop = per_block(self.graph, self.recompute)
        nm = map_saved(self.graph, joint, ir_saved)
        keep = [n for n in ir_saved if n in nm.nodes and n not in drop]

        P.force_save_effectful_ops(joint)
        P.force_save_bw_mutation_src(joint)
        primals = [n for n in joint.graph.find_nodes(op="placeholder") if P._is_primal(n)]
        params = {p for p, flag in zip(primals, self.param_flags, strict=False) if flag}
        floats = {p for p, flag in zip(primals, self.float_flags, strict=False) if flag}
        forward = _forward_nodes(joint)
        derived = _param_derived(forward, params)
        fwd_set = set(forward)
        copies = {n: kept_copies(nm.nodes[n], fwd_set) for n in keep}
        ir_of = {c.name: n for n in keep for c in copies[n]}

        saved: list[fx.Node] = [c for n in keep for c in copies[n]]
        saved += primals
        saved += [n for n in forward if n in derived and _is_tensor(n)]
        saved += [n for n in forward if n.meta.get("recompute") == P.CheckpointPolicy.MUST_SAVE]
        # symbolic sizes (dynamic shapes): the inputs' and those computed from them
        syms = [n for n in (*primals, *forward) if P.is_sym_node(n)]
        saved = list(dict.fromkeys(n for n in saved if not P.is_sym_node(n)))

        node_info = P.classify_nodes(
            joint, kwargs.get("static_lifetime_input_indices") or [], num_fwd_outputs
        )
        fw, bw = P._extract_fwd_bwd_modules(
            joint,
            saved,
            saved_sym_nodes=syms,
            num_fwd_outputs=num_fwd_outputs,
            static_lifetime_input_nodes=node_info.static_lifetime_input_nodes,
        )
        fw.graph.eliminate_dead_code(is_impure_node=P.is_not_collective)
        bw.graph.eliminate_dead_code(is_impure_node=P.is_not_collective)
        forward_names = {n.name for n in forward}
        recompute_ops = sum(1 for n in bw.graph.nodes if n.op == "call_function" and n.name in forward_names)
        if recompute_ops:
            bw = P.reordering_to_mimic_autograd_engine(bw)
        fw.recompile()
        bw.recompile()

        out = fw.graph.find_nodes(op="output")[0].args[0]
        param_names = {p.name for p in params}
        float_names = {p.name for p in floats if p not in params}
        derived_names = {d.name for d in derived}
        kinds: list[str] = []
        names: list[str | None] = []
        for node in out[num_fwd_outputs:]:
            if not isinstance(node, fx.Node) or P.is_sym_node(node):
                continue
            if node.name in ir_of:
                kinds.append(ACTIVATION)
                names.append(ir_of[node.name])
            elif node.op == "placeholder":
                kinds.append(
                    PARAM if node.name in param_names else ACTIVATION if node.name in float_names else INPUT
                )
                names.append(None)
            elif node.name in derived_names:
                kinds.append(PARAM)
                names.append(None)
            else:
                kinds.append(ACTIVATION)  # saved by force (effects, mutations): counted, honestly
                names.append(None)
        self.cuts.append(
            Cut(
                saved=tuple(keep),
                recomputed=tuple(sorted(n for n in drop if n in nm.nodes)),
                missing=nm.missing,
                num_fwd_outputs=num_fwd_outputs,
                saved_kinds=tuple(kinds),
                saved_names=tuple(names),
                recompute_ops=recompute_ops,
            )
        )
        return fw, bw


def _forward_nodes(joint: fx.GraphModule) -> list[fx.Node]:
    """Forward nodes of the joint graph, in order (placeholders and tangents excluded)."""
    return [
        n
        for n in joint.graph.nodes
        if n.op == "call_function"
        and n.meta.get("partitioner_tag") != "is_backward"
        and not P._has_tag_is_backward(n)
    ]


def kept_copies(node: fx.Node, forward: set[fx.Node]) -> list[fx.Node]:
    """What keeping the IR tensor computed by ``node`` stores: ``node`` itself, or the narrower
    copy the precision pass cast it to, when backward reads only that copy.

    An fp32-overridden norm's output is cast back to the compute dtype for the next GEMM
    (``precision._cast_exits``), and the GEMM's weight gradient reads that 16-bit copy; nothing
    in backward reads the fp32 output (the norm's backward reads its input, mean and rstd). Keeping
    the fp32 output would store twice the bytes and re-cast it in backward; the cost model, like
    eager autocast's ``linear``, keeps the 16-bit copy (``cost.lookups.GraphLookups.saved_copy``). A
    widening cast (the bf16 residual read by the fp32 norm) is the other way round: the narrow
    original is kept and backward re-casts it exactly, as the cost model prices the residual at
    its producer's width.
    """
    casts = [
        u
        for u in node.users
        if u in forward and is_plan_cast(u) and _narrows(node, u) and _read_later(u, forward)
    ]
    if not casts or _read_later(node, forward):
        return [node, *casts]
    return casts


def _read_later(node: fx.Node, forward: set[fx.Node]) -> bool:
    """Whether a backward node reads ``node``, directly or through forward views of it."""
    for u in node.users:
        if u.op != "call_function":
            continue
        if u not in forward:
            return True
        if isinstance(u.target, torch._ops.OpOverload) and u.target.is_view and _read_later(u, forward):
            return True
    return False


def _narrows(src: fx.Node, cast: fx.Node) -> bool:
    a, b = src.meta.get("val"), cast.meta.get("val")
    return (
        isinstance(a, torch.Tensor)
        and isinstance(b, torch.Tensor)
        and a.is_floating_point()
        and b.is_floating_point()
        and b.element_size() < a.element_size()
    )


def _param_derived(forward: Sequence[fx.Node], params: set[fx.Node]) -> set[fx.Node]:
    """Forward nodes computed from parameters alone (at least one, and no other input)."""
    derived: set[fx.Node] = set()
    for n in forward:
        inputs = n.all_input_nodes
        if inputs and all(i in params or i in derived for i in inputs):
            derived.add(n)
    return derived


def _is_tensor(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


def saved_storages(outputs: Sequence[object], cut: Cut, seen: dict[str, dict[int, int]]) -> None:
    """Record the storages (pointer -> bytes) the forward returned for backward, by kind."""
    tensors = [o for o in outputs[cut.num_fwd_outputs :] if isinstance(o, torch.Tensor)]
    for t, kind in zip(tensors, cut.saved_kinds, strict=False):
        st = _local(t).untyped_storage()
        seen[kind].setdefault(st.data_ptr(), st.nbytes())


def _local(t: torch.Tensor) -> torch.Tensor:
    local: Callable[[], torch.Tensor] | None = getattr(t, "to_local", None)
    return local() if local is not None else t
