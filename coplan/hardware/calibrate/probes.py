"""The microbenchmarks: timed torch kernels on one device, and collectives over spawned processes.

A probe is a measurement waiting to be timed; ``run_probes`` times the whole list in several rounds
and keeps each probe's fastest round.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import socket
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from coplan.hardware.calibrate.fit import Measurement

# --- timing -----------------------------------------------------------------------------------------


class _Clock:
    """Times a callable on one device: enough calls per sample to last ``target_s``, then the median
    of ``samples`` samples (the median shrugs off a sample disturbed by another process)."""

    def __init__(self, device: str, *, target_s: float, samples: int) -> None:
        self.cuda = device == "cuda"
        self.target_s, self.samples = target_s, samples

    def run(self, fn: Callable[[], object], n: int) -> float:
        """Seconds per call over ``n`` calls."""
        if self.cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        if self.cuda:
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) / n

    def time(self, fn: Callable[[], object]) -> float:
        # warm-up: lazy initialisation, and the allocator settling on reusing freed blocks (the first
        # large allocations of a size page-fault fresh memory in)
        warm = time.perf_counter()
        per = self.run(fn, 1)
        while time.perf_counter() - warm < self.target_s / 2:
            per = self.run(fn, 1)
        n = max(1, min(1 << 16, round(self.target_s / max(per, 1e-9))))
        return statistics.median(self.run(fn, n) for _ in range(self.samples))


@dataclass(frozen=True, slots=True)
class Probe:
    """A microbenchmark before it is timed: the measurement it will make, and how to time it
    (``timer(clock)`` -> seconds per call)."""

    template: Measurement
    timer: Callable[[_Clock], float]


def _probe(kind: str, name: str, dtype: str, fn: Callable[[], object], **fields: Any) -> Probe:
    return Probe(Measurement(kind, name, dtype, 0.0, **fields), lambda clock: clock.time(fn))


def run_probes(
    probes: Sequence[Probe],
    clock: _Clock,
    passes: int,
    tick: Callable[[str], None],
    between: Callable[[int], None] | None = None,
) -> list[Measurement]:
    """Time every probe ``passes`` times, in rounds over the whole list, and keep each probe's
    fastest round: another process stealing a core for a second then spoils one round of a few
    probes, not every sample of them (on a shared 2-core VM a contended parallel op waits a whole
    scheduler tick, milliseconds, however small it is). ``between(i)`` runs after pass ``i``: work
    to be measured under the same conditions (an accuracy benchmark's own timings) interleaved with
    the passes, so that a slow minute of the host spoils a share of both, not all of one."""
    best = [math.inf] * len(probes)
    for n in range(passes):
        for i, probe in enumerate(probes):
            best[i] = min(best[i], probe.timer(clock))
            tick(probe.template.name)
        if between is not None:
            between(n)
    return [replace(p.template, seconds=max(t, 1e-9)) for p, t in zip(probes, best, strict=True)]


# --- microbenchmarks --------------------------------------------------------------------------------

_TORCH_DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

#: A GEMM to time: (M, N, K, layout). Layouts as training issues them: "nt" is ``x @ W.T`` (a
#: Linear's forward), "nn" ``g @ W`` (its input gradient), "tn" ``g.T @ x`` (its weight gradient).
Gemm = tuple[int, int, int, str]


def transformer_gemms(tokens: int, d: int, vocab: int, *, every: bool = True) -> tuple[Gemm, ...]:
    """The GEMMs one GPT block and LM head issue for ``tokens`` tokens of width ``d`` (QKV, output
    projection, MLP up and down, LM head; forward, input and weight gradients). The weight
    gradients reduce over the tokens, a shape no square benchmark shows (a bf16 GEMM with a long
    K runs several times slower per FLOP on some CPUs); ``every=False`` keeps one of each kind."""
    t, f, v = tokens, 4 * d, vocab
    fwd: tuple[Gemm, ...] = (
        (t, 3 * d, d, "nt"),
        (t, d, d, "nt"),
        (t, f, d, "nt"),
        (t, d, f, "nt"),
        (t, v, d, "nt"),
    )
    dgrad: tuple[Gemm, ...] = ((t, d, 3 * d, "nn"), (t, f, d, "nn"), (t, d, f, "nn"), (t, d, v, "nn"))
    wgrad: tuple[Gemm, ...] = ((3 * d, d, t, "tn"), (f, d, t, "tn"), (d, f, t, "tn"), (v, d, t, "tn"))
    if not every:
        return (fwd[0], fwd[4], dgrad[1], wgrad[0], wgrad[3])
    return fwd + dgrad + wgrad


@dataclass(frozen=True, slots=True)
class Plan:
    """The microbenchmark sizes of a run (``quick`` trims every list)."""

    matmul: tuple[Gemm, ...]
    attention: tuple[tuple[int, int, int, int], ...]  # (batch, heads, seq, head dim)
    vector_sizes: tuple[int, ...]  # elements
    collective_bytes: tuple[int, ...]
    target_s: float
    samples: int
    passes: int

    @classmethod
    def of(cls, device: str, quick: bool) -> Plan:
        # a GPU needs larger problems to leave the launch-bound regime, and vector operands well
        # past its L2 cache (tens of MB) to measure memory rather than cache bandwidth
        g, v = (1, 1) if device == "cpu" else (4, 16)
        if quick:
            squares: tuple[Gemm, ...] = ((128 * g, 128 * g, 128 * g, "nn"), (512 * g, 512 * g, 512 * g, "nn"))
            mm = squares + transformer_gemms(1024 * g, 256 * g, 2048 * g, every=False)
            attn: tuple[tuple[int, int, int, int], ...] = ((2, 4, 128, 32), (4, 4, 256, 64))
            return cls(mm, attn, (v << 16, v << 20), (1 << 12, 1 << 18, 1 << 22), 0.003, 3, 2)
        squares = tuple((n * g, n * g, n * g, "nn") for n in (64, 128, 256, 512, 1024))
        mm = squares + transformer_gemms(2048 * g, 256 * g, 4096 * g)
        mm += transformer_gemms(512 * g, 384 * g, 8192 * g, every=False)
        # sequence lengths 64 to 1024 and head dims 32 to 128: a CPU's flash kernel slows with both,
        # and its tiles grow from 32 to 64 to 256 query rows at 192 and 768 (``coplan.hardware.tiling``)
        attn = (
            (1, 4, 1024, 64),
            (2, 4, 64, 32),
            (4, 4, 128, 32),
            (4, 4, 256, 32),
            (4, 4, 128, 64),
            (8, 4, 256, 64),
            (2, 8, 512, 64),
            (4, 6, 256, 64),
            (2, 4, 256, 128),
        )
        # from 64Ki elements: below that a CPU op's time is its dispatch, whatever it computes
        vec = tuple(v << b for b in (16, 18, 20, 22))
        return cls(mm, attn, vec, (1 << 10, 1 << 14, 1 << 17, 1 << 20, 1 << 22, 1 << 24), 0.01, 3, 3)


def _flops(fn: Callable[[], object]) -> float:
    from torch.utils.flop_counter import FlopCounterMode

    import coplan.capture.flops  # noqa: F401  (registers the CPU attention formulas capture uses)

    with FlopCounterMode(display=False) as counter:
        fn()
    return float(counter.get_total_flops())


def _count(n: int) -> str:
    """``65536`` -> ``"64Ki"``: sizes in microbenchmark names (they are powers of two)."""
    for shift, unit in ((30, "Gi"), (20, "Mi"), (10, "Ki")):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


def _nbytes(*ts: torch.Tensor) -> float:
    return float(sum(t.numel() * t.element_size() for t in ts))


class _TF32:
    """TF32 matmuls on (CUDA), for the duration of the timed calls only."""

    def __init__(self, fn: Callable[[], object]) -> None:
        self.fn = fn

    def __call__(self) -> object:
        was = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = True
        try:
            return self.fn()
        finally:
            torch.backends.cuda.matmul.allow_tf32 = was


class _Rotate:
    """Calls ``fns`` in turn: kernels whose operands were last touched long ago, as in training
    (weights since the previous step, activations many kernels back), not the cache-hot operands a
    kernel repeated on the same tensors sees."""

    def __init__(self, fns: Sequence[Callable[[], object]]) -> None:
        self.fns, self.i = list(fns), 0

    def __call__(self) -> object:
        self.i = (self.i + 1) % len(self.fns)
        return self.fns[self.i]()


def _copies(nbytes: float, cache_bytes: int, most: int) -> int:
    """Operand copies (at most ``most``) whose traffic of ``nbytes`` each overflows twice the cache."""
    return max(1, min(most, math.ceil(2 * cache_bytes / nbytes)))


def _rotation(fns: Sequence[Callable[[], object]]) -> Callable[[], object]:
    return _Rotate(fns) if len(fns) > 1 else fns[0]


def matmul_probes(dev: str, dtypes: Sequence[str], plan: Plan, cache_bytes: int = 0) -> list[Probe]:
    """GEMMs of ``plan``, each over enough operand copies (up to 8) to overflow ``cache_bytes``."""
    out = []
    for dtype in dtypes:
        kind = _TORCH_DTYPES[dtype]
        for m, n, k, layout in plan.matmul:
            operand_bytes = (m * k + k * n) * torch.empty((), dtype=kind).element_size()
            copies = _copies(operand_bytes, cache_bytes, 8)
            fns: list[Callable[[], object]] = []
            for _ in range(copies):
                # stored as training stores them: a transposed operand is a view of a contiguous one
                a = (
                    torch.randn(k, m, dtype=kind, device=dev).t()
                    if layout == "tn"
                    else torch.randn(m, k, dtype=kind, device=dev)
                )
                b = (
                    torch.randn(n, k, dtype=kind, device=dev).t()
                    if layout == "nt"
                    else torch.randn(k, n, dtype=kind, device=dev)
                )
                fns.append(partial(torch.mm, a, b))
            fn = _rotation(fns)
            if dtype == "tf32":
                fn = _TF32(fn)
            nbytes = operand_bytes + m * n * torch.empty((), dtype=kind).element_size()
            out.append(
                _probe(
                    "matmul",
                    f"mm {layout} {m}x{n}x{k}",
                    dtype,
                    fn,
                    flops=2.0 * m * n * k,
                    bytes=nbytes,
                    dims=(m, n, k),
                    layout=layout,
                )
            )
    return out


def attention_probes(dev: str, dtypes: Sequence[str], plan: Plan) -> list[Probe]:
    """Causal fused attention forward, and its backward alone (the graph kept between calls)."""
    out = []
    for dtype in dtypes:
        for b, h, s, d in plan.attention:
            q, k, v = (
                torch.randn(b, h, s, d, dtype=_TORCH_DTYPES[dtype], device=dev, requires_grad=True)
                for _ in "qkv"
            )

            def fwd(q: torch.Tensor = q, k: torch.Tensor = k, v: torch.Tensor = v) -> object:
                with torch.no_grad():
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True)

            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            go = torch.randn_like(o)

            def bwd(
                o: torch.Tensor = o, go: torch.Tensor = go, qkv: tuple[torch.Tensor, ...] = (q, k, v)
            ) -> object:
                return torch.autograd.grad(o, qkv, go, retain_graph=True)

            geo, name, size = (b * h, s, s, d), f"sdpa {b}x{h}x{s}x{d}", _nbytes(q)
            out.append(_probe("attention", name, dtype, fwd, flops=_flops(fwd), bytes=4 * size, dims=geo))
            out.append(
                _probe(
                    "attention",
                    name + " bwd",
                    dtype,
                    bwd,
                    flops=_flops(bwd),
                    bytes=8 * size,
                    dims=geo,
                    phase="backward",
                )
            )
    return out


#: The vector family (``VECTOR_FAMILIES``) of each vector microbenchmark.
_FAMILY = {
    "add": "elementwise",
    "mul": "elementwise",
    "addcmul": "elementwise",
    "gelu": "transcendental",
    "gelu_bwd": "transcendental",
    "sqrt": "transcendental",
    "sum": "reduction",
    "layer_norm": "norm",
    "layer_norm_bwd": "norm",
    "log_softmax": "softmax",
    "log_softmax_bwd": "softmax",
}


def _vector_cases(n: int, dtype: torch.dtype, dev: str) -> list[tuple[str, str, Callable[[], object], float]]:
    """(name, aten op whose rule counts its vector FLOPs, call, bytes read and written): the
    non-matrix kernels a GPT training step spends its vector time in, forward and backward, and an
    optimizer update's two-FLOP elementwise op."""
    aten = torch.ops.aten
    x = torch.randn(n, dtype=dtype, device=dev)
    y = torch.randn(n, dtype=dtype, device=dev)
    width = min(n, 256)
    rows = x.view(-1, width)
    w = torch.ones(width, dtype=dtype, device=dev)
    bias = torch.zeros(width, dtype=dtype, device=dev)
    _, mean, rstd = aten.native_layer_norm(rows, [width], w, bias, 1e-5)
    soft = x.view(-1, min(n, 1024))
    logp = F.log_softmax(soft, dim=-1)
    e, stats = x.element_size(), _nbytes(mean, rstd)
    pos = x.abs() + 0.5  # AdamW's denominators: positive (a square root of zero takes a slow path)
    mask = [True, True, True]
    return [
        ("add", "add", lambda: x + y, 3 * n * e),
        ("mul", "mul", lambda: x * y, 3 * n * e),
        ("addcmul", "addcmul", lambda: torch.addcmul(x, y, y, value=0.5), 3 * n * e),
        ("sqrt", "sqrt", lambda: pos.sqrt(), 2 * n * e),
        ("gelu", "gelu", lambda: F.gelu(x, approximate="tanh"), 2 * n * e),
        ("gelu_bwd", "gelu_backward", lambda: aten.gelu_backward(y, x, approximate="tanh"), 3 * n * e),
        ("sum", "sum", lambda: x.sum(), n * e),
        (
            "layer_norm",
            "native_layer_norm",
            lambda: aten.native_layer_norm(rows, [width], w, bias, 1e-5),
            2 * n * e + stats,
        ),
        (
            "layer_norm_bwd",
            "native_layer_norm_backward",
            lambda: aten.native_layer_norm_backward(rows, rows, [width], mean, rstd, w, bias, mask),
            3 * n * e + stats,
        ),
        ("log_softmax", "_log_softmax", lambda: F.log_softmax(soft, dim=-1), 2 * n * e),
        (
            "log_softmax_bwd",
            "_log_softmax_backward_data",
            lambda: aten._log_softmax_backward_data(soft, logp, -1, dtype),
            3 * n * e,
        ),
    ]


def vector_probes(dev: str, dtypes: Sequence[str], plan: Plan, cache_bytes: int = 0) -> list[Probe]:
    """Non-matrix kernels of ``plan``'s sizes, each over enough operand copies (up to 64) for its
    reads and writes to overflow ``cache_bytes``: a training step's activations and optimizer
    state stream through a footprint larger than the last-level cache, so its elementwise kernels
    read their operands from memory; one op repeated on one small tensor measures the cache."""
    from coplan.ir.oprules import rule_for

    out = []
    for dtype in dtypes:
        for n in plan.vector_sizes:
            first = _vector_cases(n, _TORCH_DTYPES[dtype], dev)
            # each case over as many copies as its own traffic needs (a sum reads one tensor)
            counts = [_copies(case[3], cache_bytes, 64) for case in first]
            sets = [first] + [_vector_cases(n, _TORCH_DTYPES[dtype], dev) for _ in range(max(counts) - 1)]
            for i, (name, op, _fn, nbytes) in enumerate(first):
                fn = _rotation([cases[i][2] for cases in sets[: counts[i]]])
                flops = rule_for(op, pointwise=True).flops_per_element * n
                fields = {"vec_flops": flops, "bytes": nbytes, "dims": (n,), "family": _FAMILY[name]}
                out.append(_probe("vector", f"{name} {_count(n)}", dtype, fn, **fields))
    return out


class _FreshWrite:
    """Fill newly mapped memory as an fp32 tensor, then unmap it: what a host allocator does for a
    tensor too large for its heap (glibc maps it afresh and unmaps it on free), so every first write
    page-faults its pages in. Mapped here directly, so that the heap's state (a preceding workload
    may leave room enough to serve the block without faults) cannot hide the cost."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes

    def __call__(self) -> object:
        m = mmap.mmap(-1, self.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        t = torch.frombuffer(m, dtype=torch.float32)
        t.fill_(1.0)
        del t  # the tensor holds the buffer: release it before unmapping
        m.close()
        return None


def first_touch_probes(cache_bytes: int) -> list[Probe]:
    """Writing fresh memory as large as the cache, and twice that (what a training step's logits
    and their gradients pay every step on a CPU). None where the OS offers no anonymous mappings."""
    if not hasattr(mmap, "MAP_ANONYMOUS"):
        return []
    out = []
    for size in (cache_bytes, 2 * cache_bytes):
        n = max(1, size // 4)
        name = f"fresh {_count(n * 4)}B"
        out.append(_probe("first_touch", name, "fp32", _FreshWrite(n * 4), bytes=float(n * 4), dims=(n,)))
    return out


def _chain_slope(
    dev: str, link: Callable[[torch.Tensor], torch.Tensor], ops: int
) -> Callable[[_Clock], float]:
    """Seconds per op of a tiny autograd chain: ``link`` applied to 8 elements 16 and 48 times,
    then differentiated, ``ops`` ops a link forward and backward together; the slope between the
    two lengths drops the chain's fixed costs (starting backward)."""
    a = torch.ones(8, device=dev)
    x = torch.ones(8, device=dev, requires_grad=True)

    def chain(links: int) -> Callable[[], object]:
        def run() -> object:
            z = x * 1.0
            for _ in range(links):
                z = link(z)
            return torch.autograd.grad(z, x, a)

        return run

    short, long = chain(16), chain(48)
    return lambda c: (c.time(long) - c.time(short)) / (ops * (48 - 16))


def launch_probes(dev: str) -> list[Probe]:
    """Bare dispatch of a tiny op (reported, not fitted), and the per-kernel cost of a tiny autograd
    chain of multiplications: one kernel a link forward and its gradient multiplication backward."""
    a = torch.ones(8, device=dev)

    def bare() -> object:
        with torch.no_grad():
            return a + a

    # 8 elements of work is nothing next to the dispatch: priced as pure launch cost
    per_kernel = Measurement("launch", "launch: autograd, per kernel", "fp32", 0.0, dims=(8,))
    return [
        Probe(replace(per_kernel, name="launch: bare dispatch", used=False), lambda c: c.time(bare)),
        Probe(per_kernel, _chain_slope(dev, lambda z: z * 1.0001, 2)),
    ]


def host_op_probes(dev: str) -> list[Probe]:
    """The host's cost of a view in eager training: a chain of reshapes recorded by autograd and
    differentiated, 2 views a link forward and their 2 gradient views backward (the ops a captured
    graph holds for them)."""
    per_op = Measurement("host_op", "host op: view, per op", "fp32", 0.0, dims=(8,))
    return [Probe(per_op, _chain_slope(dev, lambda z: z.view(2, 4).view(8), 4))]


# --- collectives ------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _collective_worker(
    rank: int, world: int, dev: str, port: int, sizes: Sequence[int], target_s: float, samples: int, out: str
) -> None:
    """One spawned rank: time all-reduce and all-gather of each size; rank 0 writes the results."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    backend = "nccl" if dev == "cuda" else "gloo"
    if dev == "cuda":
        torch.cuda.set_device(rank)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group(backend, rank=rank, world_size=world)
    device = torch.device(dev, rank) if dev == "cuda" else torch.device("cpu")
    clock = _Clock(dev, target_s=target_s, samples=1)
    rows = []

    def agreed(value: float) -> float:
        # every rank must issue the same number of calls and report one number: rank 0's choice
        # of call count, the slowest rank's time
        t = torch.tensor([value], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    try:
        for size in sizes:
            n = max(world, size // 4 // world * world)
            buf = torch.ones(n, dtype=torch.float32, device=device)
            parts = [torch.empty(n // world, dtype=torch.float32, device=device) for _ in range(world)]
            mine = torch.ones(n // world, dtype=torch.float32, device=device)
            for name, fn in (
                ("all_reduce", lambda buf=buf: dist.all_reduce(buf)),
                ("all_gather", lambda parts=parts, mine=mine: dist.all_gather(parts, mine)),
            ):
                first = agreed(clock.run(fn, 2))
                calls = int(agreed(max(1.0, min(4096.0, round(target_s / max(first, 1e-9))))))
                times = []
                for _ in range(samples):
                    dist.barrier()
                    times.append(clock.run(fn, calls))
                rows.append((name, n * 4, agreed(statistics.median(times))))
    finally:
        dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps({"backend": backend, "rows": rows}))


def measure_collectives(
    dev: str, procs: int, plan: Plan, tick: Callable[[str], None]
) -> tuple[list[Measurement], str]:
    from coplan.procs import spawn

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "collectives.json")
        args = (procs, dev, _free_port(), plan.collective_bytes, plan.target_s, plan.samples, out)
        spawn(_collective_worker, procs, args)
        data = json.loads(Path(out).read_text())
    tick(f"collectives over {procs} processes")
    ms = [
        Measurement(
            "collective", f"{name} {_count(nbytes)}B", "fp32", seconds, 0.0, 0.0, float(nbytes), (procs,)
        )
        for name, nbytes, seconds in data["rows"]
    ]
    return ms, str(data["backend"])
