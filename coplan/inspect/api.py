"""``coplan.inspect``: what ``torch.compile`` did to one training step, as one record.

``inspect_module`` takes any ``nn.Module`` and its example inputs; ``inspect_model`` builds a
coplan preset, spec file or Hugging Face model first. Both compile the step under the observers
(``step.run_step``), read the stages and kernels out of what was observed (``analyze``), scan for
patterns that should have fused (``fusions``), price every kernel with the cost model (``price``)
and, when asked, store the record in the history database.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from coplan.errors import CoplanError
from coplan.hardware.device import DeviceSpec
from coplan.inspect.analyze import kernels_of, stages
from coplan.inspect.fusions import node_kind, unfused
from coplan.inspect.fxgraph import digest
from coplan.inspect.price import Pricer, fused_optimizer_kernel, pattern_name
from coplan.inspect.step import LossFn, StepRun, default_loss, median, run_step
from coplan.ir.types import OpKind

SCHEMA = 1

#: the coplan device preset a CUDA device is priced as, by the words in its name
_CUDA_PRESETS = (("H200", "h200"), ("H100", "h100-sxm"), ("B200", "b200"), ("L4", "l4"))


@dataclass(frozen=True, slots=True)
class Inspection:
    """The result of ``coplan.inspect``: ``record`` is what ``coplan inspect --json`` prints."""

    record: dict[str, Any]

    @property
    def fingerprint(self) -> str:
        return str(self.record["fingerprint"])

    @property
    def kernels(self) -> int:
        return int(self.record["kernels"])

    @property
    def unfused(self) -> list[dict[str, Any]]:
        return list(self.record["unfused"])

    @property
    def fallbacks(self) -> list[dict[str, Any]]:
        return list(self.record["fallbacks"])

    @property
    def passes(self) -> list[dict[str, Any]]:
        return list(self.record["passes"])

    def html(self, path: str | Path) -> Path:
        from coplan.inspect.html import write_html

        return write_html(self.record, Path(path))


def hardware_for(device: torch.device) -> str:
    """The coplan device preset that prices a compiled step on ``device`` by default."""
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device)
    if "A100" in name:
        total = torch.cuda.get_device_properties(device).total_memory
        return "a100-sxm-80gb" if total > 48 * 2**30 else "a100-sxm-40gb"
    for word, preset in _CUDA_PRESETS:
        if word in name:
            return preset
    return "h100-sxm"


def _registered_fallbacks() -> frozenset[str]:
    """The ops ``torch/_inductor/lowering.py`` makes fallbacks of when it loads (``make_fallback``).
    Read before any compile: Inductor adds each op it meets without a lowering to the same set."""
    from torch._inductor import lowering

    return frozenset(str(op) for op in lowering.fallbacks)


_REGISTERED = _registered_fallbacks()


def pricing_device(hardware: str) -> DeviceSpec:
    """The device a compiled step is priced on: a device preset, or the device of a cluster preset
    or of a JSON file of either (a profile ``coplan calibrate`` wrote for this machine)."""
    from coplan.hardware.registry import load_cluster

    return load_cluster(hardware, 1).devices[0]


def fallback_reason(op: str) -> str:
    """Why Inductor runs ``op`` (``aten.x.default`` or ``ns.op.overload``) as a fallback kernel."""
    if op.split(".")[0] not in ("aten", "prims"):
        return "a custom op: Inductor cannot see into it and calls it as is"
    if op in _REGISTERED:
        return "Inductor lowers it to the eager kernel on purpose (make_fallback in lowering.py)"
    return "no Inductor lowering for this op: an implicit fallback to the eager kernel"


def build_record(
    run: StepRun, *, model: str, batch: int, seq: int, device: torch.device, hardware: str, dtype: str
) -> dict[str, Any]:
    st = stages(run.collector.events)
    pricer = Pricer.of(pricing_device(hardware), dtype)
    table: list[dict[str, Any]] = []
    patterns: list[dict[str, Any]] = []
    fallbacks: dict[tuple[str, str], dict[str, Any]] = {}
    graphs = []
    op_to: dict[str, list[str]] = {}
    kernel_to: dict[str, list[str]] = {}
    for g in st.graphs:
        ks = kernels_of(g)
        nodes = {n["name"]: n for n in g.nodes}
        for k in ks:
            computing = [
                nodes[o] for o in k["ops"] if o in nodes and node_kind(nodes[o]) not in (None, OpKind.VIEW)
            ]
            k["aten"] = sorted({pattern_name(n) for n in computing})
            k["predicted_s"] = pricer.seconds(pricer.kernel(k, nodes, g.name))
            kid = f"{g.name}/{k['name']}"
            kernel_to[kid] = [f"{g.name}/{o}" for o in k["ops"]]
            for o in k["ops"]:
                op_to.setdefault(f"{g.name}/{o}", []).append(kid)
            if k["kind"] == "fallback":
                op = k.get("op") or k["name"]
                entry = fallbacks.setdefault(
                    (g.name, op),
                    {
                        "op": op,
                        "graph": g.name,
                        "kernel": k["name"],
                        "reason": fallback_reason(op),
                        "count": 0,
                    },
                )
                entry["count"] += 1
        g.kernels = ks
        patterns.extend(unfused(g, ks, pricer))
        final = [p for p in st.passes if p["graph"] == g.name]
        g.fingerprint = final[-1]["fingerprint"] if final else ""
        graphs.append(
            {
                "name": g.name,
                "fingerprint": g.fingerprint,
                "ops": sum(1 for n in g.nodes if n["op"] == "call_function"),
                "kernels": len(ks),
            }
        )
        table.extend({key: v for key, v in k.items() if key != "members"} for k in ks)
    opt = run.optimizer
    if not opt.get("compiled") and opt.get("elements"):
        eager = fused_optimizer_kernel(opt["elements"], opt["itemsize"])
        eager["predicted_s"] = pricer.seconds(pricer.kernel(eager, {}, "optimizer"))
        eager["aten"] = ["aten._fused_adamw_"]
        table.append({key: v for key, v in eager.items() if key not in ("members", "vec_flops")})
        kernel_to["optimizer/aten._fused_adamw_"] = []
    captures = [p["fingerprint"] for p in st.passes if p["stage"] == "capture"]
    samples = run.samples
    return {
        "schema": SCHEMA,
        "kind": "inspect",
        "model": model,
        "batch": batch,
        "seq": seq,
        "device": device.type,
        "hardware": hardware,
        "dtype": dtype,
        "fingerprint": digest([*captures, *(str(g["fingerprint"]) for g in graphs)]),
        "passes": st.passes,
        "graphs": graphs,
        "kernels": len(table),
        "kernel_table": table,
        "fallbacks": sorted(fallbacks.values(), key=lambda f: (f["graph"], f["op"])),
        "unfused": patterns,
        "lineage": {"op_to_kernels": op_to, "kernel_to_ops": kernel_to},
        "graph_breaks": st.graph_breaks,
        "notes": [
            f"could not read {e['where']}: {e['message']}"
            for e in run.collector.events
            if e["event"] == "error"
        ],
        "optimizer": {k: v for k, v in run.optimizer.items() if k not in ("elements", "itemsize")},
        "recompiles": st.recompiles,
        "bytes_moved": sum(int(k["bytes"]) for k in table),
        "predicted_step_s": sum(float(k["predicted_s"]) for k in table),
        "measured": {"step_s": median(samples), "samples": list(samples)} if samples else None,
        "compile_s": run.compile_s,
        "loss": run.loss,
        "record_id": None,
    }


def inspect_module(
    module: nn.Module,
    example_inputs: Sequence[Any] | Any = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    loss_fn: LossFn = default_loss,
    optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer] | None = None,
    steps: int = 3,
    hardware: str | None = None,
    name: str | None = None,
    batch: int = 0,
    seq: int = 0,
    inductor_config: Mapping[str, Any] | None = None,
    record: bool = False,
    db: str | Path | None = None,
) -> Inspection:
    """Compile one training step of ``module`` (forward on ``example_inputs``, ``loss_fn``,
    backward, one ``optimizer`` step: fused AdamW by default, ``step.adamw`` names the others)
    with ``torch.compile`` and report what the compiler did. ``steps`` more steps are timed after
    the compiling one. ``hardware`` names the coplan device preset the kernels are priced on
    (default: the local device's). ``inductor_config`` patches ``torch._inductor.config`` for this
    compile (to see what a setting changes). ``record`` (or a ``db`` path) stores the record in the
    history database."""
    from coplan.inspect import history

    if steps < 0:
        raise CoplanError(f"steps must be >= 0, got {steps}")
    args = tuple(example_inputs) if isinstance(example_inputs, list | tuple) else (example_inputs,)
    params = list(module.parameters())
    device = params[0].device if params else torch.device("cpu")
    dtype = str(params[0].dtype).removeprefix("torch.") if params else "float32"
    hw = hardware or hardware_for(device)
    pricing_device(hw)  # a bad name or file fails before the compile, not after
    path = history.check_writable(db or history.default_db_path()) if (record or db) else None
    run = run_step(
        module,
        args,
        kwargs,
        loss_fn=loss_fn,
        optimizer=optimizer,
        steps=steps,
        inductor_config=inductor_config,
    )
    rec = build_record(
        run,
        model=name or type(module).__name__,
        batch=batch,
        seq=seq,
        device=device,
        hardware=hw,
        dtype=dtype,
    )
    rec.update(history.record_context())
    if path is not None:
        rec["record_id"] = history.store(path, rec)
    return Inspection(rec)
