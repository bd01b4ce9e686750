"""Vocabulary-parallel log-softmax and loss for tensor parallelism (Megatron-LM's layout).

Under tensor parallelism the cost model prices the ops that touch the vocabulary (word embedding,
LM head, loss) vocabulary-parallel: rank ``r`` of ``tp`` holds rows ``[r V/tp, (r+1) V/tp)`` of the
(tied) embedding, computes those logits only, and the cross-entropy is taken over the sharded
logits with two all-reduces of one value per token (the maximum and the sum of exponentials) and
one for the target's log-probability. Each rank keeps its ``V/tp`` fp32 log-probabilities for
backward, not the whole vocabulary's.

The two loss ops are ``torch.library`` custom ops, ``coplan::vocab_log_softmax`` and
``coplan::vocab_nll_loss``, the IR's ``log_softmax`` and ``nll_loss``: opaque to Dynamo and
AOTAutograd, so that the joint graph holds one node per IR op (the partitioner saves the
log-softmax output by name, as it saves ``aten._log_softmax``'s) and the collectives run inside
them, eagerly, with the process group named by its group name. Their backward formulas are custom
ops too: ``d logp = g - exp(logp) * sum_V(g)`` (the sum over the whole vocabulary: an all-reduce)
and the scatter of ``-g / n`` to the local targets (no communication).

``torch.distributed.tensor.parallel.loss_parallel`` computes the same loss with DTensor handlers;
its ops decompose into a dozen aten ops with functional collectives, which leaves the partitioner
no node to name and cannot be cut as the plan says.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

IGNORE_INDEX = -100  # F.cross_entropy's default: targets equal to it do not count


def _group(name: str) -> Any:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)  # type: ignore[arg-type]


def _all_reduce(t: Tensor, group: str, op: Any = None) -> Tensor:
    import torch.distributed as dist

    dist.all_reduce(t, op=op if op is not None else dist.ReduceOp.SUM, group=_group(group))
    return t


@torch.library.custom_op("coplan::vocab_log_softmax", mutates_args=())
def vocab_log_softmax(x: Tensor, group: str) -> Tensor:
    """Log-softmax over a vocabulary whose last dimension is sharded across ``group``: this rank's
    shard of the result."""
    import torch.distributed as dist

    m = _all_reduce(x.amax(dim=-1, keepdim=True), group, dist.ReduceOp.MAX)
    shifted = x - m
    s = _all_reduce(shifted.exp().sum(dim=-1, keepdim=True), group)
    return shifted - s.log()


@vocab_log_softmax.register_fake
def _(x: Tensor, group: str) -> Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("coplan::vocab_log_softmax_backward", mutates_args=())
def vocab_log_softmax_backward(grad: Tensor, out: Tensor, group: str) -> Tensor:
    s = _all_reduce(grad.sum(dim=-1, keepdim=True), group)
    return grad - out.exp() * s


@vocab_log_softmax_backward.register_fake
def _(grad: Tensor, out: Tensor, group: str) -> Tensor:
    return torch.empty_like(out)


def _lsm_setup(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    ctx.save_for_backward(output)
    ctx.group = inputs[1]


def _lsm_backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
    (out,) = ctx.saved_tensors
    return vocab_log_softmax_backward(grad, out, ctx.group), None


vocab_log_softmax.register_autograd(_lsm_backward, setup_context=_lsm_setup)


@torch.library.custom_op("coplan::vocab_nll_loss", mutates_args=())
def vocab_nll_loss(logp: Tensor, target: Tensor, start: int, group: str) -> tuple[Tensor, Tensor]:
    """(mean negative log-likelihood, number of counted targets) of ``target`` over log-probabilities
    sharded along the vocabulary; this rank holds classes ``[start, start + logp.shape[-1])``."""
    local = target - start
    inside = (local >= 0) & (local < logp.shape[-1]) & (target != IGNORE_INDEX)
    picked = logp.gather(-1, local.clamp(0, logp.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    total = _all_reduce(torch.where(inside, picked, 0).sum(), group)
    weight = (target != IGNORE_INDEX).sum().to(logp.dtype)
    return -total / weight, weight


@vocab_nll_loss.register_fake
def _(logp: Tensor, target: Tensor, start: int, group: str) -> tuple[Tensor, Tensor]:
    return logp.new_empty(()), logp.new_empty(())


@torch.library.custom_op("coplan::vocab_nll_loss_backward", mutates_args=())
def vocab_nll_loss_backward(grad: Tensor, target: Tensor, weight: Tensor, start: int, vocab: int) -> Tensor:
    local = target - start
    inside = (local >= 0) & (local < vocab) & (target != IGNORE_INDEX)
    out = grad.new_zeros((*target.shape, vocab))
    src = torch.where(inside, -grad / weight, 0).to(out.dtype).unsqueeze(-1)
    return out.scatter_(-1, local.clamp(0, vocab - 1).unsqueeze(-1), src)


@vocab_nll_loss_backward.register_fake
def _(grad: Tensor, target: Tensor, weight: Tensor, start: int, vocab: int) -> Tensor:
    return grad.new_empty((*target.shape, vocab))


def _nll_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    logp, target, start, _ = inputs
    ctx.save_for_backward(target, output[1])
    ctx.start, ctx.vocab = start, logp.shape[-1]
    ctx.mark_non_differentiable(output[1])


def _nll_backward(ctx: Any, grad: Tensor, _grad_weight: Tensor | None) -> tuple[Tensor, None, None, None]:
    target, weight = ctx.saved_tensors
    return vocab_nll_loss_backward(grad, target, weight, ctx.start, ctx.vocab), None, None, None


vocab_nll_loss.register_autograd(_nll_backward, setup_context=_nll_setup)


def vocab_cross_entropy(logits: Tensor, target: Tensor, start: int, group: str) -> Tensor:
    """Mean cross-entropy of ``target`` (any shape) over ``logits`` (``target.shape + (V/tp,)``)
    sharded along the vocabulary; equal on every rank of ``group``."""
    logp = vocab_log_softmax(logits.reshape(-1, logits.shape[-1]), group)
    loss, _ = vocab_nll_loss(logp, target.reshape(-1), start, group)
    return loss


#: The ops above as graph targets (packets and overloads): the IR's loss ops under tensor parallelism.
LOG_SOFTMAX_OPS = frozenset({torch.ops.coplan.vocab_log_softmax, torch.ops.coplan.vocab_log_softmax.default})
NLL_OPS = frozenset({torch.ops.coplan.vocab_nll_loss, torch.ops.coplan.vocab_nll_loss.default})
