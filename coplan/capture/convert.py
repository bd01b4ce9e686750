"""Convert a traced training step (``coplan.capture.trace``) into the IR.

Each FX ``call_function`` node becomes one op, except bookkeeping nodes (``getitem`` of a
multi-output op, ``detach``, profiler markers), which are folded away. Views and in-place ops are
turned into SSA values that record which storage they alias, so memory accounting counts a buffer
once however many views of it autograd keeps.
"""

from __future__ import annotations

import operator
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch.utils.flop_counter import flop_registry

from coplan.capture.flops import register_missing_formulas
from coplan.capture.trace import TracedStep
from coplan.ir.oprules import TensorInfo, rule_for
from coplan.ir.saved import mark_saved
from coplan.ir.types import Graph, GraphMeta, Op, OpKind, Phase, Tensor, TensorRole, relink

_FOLD = {"detach", "alias", "lift_fresh", "_record_function_enter_new", "_record_function_exit"}
_DTYPE = {
    torch.float64: "float64",
    torch.float32: "float32",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.float8_e4m3fn: "float8_e4m3fn",
    torch.float8_e5m2: "float8_e5m2",
    torch.int64: "int64",
    torch.int32: "int32",
    torch.int16: "int16",
    torch.int8: "int8",
    torch.uint8: "uint8",
    torch.bool: "bool",
    torch.complex64: "complex64",
}


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE.get(dtype, str(dtype).removeprefix("torch."))


def _canon(arg: Any) -> str:
    """Non-tensor arguments as stable text (node references become '%')."""
    if isinstance(arg, torch.fx.Node):
        return "%"
    if isinstance(arg, list | tuple):
        return "[" + ",".join(_canon(a) for a in arg) + "]"
    if isinstance(arg, torch.dtype):
        return dtype_name(arg)
    if isinstance(arg, float):
        return repr(round(arg, 12))
    if isinstance(arg, torch.device | torch.layout | torch.memory_format):
        return ""  # placement is not part of the graph's meaning
    return repr(arg)


@dataclass
class _Builder:
    step: TracedStep
    tensors: list[Tensor] = field(default_factory=list)
    ops: list[Op] = field(default_factory=list)
    value_of: dict[torch.fx.Node, Any] = field(default_factory=dict)  # node -> tensor id / tuple / None
    seq_fwd: dict[int, int] = field(default_factory=dict)  # autograd seq_nr -> forward op id
    param_of: dict[int, int] = field(default_factory=dict)  # tensor id -> parameter index
    bwd_seq: dict[int, int] = field(default_factory=dict)  # backward op id -> autograd seq_nr
    param_tensor: list[int] = field(default_factory=list)  # parameter index -> tensor id

    def new_tensor(self, val: torch.Tensor, name: str, role: TensorRole, **kw: Any) -> int:
        t = Tensor(
            id=len(self.tensors),
            name=name,
            shape=tuple(int(d) for d in val.shape),
            dtype=dtype_name(val.dtype),
            role=role,
            **kw,
        )
        self.tensors.append(t)
        return t.id

    def storage_role(self, tid: int) -> TensorRole:
        return self.tensors[self.tensors[tid].storage_id].role


def _block_of(path: str, container: str) -> int | None:
    if not container:
        return None
    prefix = container + "."
    if not path.startswith(prefix):
        return None
    head = path[len(prefix) :].split(".", 1)[0]
    return int(head) if head.isdigit() else None


def _module_of_param(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def to_graph(step: TracedStep, meta: GraphMeta) -> Graph:
    """Build the IR of a traced step; see the module docstring for what is folded."""
    register_missing_formulas()
    b = _Builder(step)
    placeholders = [n for n in step.gm.graph.nodes if n.op == "placeholder"]
    n_p, n_b, n_s = len(step.param_names), len(step.buffer_names), len(step.state_keys)
    for i, node in enumerate(placeholders):
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            b.value_of[node] = None
            continue
        if i < n_p:
            name = step.param_names[i]
            tid = b.new_tensor(val, name, TensorRole.PARAMETER, param_name=name)
            b.param_of[tid] = i
            b.param_tensor.append(tid)
        elif i < n_p + n_b:
            name = step.buffer_names[i - n_p]
            tid = b.new_tensor(val, name, TensorRole.BUFFER, param_name=name)
        elif i < n_p + n_b + n_s:
            pi, key = step.state_keys[i - n_p - n_b]
            tid = b.new_tensor(
                val,
                f"{step.param_names[pi]}.{key}",
                TensorRole.OPTIMIZER_STATE,
                param_name=step.param_names[pi],
            )
            b.param_of[tid] = pi
        else:
            tid = b.new_tensor(val, f"input{i - n_p - n_b - n_s}", TensorRole.INPUT)
        b.value_of[node] = tid

    outputs: list[int] = []
    for node in step.gm.graph.nodes:
        if node.op == "call_function":
            _convert_call(b, node)
        elif node.op == "output":
            # make_fx flattens the step's (loss, params, state, grads) result
            flat_out = list(node.args[0])
            grads = flat_out[1 + n_p + n_s :]
            for pi, g in enumerate(grads):
                gid = b.value_of.get(g) if isinstance(g, torch.fx.Node) else None
                if isinstance(gid, int) and b.tensors[gid].role is TensorRole.GRADIENT:
                    b.tensors[gid] = replace(b.tensors[gid], grad_of=b.param_tensor[pi])
            outputs = [
                b.value_of[n]
                for n in flat_out[: 1 + n_p + n_s]
                if isinstance(n, torch.fx.Node) and isinstance(b.value_of.get(n), int)
            ]
        elif node.op == "get_attr":
            val = getattr(step.gm, str(node.target))
            b.value_of[node] = (
                b.new_tensor(val, str(node.target), TensorRole.CONSTANT)
                if isinstance(val, torch.Tensor)
                else None
            )

    ops = _finalize_ops(b)
    graph = relink(ops, b.tensors, meta)
    return mark_saved(graph, outputs)


def _convert_call(b: _Builder, node: torch.fx.Node) -> None:
    target = node.target
    if target is operator.getitem:
        src = b.value_of[node.args[0]]  # type: ignore[index]
        b.value_of[node] = src[node.args[1]] if isinstance(src, tuple) else None  # type: ignore[index]
        return
    packet = getattr(target, "overloadpacket", None)
    short = getattr(packet, "__name__", str(target)).split(".")[-1]
    in_nodes = [a for a in node.all_input_nodes if isinstance(b.value_of.get(a), int)]
    in_ids = [b.value_of[a] for a in in_nodes]
    if short in _FOLD:
        b.value_of[node] = in_ids[0] if in_ids and short in ("detach", "alias", "lift_fresh") else None
        return
    custom = node.meta.get("custom", {})
    phase = Phase(custom.get("phase", "forward"))
    val = node.meta.get("val")
    is_view = bool(getattr(target, "is_view", False))
    schema = getattr(target, "_schema", None)
    mutated = _mutated_arg(node, schema)
    tags = getattr(target, "tags", ())
    rule = rule_for(short, pointwise=torch.Tag.pointwise in tags, is_view=is_view)
    op_id = len(b.ops)
    module_path = custom.get("module", "")

    def make_out(v: torch.Tensor, k: int) -> int:
        kw: dict[str, Any] = {}
        if mutated is not None:
            src = b.value_of[mutated]
            kw = {"alias_of": b.tensors[src].storage_id, "updates": src}
            role = b.storage_role(src)
        elif is_view and in_ids:
            kw = {"alias_of": b.tensors[in_ids[0]].storage_id}
            role = b.storage_role(in_ids[0])
        else:
            role = {
                Phase.FORWARD: TensorRole.ACTIVATION,
                Phase.BACKWARD: TensorRole.GRADIENT,
                Phase.OPTIMIZER: TensorRole.OPTIMIZER_TEMP,
            }[phase]
        suffix = f".{k}" if k else ""
        tid = b.new_tensor(v, f"{node.name}{suffix}", role, **kw)
        for src in in_ids:
            if src in b.param_of:
                b.param_of.setdefault(tid, b.param_of[src])
        return tid

    if isinstance(val, torch.Tensor):
        out_ids: list[int] = [make_out(val, 0)]
        b.value_of[node] = out_ids[0]
    elif isinstance(val, tuple | list):
        vals = [make_out(v, k) if isinstance(v, torch.Tensor) else None for k, v in enumerate(val)]
        out_ids = [v for v in vals if v is not None]
        b.value_of[node] = tuple(vals)
    else:
        b.value_of[node] = None
        return

    infos_in: list[TensorInfo] = [_info(b, t) for t in dict.fromkeys(in_ids)]
    infos_out: list[TensorInfo] = [(b.tensors[t].shape, _itemsize(b, t)) for t in out_ids]
    flops = 0
    if packet in flop_registry:
        args_v = torch.utils._pytree.tree_map_only(torch.fx.Node, lambda n: n.meta.get("val"), node.args)
        kwargs_v = torch.utils._pytree.tree_map_only(torch.fx.Node, lambda n: n.meta.get("val"), node.kwargs)
        flops = int(flop_registry[packet](*args_v, **kwargs_v, out_val=val))
    read, written = rule.bytes_moved(infos_in, infos_out)
    if mutated is not None:
        written = sum(b.tensors[t].nbytes for t in out_ids)
    kind = OpKind.OPTIMIZER if rule.kind is OpKind.OTHER and phase is Phase.OPTIMIZER else rule.kind
    args_text = (
        ",".join(_canon(a) for a in node.args)
        + ";"
        + ",".join(f"{k}={_canon(v)}" for k, v in sorted(node.kwargs.items()))
    )
    b.ops.append(
        Op(
            id=op_id,
            name=node.name,
            target=str(target),
            kind=kind,
            inputs=tuple(in_ids),
            outputs=tuple(out_ids),
            phase=phase,
            flops=flops,
            vector_flops=rule.vector_flops(infos_in, infos_out),
            bytes_read=read,
            bytes_written=written,
            module_path=module_path,
            args=args_text,
        )
    )
    if phase is Phase.FORWARD and isinstance(node.meta.get("seq_nr"), int):
        # The first forward node carrying a sequence number is the op that created that autograd
        # function; later forward nodes inherit the number without creating one.
        b.seq_fwd.setdefault(node.meta["seq_nr"], op_id)
    elif phase is Phase.BACKWARD and isinstance(custom.get("grad_fn_seq"), int):
        b.bwd_seq[op_id] = custom["grad_fn_seq"]


def _info(b: _Builder, tid: int) -> TensorInfo:
    t = b.tensors[tid]
    base = b.tensors[t.storage_id]
    # A broadcast (expanded) view reads no more than its base's storage.
    if t.numel > base.numel:
        return base.shape, _itemsize(b, base.id)
    return t.shape, _itemsize(b, tid)


def _itemsize(b: _Builder, tid: int) -> int:
    t = b.tensors[tid]
    return t.nbytes // t.numel if t.numel else 0


def _mutated_arg(node: torch.fx.Node, schema: Any) -> torch.fx.Node | None:
    if schema is None:
        return None
    for i, a in enumerate(schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            arg = node.args[i] if i < len(node.args) else node.kwargs.get(a.name)
            return arg if isinstance(arg, torch.fx.Node) else None
    return None


def _link_backward(b: _Builder) -> dict[int, int]:
    """Forward op of every backward op: by autograd sequence number, else by data flow.

    Ops the engine issues between autograd functions (gradient accumulation for a tensor used
    twice, the loss seed) carry no sequence number; they take the link of the backward op that
    produced their input, else of the one that consumes their result, else the last forward op.
    """
    link: dict[int, int] = {}
    bwd = [op for op in b.ops if op.phase is Phase.BACKWARD]
    for op in bwd:
        seq = b.bwd_seq.get(op.id)
        if seq is not None and seq in b.seq_fwd:
            link[op.id] = b.seq_fwd[seq]
    # Producers first: an accumulation sums gradients arriving from the consumers of one value, and
    # those come from the layer that reads it (so each layer owns the accumulation for its input,
    # and every layer has the same ops). Ops with no linked producer (the loss seed) look forward.
    producer = {t: op.id for op in bwd for t in op.outputs}
    for op in bwd:
        if op.id not in link:
            # the latest producer: the gradient that just arrived from the reading layer, not the
            # one passed through the residual path from further up
            hits = [producer[t] for t in op.inputs if producer.get(t) in link]
            hit = max(hits) if hits else None
            if hit is not None:
                link[op.id] = link[hit]
    consumers: dict[int, list[int]] = defaultdict(list)
    for op in bwd:
        for t in op.inputs:
            consumers[t].append(op.id)
    fwd = [op.id for op in b.ops if op.phase is Phase.FORWARD]
    for op in reversed(bwd):
        if op.id not in link:
            hit = next((c for t in op.outputs for c in consumers[t] if c in link), None)
            if hit is not None:
                link[op.id] = link[hit]
            elif fwd:
                link[op.id] = fwd[-1]
    return link


def _finalize_ops(b: _Builder) -> list[Op]:
    """Fill in forward links, module paths (backward: its forward op's; optimizer: its
    parameter's) and block indices."""
    link = _link_backward(b)
    container = b.step.block_container
    out: list[Op] = []
    for op in b.ops:
        path = op.module_path
        fwd = link.get(op.id)
        if op.phase is Phase.BACKWARD and fwd is not None:
            path = b.ops[fwd].module_path
        elif op.phase is Phase.OPTIMIZER:
            owner = next((b.param_of[t] for t in op.inputs if t in b.param_of), None)
            if owner is not None:
                path = _module_of_param(b.step.param_names[owner])
        out.append(replace(op, forward_op=fwd, module_path=path, block=_block_of(path, container)))
    return out
