"""Measuring instruments shared by ``coplan run`` and the benchmarks: live memory on a CPU, saved
activation bytes of an eager step, and rank statistics."""

from __future__ import annotations

import math
import statistics
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    """Peak bytes of tensor storages alive while the mode is active, on top of ``base`` bytes.

    Every storage an op returns is counted once, from its first appearance until it is freed
    (a weak reference's callback); storages that existed before (``exclude``: parameters,
    gradients, optimizer state, the batch) are in ``base`` instead. This is what an allocator
    without caching holds, which is what the cost model's peak is (no fragmentation, no cache).
    It sits below autograd and compilation, so it neither changes nor recompiles the step
    (``torch.distributed._tools.mem_tracker`` installs module hooks, which make Dynamo recompile).
    It says it ignores compile internals (``ignore_compile_internals``): Dynamo refuses to run
    compiled code under any other dispatch mode and marks the frame to be skipped from then on,
    so the step under the tracker, and every step after it, would run eagerly, without the plan.
    """

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __init__(self, base: int = 0, exclude: Iterable[int] = ()) -> None:
        super().__init__()
        self.base = base
        self.live = 0
        self.peak = 0
        self._known: set[int] = set(exclude)
        self._refs: list[Any] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and not t.is_meta:
                self._track(t)
        return out

    def _track(self, t: torch.Tensor) -> None:
        try:
            st = t.untyped_storage()
            ptr = st.data_ptr()
        except (RuntimeError, NotImplementedError):  # subclasses without storage; storages freed
            return  # by resizing to zero (FSDP2's unsharded parameters)
        if ptr in self._known or ptr == 0:
            return
        self._known.add(ptr)
        size = st.nbytes()
        self.live += size
        self.peak = max(self.peak, self.live)

        def freed(_: object, ptr: int = ptr, size: int = size) -> None:
            self.live -= size
            self._known.discard(ptr)

        self._refs.append(weakref.ref(st, freed))

    @property
    def peak_bytes(self) -> int:
        return self.base + self.peak


def storages(tensors: Iterable[torch.Tensor]) -> dict[int, int]:
    """Distinct storages of ``tensors``: pointer -> bytes (local shards of distributed tensors)."""
    out: dict[int, int] = {}
    for t in tensors:
        local: Callable[[], torch.Tensor] | None = getattr(t, "to_local", None)
        x = local() if local is not None else t
        st = x.untyped_storage()
        out.setdefault(st.data_ptr(), st.nbytes())
    return out


def state_tensors(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Parameters, gradients and optimizer state: what lives across steps."""
    out: list[torch.Tensor] = []
    for p in model.parameters():
        out.append(p)
        if p.grad is not None:
            out.append(p.grad)
    for state in opt.state.values():
        out.extend(v for v in state.values() if isinstance(v, torch.Tensor))
    return out


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


class SavedBytes:
    """Storages autograd saves for backward while active (``saved_tensors_hooks``): eager ops and
    compiled regions alike (a compiled forward's saved values pass through the same hooks).

    Parameters (leaves that require grad, as autograd sees them: FSDP2's unsharded parameters
    too), views of them (``weight.t()``) and the storages in ``exclude`` (the batch) are left
    out; ``activation_bytes(other)`` also leaves out storages a compiled region reported as
    parameter copies or inputs.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._skip = set(storages(exclude))
        self.seen: dict[int, int] = {}
        # the shape and dtype each storage was first saved as (``by_shape``)
        self.kinds: dict[int, tuple[tuple[int, ...], str]] = {}
        self._hooks: Any = None

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        # a parameter, or a view of one: an eager ``linear`` saves ``weight.t()`` (FSDP2's root,
        # which runs eagerly, would otherwise count its all-gathered LM head as an activation)
        base = t._base if t._base is not None else t
        if t.device.type == "meta" or (base.is_leaf and base.requires_grad):
            return t
        local: Callable[[], torch.Tensor] | None = getattr(t, "to_local", None)
        st = (local() if local is not None else t).untyped_storage()
        ptr = st.data_ptr()
        if ptr not in self._skip and ptr not in self.seen:
            self.seen[ptr] = st.nbytes()
            self.kinds[ptr] = (tuple(t.shape), str(t.dtype).removeprefix("torch."))
        return t

    def __enter__(self) -> SavedBytes:
        # the hook runs inside frames Dynamo may be compiling: keep it out of their graphs
        pack = torch.compiler.disable(self._pack)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, _unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)

    def activation_bytes(self, other: Iterable[int] = ()) -> int:
        drop = set(other)
        return sum(b for p, b in self.seen.items() if p not in drop)

    def by_shape(self, other: Iterable[int] = (), top: int = 16) -> list[dict[str, Any]]:
        """The activation storages by the shape and dtype they were saved as, largest total first:
        what a compiler's partitioner kept, to set beside what a plan was priced to keep."""
        drop = set(other)
        groups: dict[tuple[tuple[int, ...], str], list[int]] = {}
        for p, b in self.seen.items():
            if p not in drop:
                groups.setdefault(self.kinds.get(p, ((), "?")), []).append(b)
        ranked = sorted(groups.items(), key=lambda kv: -sum(kv[1]))[:top]
        return [
            {"shape": list(shape), "dtype": dtype, "count": len(bs), "bytes": sum(bs)}
            for (shape, dtype), bs in ranked
        ]


class _Held:
    """What autograd keeps for one saved tensor while ``SavedPeak`` is active: the tensor, and a
    lifetime (autograd drops it when the graph that saved it is freed, after its backward)."""

    __slots__ = ("__weakref__", "t")

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


def _unpack_held(x: Any) -> Any:
    return x.t if isinstance(x, _Held) else x


class SavedPeak(SavedBytes):
    """Activation bytes kept for backward *at once* while active, at their peak: a storage counts
    from the first time autograd saves it until the last graph holding it is freed (after its
    backward), whether or not the storage itself lives on; ``hold`` adds storages kept outside
    autograd until they are freed (a pipeline stage's output, which the stage keeps until the
    gradient for it arrives). A pipeline schedule's peak is then its in-flight microbatches'
    activations. Parameters are told apart by storage (``exclude``), not as leaves: a stage's
    received input is a leaf that requires grad, and an activation. ``peak_bytes(other)`` replays
    the events without the storages in ``other`` (parameter copies a compiled region reported)."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        super().__init__(exclude)
        self.events: list[tuple[int, int]] = []  # (storage pointer, +bytes when kept / -bytes when let go)
        self._holders: dict[int, int] = {}  # storage pointer -> saves (or holds) not yet released
        self._refs: list[Any] = []

    def _storage(self, t: torch.Tensor) -> tuple[int, int, Any] | None:
        if t.device.type == "meta":
            return None
        local: Callable[[], torch.Tensor] | None = getattr(t, "to_local", None)
        st = (local() if local is not None else t).untyped_storage()
        ptr = st.data_ptr()
        if ptr in self._skip or ptr == 0:
            return None
        return ptr, st.nbytes(), st

    def _keep(self, ptr: int, size: int) -> None:
        n = self._holders.get(ptr, 0)
        self._holders[ptr] = n + 1
        if n == 0:
            self.seen[ptr] = size
            self.events.append((ptr, size))

    def _release(self, ptr: int, size: int) -> None:
        n = self._holders.get(ptr, 0) - 1
        if n > 0:
            self._holders[ptr] = n
            return
        self._holders.pop(ptr, None)
        self.events.append((ptr, -size))

    def _pack(self, t: torch.Tensor) -> Any:
        got = self._storage(t)
        if got is None:
            return t
        ptr, size, _ = got
        self._keep(ptr, size)
        held = _Held(t)
        self._refs.append(weakref.ref(held, self._releaser(ptr, size)))
        return held

    def _releaser(self, ptr: int, size: int) -> Callable[[object], None]:
        return lambda _: self._release(ptr, size)

    def hold(self, out: Any) -> Any:
        for t in tree_leaves(out):
            got = self._storage(t) if isinstance(t, torch.Tensor) else None
            if got is not None:
                ptr, size, st = got
                self._keep(ptr, size)
                self._refs.append(weakref.ref(st, self._releaser(ptr, size)))
        return out

    def __enter__(self) -> SavedPeak:
        pack = torch.compiler.disable(self._pack)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, torch.compiler.disable(_unpack_held))
        self._hooks.__enter__()
        return self

    def peak_bytes(self, other: Iterable[int] = ()) -> int:
        drop = set(other)
        live = peak = 0
        for ptr, delta in self.events:
            if ptr not in drop:
                live += delta
                peak = max(peak, live)
        return peak


def eager_saved_bytes(fn: Callable[[], Any], exclude: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages autograd saves while ``fn`` runs (each storage once,
    parameters and ``exclude``'s storages left out): eager autograd's saved set."""
    with SavedBytes(exclude) as sb:
        out = fn()
    del out
    return sb.activation_bytes()


def ranks(values: Sequence[float]) -> list[float]:
    """1-based ranks, ties sharing their average rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation: Pearson's correlation of the ranks."""
    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    var = math.sqrt(sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb))
    return cov / var if var else 0.0
