"""Watch ``torch.compile`` compile a step, through PyTorch's own instruments, into one event stream.

Nothing here re-implements Inductor. It listens:

- the structured trace (``torch._logging`` ``trace_structured``, what tlparse reads): which frame is
  compiled, the AOT joint / forward / backward graphs, the phase markers around pre-grad, joint and
  post-grad passes, graph breaks with their reasons, and Inductor's provenance tracking (the kernel
  each post-grad node ended in);
- ``GraphTransformObserver``, the object every Inductor FX pass runs under: each pass's graph is
  fingerprinted on the way in and out;
- the backend Dynamo hands its graph to (Inductor's ``compile_fx``, wrapped to fingerprint it);
- Inductor's scheduler hooks (``_pre_fusion_custom_pass``/``_post_fusion_custom_pass``): the nodes
  before fusion and the kernels after it, with the FX nodes each kernel came from, its bytes and
  FLOPs as Inductor counts them;
- the scheduler's ``fusion`` log (``WhyNoFuse``): why two nodes were not fused, where it says.

While watching, Inductor's FX-graph and AOTAutograd caches are off (a cache hit would skip the
passes being watched); the kernel code cache stays on, it does not change what is compiled.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from coplan.fusion_log import refusals
from coplan.inspect.fxgraph import fingerprint, op_count, role_of, target_name

#: structured-trace events kept (metadata, and the payload where noted)
_KEEP = {
    "dynamo_start",
    "dynamo_output_graph",
    "aot_joint_graph",
    "aot_forward_graph",
    "aot_backward_graph",
    "aot_inference_graph",
    "inductor_output_code",
    "compilation_metrics",
}
#: trace artifacts that mark where the compiler is
_MARKERS = {
    "before_pre_grad_graph",
    "after_pre_grad_graph",
    "before_joint_graph",
    "after_joint_graph",
    "before_post_grad_graph",
    "inductor_post_grad_graph",
}
#: what is kept of each frame's compilation metrics
_METRICS = ("co_name", "co_filename", "graph_op_count", "compile_id", "fail_reason")
#: artifacts whose payload is kept
_PAYLOADS = {"dynamo_graph_break_reason", "inductor_provenance_tracking_node_mappings"}


@dataclass
class Collector:
    """The ordered record of one compile: a list of plain dicts, each with an ``event`` key."""

    events: list[dict[str, Any]] = field(default_factory=list)
    #: set by the caller while the optimizer step is being compiled, to name its graphs
    section: str = "model"
    _pass_stack: list[dict[str, Any]] = field(default_factory=list)

    def add(self, event: str, **kw: Any) -> None:
        self.events.append({"event": event, "section": self.section, **kw})


def _compile_id() -> str | None:
    try:
        cid = torch._guards.CompileContext.current_compile_id()
    except Exception:  # an instrument must never break the compile it watches
        return None
    return None if cid is None else str(cid)


class _TraceHandler(logging.Handler):
    def __init__(self, col: Collector) -> None:
        super().__init__(logging.DEBUG)
        self.col = col

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._read(record)
        except Exception as err:  # an instrument must never break the compile it watches
            self.col.add("error", where=type(self).__name__, message=f"{type(err).__name__}: {err}")

    def _read(self, record: logging.LogRecord) -> None:
        meta = getattr(record, "metadata", None)
        if not isinstance(meta, dict):
            return
        frame = meta.get("frame_id")
        cid = f"{frame}/{meta.get('frame_compile_id')}" if frame is not None else None
        for key, value in meta.items():
            if key in _KEEP:
                kept = None
                if key == "compilation_metrics" and isinstance(value, dict):
                    kept = {k: value.get(k) for k in _METRICS}
                self.col.add("trace", name=key, compile_id=cid, meta=kept)
                return
            if key == "artifact" and isinstance(value, dict):
                name = value.get("name")
                if name in _MARKERS:
                    self.col.add("trace", name=name, compile_id=cid)
                elif name in _PAYLOADS:
                    self.col.add("trace", name=name, compile_id=cid, payload=getattr(record, "payload", None))
                elif name == "inductor_provenance_tracking_kernel_stack_traces":
                    # the kernel -> post-grad node table of this graph, read while Inductor still
                    # holds it (its own dump leaves it out when no pre-grad graph id is set, as for
                    # a backward graph compiled on its own)
                    info = getattr(
                        torch._inductor.debug, "_inductor_triton_kernel_to_post_grad_node_info", None
                    )
                    table = {k: list(v) for k, v in info.items()} if isinstance(info, dict) else {}
                    self.col.add("trace", name="kernel_nodes", compile_id=cid, payload=table)
                return


def _snapshot_nodes(nodes: list[Any]) -> list[dict[str, Any]]:
    """Each scheduler node (a kernel after fusion) as plain data."""
    from torch._inductor import ir, scheduler

    out = []
    for n in nodes:
        try:
            kind = "generated"
            op = None
            if isinstance(n, scheduler.NopKernelSchedulerNode):
                kind = "nop"
            elif isinstance(n, scheduler.ExternKernelSchedulerNode):
                node = n.node
                if isinstance(node, ir.FallbackKernel):
                    kind = "fallback"
                    op = str(getattr(node, "op_overload", None) or getattr(node, "python_kernel_name", ""))
                else:
                    kind = "extern"
                    op = str(getattr(node, "python_kernel_name", None) or type(node).__name__)
            elif n.is_template():
                kind = "template"
            members = [s.get_name() for s in n.get_nodes()]
            member_origins: dict[str, list[str]] = {}
            for s in n.get_nodes():
                if s.node is not None:
                    member_origins[s.get_name()] = sorted(
                        o.name for o in s.node.get_origins() if o.op == "call_function"
                    )
            origins = [o for names in member_origins.values() for o in names]
            try:
                nbytes = int(n.get_read_write_buffers_sizes())
            except Exception:  # symbolic sizes or a node kind without accounting: no bytes known
                nbytes = 0
            try:
                flops = int(n.estimate_flops() or 0)
            except Exception:  # as for bytes
                flops = 0
            out.append(
                {
                    "name": n.get_name(),
                    "kind": kind,
                    "op": op,
                    "members": members,
                    "member_origins": member_origins,
                    "origins": sorted(set(origins)),
                    "bytes": nbytes,
                    "flops": flops,
                }
            )
        except Exception as err:  # a scheduler node kind this reading does not know: keep its name
            out.append(
                {
                    "name": getattr(n, "get_name", lambda: "?")(),
                    "kind": "unknown",
                    "op": None,
                    "members": [],
                    "member_origins": {},
                    "origins": [],
                    "bytes": 0,
                    "flops": 0,
                    "error": str(err),
                }
            )
    return out


def _graph_of(nodes: list[Any]) -> torch.fx.Graph | None:
    for n in nodes:
        for s in n.get_nodes():
            if s.node is None:
                continue
            for o in s.node.get_origins():
                return o.graph
    return None


def snapshot_graph(g: torch.fx.Graph) -> list[dict[str, Any]]:
    """The post-grad FX graph as plain data: what the unfused-pattern scan and pricing read."""
    out = []
    for n in g.nodes:
        val = n.meta.get("val")
        shape, dtype, nbytes, itemsize = None, None, 0, 0
        if isinstance(val, torch.Tensor):
            try:
                shape = [int(d) for d in val.shape]
                dtype = str(val.dtype).removeprefix("torch.")
                itemsize = val.element_size()
                nbytes = int(val.numel()) * itemsize
            except Exception:  # symbolic sizes (dynamic shapes): no static shape to report
                shape = None
        orig = n.meta.get("original_aten")
        target = n.target
        out.append(
            {
                "name": n.name,
                "op": n.op,
                "target": target_name(n) if n.op != "placeholder" else "",
                "original_aten": str(getattr(orig, "overloadpacket", orig)) if orig is not None else None,
                "original_pointwise": bool(torch.Tag.pointwise in getattr(orig, "tags", ())),
                "pointwise": bool(torch.Tag.pointwise in getattr(target, "tags", ())),
                "view": bool(getattr(target, "is_view", False)),
                "inputs": [a.name for a in n.all_input_nodes],
                "shape": shape,
                "dtype": dtype,
                "bytes": nbytes,
                "itemsize": itemsize,
            }
        )
    return out


def _chain(mine: Callable[[list[Any]], list[Any]], theirs: Any) -> Callable[[list[Any]], list[Any]]:
    if theirs is None:
        return mine
    return lambda nodes: mine(theirs(nodes))


@contextlib.contextmanager
def observe(col: Collector) -> Iterator[Callable[..., Any]]:
    """Instrument ``torch.compile`` while the block runs; yields the backend to compile with."""
    from torch._inductor import config as ic
    from torch._inductor.compile_fx import compile_fx
    from torch._logging._internal import trace_log
    from torch.fx.passes.graph_transform_observer import GraphTransformObserver

    trace_handler = _TraceHandler(col)

    orig_enter, orig_exit = GraphTransformObserver.__enter__, GraphTransformObserver.__exit__

    # Every hook below is guarded: an instrument that fails must not fail the compile it watches.
    # What it could not read is recorded as an "error" event, which the record reports as a note.
    def failed(where: str, err: Exception) -> None:
        col.add("error", where=where, message=f"{type(err).__name__}: {err}")

    def look(gm: Any) -> tuple[str, int]:
        return fingerprint(gm), op_count(gm)

    def enter(self: Any) -> Any:
        try:
            fp, ops = look(self.gm)
        except Exception as err:
            failed(f"pass {self.passname}", err)
            fp, ops = "", 0
        col._pass_stack.append({"name": self.passname, "fp": fp, "ops": ops})
        return orig_enter(self)

    def exit_(self: Any, *exc: Any) -> Any:
        result = orig_exit(self, *exc)
        if col._pass_stack:
            before = col._pass_stack.pop()
            try:
                fp, ops = look(self.gm)
                col.add(
                    "pass",
                    name=before["name"],
                    compile_id=_compile_id(),
                    role=role_of(self.gm),
                    fp_before=before["fp"],
                    fp_after=fp,
                    ops_before=before["ops"],
                    ops_after=ops,
                    depth=len(col._pass_stack),
                )
            except Exception as err:
                failed(f"pass {before['name']}", err)
        return result

    def pre_fusion(nodes: list[Any]) -> list[Any]:
        why.clear()
        # provenance tracking keeps its kernel table in a module global that is reset only for
        # graphs with a pre-grad id (not a backward compiled on its own): start each graph empty
        table = getattr(torch._inductor.debug, "_inductor_triton_kernel_to_post_grad_node_info", None)
        if isinstance(table, dict):
            table.clear()
        col.add("pre_fusion", compile_id=_compile_id(), nodes=len(nodes))
        return nodes

    def post_fusion(nodes: list[Any]) -> list[Any]:
        try:
            g = _graph_of(nodes)
            col.add(
                "post_fusion",
                compile_id=_compile_id(),
                kernels=_snapshot_nodes(nodes),
                why=list(why),
                graph=snapshot_graph(g) if g is not None else [],
                role=_role_of_graph(g),
            )
        except Exception as err:
            failed("scheduler", err)
        why.clear()
        return nodes

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        try:
            fp, ops = look(gm)
            col.add("capture", compile_id=_compile_id(), fp=fp, ops=ops)
        except Exception as err:
            failed("dynamo capture", err)
        return compile_fx(gm, example_inputs)

    patches = {
        "trace.provenance_tracking_level": 1,
        "fx_graph_cache": False,
        "fx_graph_remote_cache": False,
        "_pre_fusion_custom_pass": _chain(pre_fusion, ic._pre_fusion_custom_pass),
        "_post_fusion_custom_pass": _chain(post_fusion, ic._post_fusion_custom_pass),
    }
    trace_log.addHandler(trace_handler)
    GraphTransformObserver.__enter__ = enter  # type: ignore[method-assign]
    GraphTransformObserver.__exit__ = exit_  # type: ignore[method-assign]
    started = time.perf_counter()
    try:
        with (
            ic.patch(patches),
            torch._functorch.config.patch(enable_autograd_cache=False),
            refusals() as why,  # the scheduler's reasons, read by the fusion hooks above
        ):
            yield backend
    finally:
        GraphTransformObserver.__enter__ = orig_enter  # type: ignore[method-assign]
        GraphTransformObserver.__exit__ = orig_exit  # type: ignore[method-assign]
        trace_log.removeHandler(trace_handler)
        col.add("done", seconds=time.perf_counter() - started)


def _role_of_graph(g: torch.fx.Graph | None) -> str:
    return "inference" if g is None else role_of(g)
