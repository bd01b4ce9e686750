"""What a compiler that schedules the whole step leaves out of memory (``kernel_local_buffers``):
the temporaries its kernels alone read, and the fp32 loss gradient it writes already cast. The
cost model's claim, and the Inductor fact it rests on."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from coplan.cost import CostModel, load_stack
from coplan.cost.liveness import fused_temporaries
from coplan.cost.profile import _Ctx
from coplan.hardware import load_cluster
from coplan.models.spec import PRESETS
from coplan.plan import PlanContext
from coplan.search.space import fusion_option


def _ctx(kernel_local_buffers: bool) -> PlanContext:
    ctx = PlanContext(CostModel(spec=PRESETS["gpt-tiny"]), load_cluster("dgx-h100", 1), 8, 64)
    ctx.stack = replace(load_stack("coplan"), kernel_local_buffers=kernel_local_buffers)
    return ctx


def _plan(ctx: PlanContext, fusion: str):
    from coplan.passes.precision import precision_variant

    prec = precision_variant(ctx, "bf16", "autocast")
    assert prec is not None
    return ctx.default_plan().with_(fusion=fusion_option(ctx, fusion), precision=prec)


def test_the_loss_gradient_is_unwritten_inside_its_kernel_and_written_cast_outside_it():
    ctx = _ctx(True)
    plan = _plan(ctx, "greedy")
    graph = ctx.index.graph
    groups = ctx.expand_fusion(plan.fusion)
    group_of = {i: tuple(g) for g in groups for i in g}
    head = [op for op in graph.ops if op.block is None]
    wide = _Ctx(graph)._f32_ops  # the loss path on the vocabulary, computed in fp32
    unwritten, narrowed = fused_temporaries(graph, head, group_of, wide)
    names = {graph.tensors[t].name for t in unwritten}
    cast = {graph.tensors[t].name for t in narrowed}
    # nll_loss's gradient is read only by log_softmax's backward, in the same generated kernel;
    # the logits' gradient leaves it for the output layer's GEMMs, in the training dtype
    assert any(n.endswith("log_softmax.grad") for n in names), names
    assert any(n.endswith("lm_head.out.grad") for n in cast), cast
    assert not unwritten & narrowed


def test_a_scheduled_step_peaks_lower_and_eager_kernels_are_unchanged():
    on, off = _ctx(True), _ctx(False)
    compiled_on, compiled_off = on.price(_plan(on, "greedy")), off.price(_plan(off, "greedy"))
    assert compiled_on.memory.transient_bytes < compiled_off.memory.transient_bytes
    assert compiled_on.memory.peak_bytes < compiled_off.memory.peak_bytes
    assert compiled_on.step_time_s == compiled_off.step_time_s  # memory only
    eager_on, eager_off = on.price(_plan(on, "eager")), off.price(_plan(off, "eager"))
    assert eager_on.memory.peak_bytes == eager_off.memory.peak_bytes  # a stack's own kernels write theirs


@pytest.mark.compile
def test_inductor_writes_no_fp32_logit_sized_buffer_for_a_bf16_cross_entropy():
    """The Inductor fact ``kernel_local_buffers`` prices: torch.compile of a step whose loss is a
    cross-entropy of bf16 logits (autocast, as the runner's baselines run) allocates no fp32
    buffer of the logits' size, forward or backward, and at most two bf16 ones (the logits, and
    their gradient, which it may write into the logits' own buffer)."""
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    n, v, d = 96, 1000, 32
    w = torch.randn(v, d, requires_grad=True)
    x = torch.randn(n, d, requires_grad=True)
    t = torch.randint(0, v, (n,))

    def step(x: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(x @ w.t(), t)
        loss.backward()
        return loss

    torch._dynamo.reset()
    _, code = run_and_get_code(torch.compile(step), x, w, t)
    text = "\n".join(code)
    assert "empty_strided" in text
    wide = f"(({n}, {v}), ({v}, 1), torch.float32)"
    assert wide not in text
    assert text.count(f"(({n}, {v}), ({v}, 1), torch.bfloat16)") <= 2


def test_a_runner_plan_writes_its_groups_outputs_but_the_loss_gradient_already_cast():
    # coplan's runner (``fused_output_casts``): its groups' outputs are written, the fp32 logits'
    # gradient only in the training dtype; between writing everything and a scheduled step
    plain, casts, scheduled = _ctx(False), _ctx(False), _ctx(True)
    plain.stack = replace(plain.stack, fused_output_casts=False)
    assert casts.stack.fused_output_casts  # the coplan preset's own
    got = {
        name: c.price(_plan(c, "greedy")).memory.transient_bytes
        for name, c in (("plain", plain), ("casts", casts), ("scheduled", scheduled))
    }
    assert got["scheduled"] < got["casts"] < got["plain"], got
    # what the cast saves at the peak: the logits' gradient in 2 bytes an element instead of 4
    tokens = _plan(casts, "greedy").parallel.microbatch * 64
    assert got["plain"] - got["casts"] == tokens * PRESETS["gpt-tiny"].vocab_size * 2
    eager_plain, eager_casts = plain.price(_plan(plain, "eager")), casts.price(_plan(casts, "eager"))
    assert eager_plain.memory.peak_bytes == eager_casts.memory.peak_bytes  # no generated kernels
