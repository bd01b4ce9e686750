"""What a rank's training step is made of, shared by the runner of flat layouts (``train``) and the
pipelined one (``pipeline``): the job a process runs and its result, the model and its batches,
the fp32 reference gradients, the peak tracker, the reductions across ranks, how the model is
compiled and its optimizer constructed for each run mode, and the step time read off a result.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from coplan.apply.backend import Backend
from coplan.apply.dist import full_grad
from coplan.apply.measure import LiveBytes, state_tensors, storages
from coplan.apply.precision import tolerance
from coplan.errors import CoplanError
from coplan.models.spec import ModelSpec
from coplan.models.transformer import Transformer
from coplan.plan.types import Plan

MODES = ("plan", "compile", "eager")


@dataclass(frozen=True, slots=True)
class Job:
    """One run: everything a process needs, as plain data (it crosses a process spawn)."""

    plan: dict[str, Any]
    spec: ModelSpec
    global_batch: int
    seq: int
    steps: int
    device: str = "cpu"
    threads: int = 0  # torch threads per process (0: the machine's cores / processes)
    seed: int = 0
    result: str = ""  # file the main rank writes its ``RankResult`` to (multi-process runs)
    # "plan": compiled with ``coplan.backend(plan)``; the baselines a plan is compared with keep
    # the plan's layout and batch but none of its other decisions: "compile" is
    # ``torch.compile(model)`` with Inductor's defaults, "eager" plain PyTorch, both in fp32 or,
    # for a 16-bit plan, under ``torch.autocast`` to its compute dtype (what AMP users run)
    mode: str = "plan"
    # "pinned": on a CPU, hold glibc malloc's thresholds at their steady state for the run
    # (``coplan.hardware.allocator``); "default": leave the allocator as the process found it
    host_allocator: str = "pinned"
    # mode "compile" only: PyTorch's own memory-budgeted partitioner
    # (``torch._functorch.config.activation_memory_budget``: 1 keeps the min-cut partitioner's
    # saved set, 0 recomputes all it can, in between a knapsack of the cheapest recomputations by
    # FLOPs); None leaves Inductor's default
    activation_budget: float | None = None


@dataclass
class RankResult:
    """What one run measured (the main rank's view, other ranks folded in)."""

    loss: list[float]
    step_times_s: list[float]
    timed_steps: list[int]
    saved: dict[str, int]
    peak_bytes: float
    max_rel_err: float
    worst_param: str
    regions: int
    recomputed: list[str]
    missing: list[str]
    fusion: list[dict[str, Any]]
    skipped_steps: int = 0
    notes: list[str] = field(default_factory=list)
    # what autograd saved in the first microbatch, by shape and dtype (``SavedBytes.by_shape``)
    saved_by_shape: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def batches(
    spec: ModelSpec, global_batch: int, seq: int, steps: int, seed: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The global batch of every step (the same on every rank, each takes its share)."""
    gen = torch.Generator().manual_seed(seed + 1)
    out = []
    for _ in range(steps):
        idx = torch.randint(0, spec.vocab_size, (global_batch, seq), generator=gen)
        tgt = torch.randint(0, spec.vocab_size, (global_batch, seq), generator=gen)
        out.append((idx, tgt))
    return out


#: The vocabulary rows a plan's LM head is padded to on a GPU (``Head.pad_to``): a multiple of 64,
#: as nanoGPT pads GPT-2's 50,257 to 50,304, keeps every GEMM of the head on cuBLAS's aligned
#: kernels (16 bytes) and its tiles whole. Off under tensor parallelism, whose head is a DTensor.
HEAD_PAD = 64


def build(spec: ModelSpec, seed: int, pad_to: int = 0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(spec)
    model.lm_head.pad_to = pad_to
    return model


def pads_head(mode: str, tp: int) -> bool:
    """Whether a run in ``mode`` pads its LM head itself: a plan without tensor parallelism (the
    stack it is priced as pads, ``gemm_padding``); baselines run the model as it is (eager) or as
    ``torch.compile`` pads it."""
    return mode == "plan" and tp == 1


def head_pad(job: Job, device: torch.device, tp: int) -> int:
    """The rows ``job``'s LM head is padded to (``pads_head``; on a GPU only, where alignment
    matters), 0 for none."""
    return HEAD_PAD if device.type == "cuda" and pads_head(job.mode, tp) else 0


def reference_grads(
    model: Transformer,
    idx: torch.Tensor,
    tgt: torch.Tensor,
    device: torch.device | None = None,
    chunk: int = 0,
) -> dict[str, torch.Tensor]:
    """Gradients of the eager fp32 model on the whole global batch, on ``device``, accumulated over
    chunks of ``chunk`` sequences (the mean of equal-sized chunks' mean losses is the batch's mean
    loss, so the gradient is the same; chunks keep an fp32 reference inside a GPU whose memory the
    plan under test fills). The model goes back to the CPU afterwards."""
    device = device or torch.device("cpu")
    model.to(device).zero_grad(set_to_none=True)
    n = idx.shape[0]
    chunk = max(1, min(chunk or n, n))
    if n % chunk:
        chunk = 1
    for a in range(0, n, chunk):
        (model(idx[a : a + chunk].to(device), tgt[a : a + chunk].to(device)) * (chunk / n)).backward()
    out = {n: p.grad.detach().cpu().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    model.to("cpu")
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def rel_errors(
    model: torch.nn.Module, ref: dict[str, torch.Tensor], perms: dict[str, torch.Tensor]
) -> tuple[float, str]:
    """(largest relative gradient error over parameters, its name). Every rank must call this
    (gathering a sharded gradient is collective)."""
    worst, name = 0.0, ""
    for n, p in model.named_parameters():
        g = full_grad(p)
        if g is None or n not in ref:
            continue
        want = ref[n]
        if n in perms:
            want = want[perms[n]]
        want = want.to(g.device)
        err = float((g.float() - want).norm() / want.norm().clamp(min=1e-30))
        if not math.isfinite(err):
            err = math.inf
        if err > worst or not name:
            worst, name = err, n
    return worst, name


@contextmanager
def peak_tracker(
    device: torch.device, model: torch.nn.Module, opt: torch.optim.Optimizer
) -> Iterator[list[float]]:
    """Yields a one-element list that holds the step's peak live bytes afterwards."""
    out = [0.0]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        yield out
        torch.cuda.synchronize(device)
        out[0] = float(torch.cuda.max_memory_allocated(device))
        return
    state = storages(state_tensors(model, opt))
    tracker = LiveBytes(base=sum(state.values()), exclude=state)
    with tracker:
        yield out
    out[0] = float(tracker.peak_bytes)


def all_max(values: list[float], world: int) -> list[float]:
    if world == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return t.tolist()


def all_mean(values: list[float], world: int) -> list[float]:
    if world == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64)
    torch.distributed.all_reduce(t)
    return (t / world).tolist()


#: tokens per chunk of the fp32 reference on a GPU: its activations are twice a bf16 step's per
#: token, and its loss holds fp32 logit-sized tensors (Llama 3's 128K vocabulary: 0.5 MB each per
#: token), so 16K tokens of Llama 3.2 1B at once hold about 80 GB (twice the 36 GB its bf16 eager
#: step is priced to save, and the logits), more than a GPU has beside a plan that fills it
REFERENCE_TOKENS = 4096


def reference_chunk(micro: int, seq: int, device: torch.device) -> int:
    """Sequences per chunk of the fp32 reference: the plan's microbatch on a CPU (memory is not
    what is measured there), at most ``REFERENCE_TOKENS`` tokens on a GPU the plan fills."""
    if device.type == "cpu":
        return micro
    return max(1, min(micro, REFERENCE_TOKENS // seq))


def adamw_form(mode: str, fused: bool) -> dict[str, bool]:
    """How AdamW runs (``coplan.cost.optimizer`` prices each form): fused where the plan fuses
    its optimizer ops; a baseline as PyTorch constructs it by default (the multi-tensor form on a
    GPU, the per-parameter loop on a CPU: what a user of eager PyTorch or ``torch.compile``
    gets); a plan that leaves its optimizer ops unfused, one kernel sequence per parameter."""
    if fused:
        return {"fused": True}
    return {} if mode != "plan" else {"foreach": False}


def compile_for(
    module: torch.nn.Module, plan: Plan, spec: ModelSpec, mode: str
) -> tuple[Any, Backend | None]:
    """(``module`` as ``mode`` runs it, the plan's backend or None): compiled with
    ``coplan.backend(plan)``, with Inductor's defaults (``compile``), or as it is (``eager``)."""
    if mode not in MODES:
        raise CoplanError(f"run mode must be one of {', '.join(MODES)}, got {mode!r}")
    be = Backend(plan, spec) if mode == "plan" else None
    # a process that already compiled this model's code (an earlier run) would reuse that graph,
    # which holds the earlier plan's backend: start from an empty cache
    torch._dynamo.reset()
    if be is not None:
        return torch.compile(module, backend=be), be
    if mode == "compile":
        return torch.compile(module), None
    return module, None


def autocast_for(plan: Plan, device: torch.device, be: object | None) -> Callable[[], Any]:
    """The context a baseline step runs in (``be is None``: not compiled by coplan's backend):
    autocast to the plan's 16-bit dtype (autocast offers bf16 and fp16: an fp8 plan's baseline
    runs bf16, a tf32 one fp32); coplan's backend casts by itself, so its steps get none."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}.get(plan.precision.compute)
    if be is not None or dtype is None:
        return nullcontext
    return lambda: torch.autocast(device.type, dtype=dtype)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_time(res: RankResult) -> float:
    return statistics.median(res.step_times_s[i] for i in res.timed_steps)


def tolerance_of(plan: Plan, layers: int) -> float:
    return tolerance(plan.precision, layers)
