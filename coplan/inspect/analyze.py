"""Turn the observed compile (``observe.Collector``) into the inspect record's stages and kernels.

Graph names: the frames Dynamo captured are named by the part of the step they came from
(``model``, ``optimizer-step``; a second frame of one part gets ``#2``); the graphs Inductor compiles
from them by what AOTAutograd made of them (``forward``, ``backward``; ``optimizer`` for the
optimizer's graph). Stages, in the order a graph passes through them: ``capture`` (Dynamo),
``pre_grad``, ``joint`` (passes over the joint forward-backward graph), ``partition`` (the
forward/backward split), ``post_grad``, ``scheduler`` (Inductor's fusion) and ``codegen`` (the
kernels written).
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from coplan.inspect.fxgraph import digest

_STAGE_AT = {
    "before_pre_grad_graph": "pre_grad",
    "after_pre_grad_graph": "aot",
    "aot_joint_graph": "joint",
    "before_joint_graph": "joint",
    "after_joint_graph": "aot",
    "aot_forward_graph": "partition",
    "aot_backward_graph": "partition",
    "aot_inference_graph": "partition",
    "before_post_grad_graph": "post_grad",
    "inductor_post_grad_graph": "lowering",
}


@dataclass
class CompiledGraph:
    """One graph Inductor compiled: its post-grad FX nodes and its kernels."""

    name: str
    role: str
    nodes: list[dict[str, Any]] = field(default_factory=list)
    scheduler: list[dict[str, Any]] = field(default_factory=list)
    why: list[tuple[str, str, str]] = field(default_factory=list)
    codegen: dict[str, list[str]] = field(default_factory=dict)
    kernels: list[dict[str, Any]] = field(default_factory=list)
    fingerprint: str = ""


@dataclass
class Stages:
    passes: list[dict[str, Any]]
    graphs: list[CompiledGraph]
    graph_breaks: list[dict[str, Any]]
    recompiles: int


class _Namer:
    def __init__(self) -> None:
        self.count: dict[str, int] = defaultdict(int)

    def new(self, base: str) -> str:
        self.count[base] += 1
        k = self.count[base]
        return base if k == 1 else f"{base}#{k}"


def _break(payload: str | None, compile_id: str | None) -> dict[str, Any]:
    text = payload or ""
    loc = re.search(r"Graph break in user code at (\S+)", text)
    reason = re.search(r"Graph Break Reason: (.*)", text)
    expl = re.search(r"Explanation: (.*)", text)
    where = loc.group(1) if loc else ""
    # site-packages paths are long and differ between machines: keep the package-relative part
    where = re.sub(r"^.*site-packages/", "", where)
    words = [reason.group(1).strip() if reason else "", expl.group(1).strip() if expl else ""]
    return {"frame": compile_id, "location": where, "reason": " ".join(w for w in words if w)}


def _renumber(table: dict[str, list[str]]) -> dict[str, list[str]]:
    """Codegen's keys are ``name:handle``, the handle a process-wide counter (not reset for a
    backward compiled on its own): number them in launch order within the graph instead, so two
    compiles of one program name their kernels alike."""

    def handle(key: str) -> int:
        tail = key.rsplit(":", 1)
        return int(tail[1]) if len(tail) == 2 and tail[1].isdigit() else 0

    ordered = sorted(table.items(), key=lambda kv: handle(kv[0]))
    return {f"{key.rsplit(':', 1)[0]}:{i}": nodes for i, (key, nodes) in enumerate(ordered, 1)}


def stages(events: list[dict[str, Any]]) -> Stages:
    passes: list[dict[str, Any]] = []
    graphs: list[CompiledGraph] = []
    breaks: list[dict[str, Any]] = []
    frames = _Namer()
    posts = _Namer()
    frame_of: dict[str | None, str] = {}
    stage: dict[str | None, str] = {}
    last_ops: dict[str | None, int] = {}
    current: CompiledGraph | None = None
    pre_nodes = 0
    timed = False
    recompiles = 0
    traced: set[str | None] = set()

    def open_graph(e: dict[str, Any]) -> CompiledGraph:
        """A new graph compiled by Inductor, named by what AOTAutograd made of it."""
        base = (
            "optimizer"
            if e["section"] == "optimizer"
            else ("backward" if e["role"] == "backward" else "forward")
        )
        g = CompiledGraph(name=posts.new(base), role=e["role"])
        graphs.append(g)
        return g

    def add(name: str, graph: str, st: str, fp: str, before: int, after: int) -> None:
        passes.append(
            {
                "name": name,
                "graph": graph,
                "stage": st,
                "fingerprint": fp,
                "ops_before": before,
                "ops_after": after,
            }
        )

    for e in events:
        kind, cid = e["event"], e.get("compile_id")
        if kind == "timed":
            timed = True
        elif kind == "capture":
            if timed:
                recompiles += 1
                continue
            label = frames.new("optimizer-step" if e["section"] == "optimizer" else e["section"])
            frame_of[cid] = label
            stage[cid] = "capture"
            last_ops[cid] = e["ops"]
            add("dynamo", label, "capture", e["fp"], 0, e["ops"])
        elif timed:
            continue
        elif kind == "trace":
            name = e["name"]
            if name in _STAGE_AT:
                stage[cid] = _STAGE_AT[name]
                if name == "before_post_grad_graph":
                    current = None
            elif name == "dynamo_graph_break_reason":
                breaks.append(_break(e.get("payload"), cid))
            elif name == "kernel_nodes" and current is not None:
                current.codegen = _renumber(dict(e.get("payload") or {}))
                fp = digest(f"{k}:{','.join(sorted(v))}" for k, v in sorted(current.codegen.items()))
                n_sched = sum(1 for k in current.scheduler if _launches(k))
                add("codegen", current.name, "codegen", fp, n_sched, len(current.codegen) or n_sched)
        elif kind == "pass":
            if e["depth"] != 0:
                continue
            if cid not in frame_of:  # its capture went unread (see "notes"): name the frame here
                frame_of[cid] = frames.new("optimizer-step" if e["section"] == "optimizer" else e["section"])
            st = stage.get(cid, "post_grad")
            if st == "post_grad":
                if current is None:
                    current = open_graph(e)
                    add(
                        "aot_partition",
                        current.name,
                        "partition",
                        e["fp_before"],
                        last_ops.get(cid, 0),
                        e["ops_before"],
                    )
                graph = current.name
            else:
                graph = frame_of[cid]
                if st == "aot":
                    st = "joint"
                if st == "joint" and cid not in traced:
                    # the graph AOTAutograd traced (functionalized, decomposed to aten; forward and
                    # backward together when training) is what the first joint pass receives
                    traced.add(cid)
                    add("aot_trace", graph, "joint", e["fp_before"], last_ops.get(cid, 0), e["ops_before"])
            last_ops[cid] = e["ops_after"] if st != "post_grad" else last_ops.get(cid, 0)
            add(e["name"], graph, st, e["fp_after"], e["ops_before"], e["ops_after"])
        elif kind == "pre_fusion":
            pre_nodes = e["nodes"]
        elif kind == "post_fusion":
            if current is None:  # its post-grad passes went unread (see "notes")
                current = open_graph(e)
            current.nodes = e["graph"]
            current.scheduler = e["kernels"]
            current.why = [(str(a), str(b), str(r)) for a, b, r in e["why"]]
            groups = sorted(",".join(k["origins"]) for k in current.scheduler)
            n_sched = sum(1 for k in current.scheduler if _launches(k))
            add("scheduler_fusion", current.name, "scheduler", digest(groups), pre_nodes, n_sched)
    return Stages(passes, graphs, breaks, recompiles)


def _library(key: str) -> bool:
    """A codegen entry that is a call into a library or an eager op, not generated code."""
    base = key.rsplit(":", 1)[0]
    return not base.startswith(("cpp_", "triton_"))


def _kernel_kind(key: str, matched: list[dict[str, Any]]) -> str:
    kinds = {k["kind"] for k in matched}
    for k in ("fallback", "template", "extern"):
        if k in kinds:
            return k
    if _library(key):
        return "fallback" if key.startswith("torch.ops.") else "extern"
    return "generated"


def _launches(k: dict[str, Any]) -> bool:
    # a MultiOutput node only indexes a fallback's tuple of outputs; nop nodes launch nothing
    return k["kind"] != "nop" and not (k["kind"] == "extern" and k.get("op") == "MultiOutput")


def kernels_of(g: CompiledGraph) -> list[dict[str, Any]]:
    """The kernels of ``g`` as written: codegen's table (post-grad nodes per kernel; on a CPU one
    loop nest can hold several of the scheduler's fused nodes), each with the scheduler nodes it
    holds and their bytes and FLOPs as Inductor counts them. A library call is matched to the
    scheduler node of its op, generated code to the fused nodes it shares the most FX nodes with.
    Scheduler nodes codegen did not list stay kernels of their own."""
    sched = [k for k in g.scheduler if _launches(k)]
    table = dict(g.codegen)
    owner: dict[int, str] = {}
    taken: set[str] = set()
    for i, k in enumerate(sched):
        library = k["kind"] in ("extern", "fallback")
        best, overlap = None, -1
        for key, nodes in table.items():
            if _library(key) != library or (library and key in taken):
                continue
            if library and not key.rsplit(":", 1)[0].endswith(str(k.get("op") or "?")):
                continue
            common = len(set(nodes) & set(k["origins"]))
            if common > overlap and (library or common > 0):
                best, overlap = key, common
        if best is not None:
            owner[i] = best
            if library:
                taken.add(best)
    out = []
    for key, nodes in table.items():
        matched = [k for i, k in enumerate(sched) if owner.get(i) == key]
        out.append(
            {
                "name": key,
                "graph": g.name,
                "kind": _kernel_kind(key, matched),
                "ops": sorted(set(nodes)) or sorted({o for k in matched for o in k["origins"]}),
                "op": next((k["op"] for k in matched if k.get("op")), None),
                "members": [m for k in matched for m in k["members"]],
                "bytes": sum(k["bytes"] for k in matched),
                "flops": sum(k["flops"] for k in matched),
            }
        )
    for i, k in enumerate(sched):
        if i not in owner:
            name = k["op"] if k["kind"] in ("fallback", "extern") and k.get("op") else k["name"]
            out.append(
                {
                    "name": name,
                    "graph": g.name,
                    "kind": k["kind"],
                    "ops": list(k["origins"]),
                    "op": k.get("op"),
                    "members": list(k["members"]),
                    "bytes": k["bytes"],
                    "flops": k["flops"],
                }
            )
    # several unlisted externs of one op get one name: number them as the output code does
    seen: dict[str, int] = defaultdict(int)
    for k in out:
        seen[k["name"]] += 1
    index: dict[str, int] = defaultdict(int)
    for k in out:
        if seen[k["name"]] > 1:
            index[k["name"]] += 1
            k["name"] = f"{k['name']}:{index[k['name']]}"
    return out
