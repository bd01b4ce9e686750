"""The plan's parallel layout through ``torch.distributed``, and launching the processes.

Applied in this order (torchtitan's): tensor parallelism (``apply_tp``), then data parallelism
(``apply_dp``: DDP for ZeRO 0, FSDP2 ``fully_shard`` per block and at the root for ZeRO >= 1),
then ``torch.compile`` with the plan's backend (``coplan.apply.step``). The device mesh is
``(dp, tp)`` with the tensor axis fastest, Megatron's rank order.

Processes are started by ``launch`` (``coplan.procs.spawn``: the spawn method, gloo on CPU and
NCCL on CUDA), or by ``torchrun``, whose environment (``RANK``, ``WORLD_SIZE``, ...) is used
as it is. Pipeline parallelism (``pp > 1``, alone) is ``coplan.apply.pipeline``.
"""

from __future__ import annotations

import os
import socket
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from coplan.errors import CoplanError
from coplan.models.transformer import Attention, Transformer
from coplan.plan.types import ParallelPlan


class LayoutError(CoplanError):
    """A parallel layout this runner cannot apply."""


@dataclass(frozen=True, slots=True)
class Rank:
    """This process's place in the job: global rank, world size, data- and tensor-parallel ranks."""

    rank: int
    world: int
    dp_rank: int
    tp_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def supported(p: ParallelPlan) -> str | None:
    """Why this runner cannot apply layout ``p`` (None when it can)."""
    if p.pp > 1 and (p.tp > 1 or p.dp > 1):
        return f"pipeline parallelism with tp={p.tp}, dp={p.dp} is not applied by coplan run yet (pp alone)"
    if p.vpp > 1:
        return f"interleaved pipeline stages (vpp={p.vpp}) are not applied by coplan run yet"
    if p.sequence_parallel:
        return "sequence parallelism is not applied by coplan run yet"
    if p.cp > 1:
        return "context parallelism is not applied by coplan run"
    if p.tp > 1 and p.zero >= 1:
        return "tensor parallelism with ZeRO/FSDP2 (2-D sharding) is not applied by coplan run yet"
    if p.fsdp_shard is not None:
        return f"hybrid sharding (FSDP within groups of {p.fsdp_shard}) is not applied by coplan run yet"
    return None


def init(rank: int, world: int, device: str, p: ParallelPlan) -> Rank:
    """Join the process group (when ``world > 1``) and place this rank on the ``(dp, tp)`` grid."""
    if device == "cuda":
        torch.cuda.set_device(rank % max(1, torch.cuda.device_count()))
        dev = torch.device("cuda", torch.cuda.current_device())
    else:
        dev = torch.device("cpu")
    if world > 1 and not torch.distributed.is_initialized():
        backend = "nccl" if device == "cuda" else "gloo"
        torch.distributed.init_process_group(
            backend, rank=rank, world_size=world, device_id=dev if device == "cuda" else None
        )
    return Rank(rank=rank, world=world, dp_rank=rank // p.tp, tp_rank=rank % p.tp, device=dev)


def mesh(r: Rank, p: ParallelPlan) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(r.device.type, (p.dp, p.tp), mesh_dim_names=("dp", "tp"))


# --- tensor parallelism -------------------------------------------------------------------------


def qkv_order(n_heads: int, kv_heads: int, head_dim: int, tp: int) -> torch.Tensor:
    """Row order of the fused QKV weight that puts each tensor-parallel rank's heads together.

    ``c_attn`` computes ``[q | k | v]``; sharding its rows evenly would hand rank 0 all of q.
    Megatron shards by heads: rank ``r`` holds ``[q_r | k_r | v_r]``. Permuting the rows once, before
    sharding, gives that layout with an ordinary column-wise split.
    """
    c, kv = n_heads * head_dim, kv_heads * head_dim
    q = torch.arange(c).view(tp, -1)
    k = (c + torch.arange(kv)).view(tp, -1)
    v = (c + kv + torch.arange(kv)).view(tp, -1)
    return torch.cat([q, k, v], dim=1).reshape(-1)


def _local_attention(self: Attention, x: torch.Tensor) -> torch.Tensor:
    """``Attention.forward`` on this rank's heads (the fused QKV output holds ``[q_r|k_r|v_r]``)."""
    b, t, _ = x.shape
    qkv = self.c_attn(x)
    local = qkv.shape[-1]
    q_w = self.n_heads * self.hd
    kv_w = (local - q_w) // 2
    q, k, v = qkv.split([q_w, kv_w, kv_w], dim=2)
    q = q.view(b, t, self.n_heads, self.hd).transpose(1, 2)
    k = k.view(b, t, self.kv_heads, self.hd).transpose(1, 2)
    v = v.view(b, t, self.kv_heads, self.hd).transpose(1, 2)
    if self.rotary is not None:
        q, k = self.rotary(q), self.rotary(k)
    gqa = self.kv_heads != self.n_heads
    y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, enable_gqa=gqa)
    y = y.transpose(1, 2).contiguous().view(b, t, q_w)
    return self.c_proj(y)


def _vocab_parallel_forward(self: Transformer, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``Transformer.forward`` with this rank's vocabulary shard of the LM head and the loss
    computed vocabulary-parallel (``coplan.apply.vocab``); it mirrors ``Transformer.forward`` line
    for line up to the loss (a change there must be made here too: the TP gradient check fails)."""
    from torch.utils.checkpoint import checkpoint

    from coplan.apply.vocab import vocab_cross_entropy

    _, t = idx.shape
    x = self.wte(idx)
    if self.wpe is not None:
        x = x + self.wpe(torch.arange(t, device=idx.device))
    full = self.recompute == "full" and torch.is_grad_enabled()
    for block in self.h:
        x = checkpoint(block, x, use_reentrant=False) if full else block(x)
    logits = self.lm_head(self.ln_f(x))  # (batch, seq, vocab / tp): this rank's columns
    start, group = self._vocab_shard  # type: ignore[misc]
    return vocab_cross_entropy(logits, targets, start, group)


def apply_vocab_parallel(model: Transformer, tp_mesh: Any, tp: int) -> None:
    """Shard the word embedding and the LM head along the vocabulary (Megatron's
    ``VocabParallelEmbedding`` and column-parallel output layer: one weight, tied or not, split by
    rows) and compute the loss on the sharded logits."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    vocab = model.spec.vocab_size
    if vocab % tp:
        raise LayoutError(f"tp={tp} does not divide the vocabulary of {vocab}")
    tied = model.lm_head.weight is model.wte.weight
    parallelize_module(
        model,
        tp_mesh,
        {
            "wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            "lm_head": ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1)),
        },
    )
    if tied:  # both are Shard(0) of the same (vocab, d) weight: keep one parameter
        model.lm_head.weight = model.wte.weight
    rank = tp_mesh.get_local_rank()
    model._vocab_shard = (rank * (vocab // tp), tp_mesh.get_group().group_name)  # type: ignore[assignment]
    model.forward = types.MethodType(_vocab_parallel_forward, model)  # type: ignore[method-assign]


def apply_tp(model: Transformer, tp_mesh: Any, tp: int) -> dict[str, torch.Tensor]:
    """Megatron layout: QKV and MLP-in column-parallel, attention and MLP-out projections
    row-parallel, norms replicated, the word embedding, LM head and loss vocabulary-parallel
    (``apply_vocab_parallel``). Returns the row permutation of each permuted parameter (to compare
    its gradient with an unpermuted reference)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    spec = model.spec
    if spec.n_heads % tp or spec.kv_heads % tp:
        raise LayoutError(f"tp={tp} does not divide the {spec.n_heads} heads ({spec.kv_heads} kv heads)")
    if spec.is_moe:
        raise LayoutError("tensor parallelism of mixture-of-experts layers is not applied by coplan run yet")
    order = qkv_order(spec.n_heads, spec.kv_heads, spec.head_dim, tp)
    perms: dict[str, torch.Tensor] = {}
    for i, block in enumerate(model.h):
        attn = block.attn
        assert isinstance(attn, Attention)
        with torch.no_grad():
            attn.c_attn.weight.copy_(attn.c_attn.weight[order])
            if attn.c_attn.bias is not None:
                attn.c_attn.bias.copy_(attn.c_attn.bias[order])
        perms[f"h.{i}.attn.c_attn.weight"] = order
        if attn.c_attn.bias is not None:
            perms[f"h.{i}.attn.c_attn.bias"] = order
        attn.n_heads //= tp
        attn.kv_heads //= tp
        attn.forward = types.MethodType(_local_attention, attn)  # type: ignore[method-assign]
        layout: dict[str, Any] = {
            "attn.c_attn": ColwiseParallel(),
            "attn.c_proj": RowwiseParallel(),
            "mlp.c_fc": ColwiseParallel(),
            "mlp.c_proj": RowwiseParallel(),
        }
        if getattr(block.mlp, "swiglu", False):
            layout["mlp.c_gate"] = ColwiseParallel()
        parallelize_module(block, tp_mesh, layout)
    apply_vocab_parallel(model, tp_mesh, tp)
    return perms


# --- data parallelism ---------------------------------------------------------------------------


def apply_dp(model: Transformer, dp_mesh: Any, p: ParallelPlan, compute: torch.dtype) -> nn.Module:
    """DDP (ZeRO 0) or FSDP2 (ZeRO >= 1: parameters, gradients and optimizer state sharded; with a
    16-bit compute dtype FSDP2 gathers 16-bit parameters and reduces fp32 gradients)."""
    if p.zero == 0:
        from torch.nn.parallel import DistributedDataParallel as DDP

        group = dp_mesh.get_group() if dp_mesh is not None else None
        return DDP(model, process_group=group)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)
    if compute != torch.float32:
        # FSDP2 compiles per block, so the root's ops (embedding, final norm, LM head, loss) run
        # eagerly, out of the precision pass's reach: the loss reads fp32 logits as the plan says
        model.lm_head.register_forward_hook(lambda _m, _i, out: out.float())
    for block in model.h:
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=p.zero >= 3)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=p.zero >= 3)
    return model


def full_grad(param: torch.Tensor) -> torch.Tensor | None:
    """The whole gradient of a (possibly sharded) parameter, on every rank."""
    g = param.grad
    if g is None:
        return None
    full: Callable[[], torch.Tensor] | None = getattr(g, "full_tensor", None)
    return full() if full is not None else g


# --- launching ----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def from_torchrun() -> tuple[int, int] | None:
    """(rank, world) when this process was started by torchrun, else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None


def launch(fn: Callable[..., object], nproc: int, args: tuple[Any, ...]) -> None:
    """Run ``fn(rank, nproc, *args)`` in ``nproc`` spawned processes (rendezvous on localhost),
    which end with this one (``coplan.procs.spawn``); a failed rank raises ``WorkerFailed``."""
    from coplan import procs

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(free_port())
    procs.spawn(_entry, nproc, (fn, nproc, args))


def _entry(rank: int, fn: Callable[..., object], nproc: int, args: tuple[Any, ...]) -> None:
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(nproc)
    os.environ["LOCAL_RANK"] = str(rank)
    try:
        fn(rank, nproc, *args)
        if torch.distributed.is_initialized():
            # every rank done before any tears down: a rank destroying its group while another
            # still has gloo work in flight intermittently aborted a worker ("terminate called
            # without an active exception") in the two-process tests
            torch.distributed.barrier()
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
