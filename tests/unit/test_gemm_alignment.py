"""GEMMs whose loaded operands are not 16-byte aligned, and the stacks that pad them.

An H100 ran GPT-2's LM-head gradient GEMMs over the 50,257-wide vocabulary at 0.20 of the rate of
the aligned shape (``devices.json``, ``matmul_unaligned``); the forward, whose only unaligned
dimension is its output's, ran as fast as priced. Stacks that pad (Megatron's vocabulary,
Inductor's ``shape_padding``) pay nothing. An A100 pays for an unaligned head dimension in
Megatron's unfused attention (``bmm_unaligned``, fitted to BigScience's trials of BLOOM's widths)
more than for an unaligned vocabulary in a linear (``matmul_unaligned``, set by nanoGPT's measured
vocabulary padding).
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from coplan.cost import CostModel, TrainingConfig
from coplan.cost.kernels import Rates, Scale, kernel_time, misaligned, shape_factor
from coplan.cost.parts import ZERO, Kernel
from coplan.cost.stacks import load_stack, stack_names
from coplan.hardware import load_cluster
from coplan.ir.types import Phase
from coplan.models.spec import PRESETS, ModelSpec
from coplan.models.transformer import Transformer


def _gemm(m: int, n: int, k: int, tn: bool = False) -> Kernel:
    return Kernel(Phase.BACKWARD, "matmul", 0, 2.0 * m * n * k, 0.0, ZERO, dims=(m, n, k), tn=tn)


@pytest.mark.parametrize(
    ("dims", "tn", "expected"),
    [
        ((65536, 768, 50257), False, True),  # input gradient: the output gradient's rows are K
        ((50257, 768, 65536), True, True),  # weight gradient: grad.T's leading dimension is M
        ((65536, 50257, 768), False, False),  # forward: only the output's N is unaligned
        ((65536, 768, 50304), False, False),  # nanoGPT's padded vocabulary
        ((50257, 768, 65536), False, False),  # M unaligned in a row-major left operand: its rows
    ],
)
def test_which_gemms_load_a_misaligned_operand(dims, tn, expected):
    assert misaligned(_gemm(*dims, tn=tn), dims, 2) is expected


def test_alignment_is_sixteen_bytes_of_the_operand_dtype():
    k = _gemm(64, 64, 12)
    assert misaligned(k, k.dims, 2)  # 12 bf16 elements = 24 bytes
    assert not misaligned(k, k.dims, 4)  # 12 fp32 elements = 48 bytes


def test_unpadded_misaligned_gemm_runs_at_the_devices_fraction():
    dev = load_cluster("dgx-h100").groups[0].device
    r = Rates.of(dev, "bf16")
    assert r.mm_unaligned == pytest.approx(0.2)
    k = _gemm(65536, 768, 50257)
    padded = Scale(1, False, (2.0, 2.0, 4.0, 4.0, 1.0, 1.0), 2, True, False, True)
    unpadded = dataclasses.replace(padded, pads=False)
    base = kernel_time(k, r, padded) - r.launch_s
    assert kernel_time(k, r, unpadded) - r.launch_s == pytest.approx(base / 0.2)
    fwd = _gemm(65536, 50257, 768)
    assert kernel_time(fwd, r, unpadded) == kernel_time(fwd, r, padded)


def test_devices_without_a_measurement_pay_nothing():
    dev = load_cluster("mi300x-node").groups[0].device
    assert Rates.of(dev, "bf16").mm_unaligned == 1.0


def _unfused_attention(head_dim: int) -> Kernel:
    bh, s = 16, 2048
    flops = 4.0 * bh * s * s * head_dim
    return Kernel(Phase.FORWARD, "attention", 0, flops, 0.0, ZERO, attn=(bh, s, s, head_dim))


@pytest.mark.parametrize("head_dim", [225, 150, 108])
def test_unfused_attention_with_an_unaligned_head_dim_runs_its_gemms_at_the_devices_fraction(head_dim):
    # BLOOM's trial widths (hidden 14400 over 64 / 96 heads, 13824 over 128): every batched GEMM of
    # baddbmm + softmax + bmm loads an operand whose leading dimension is the head dimension
    dev = load_cluster("dgx-a100-80gb").groups[0].device
    r = Rates.of(dev, "fp16")
    assert r.bmm_unaligned == pytest.approx(0.14)
    megatron = Scale(1, False, (2.0, 2.0, 4.0, 4.0, 1.0, 1.0), 2, False, True, True)
    inductor = dataclasses.replace(megatron, pads_bmm=True)  # pad_mm pads bmm operands too
    k, aligned = _unfused_attention(head_dim), _unfused_attention(head_dim + 8 - head_dim % 8)
    assert kernel_time(k, r, megatron) > kernel_time(k, r, inductor)
    # the GEMM part alone is what slows: the score traffic is the same
    slow = kernel_time(k, r, megatron) - kernel_time(k, r, inductor)
    gemm = k.mm_flops / (r.mm_flops * shape_factor((2048, 2048, head_dim), r.half_dim))
    assert slow == pytest.approx(gemm * (1 / r.bmm_unaligned - 1), rel=1e-9)
    assert kernel_time(aligned, r, megatron) == kernel_time(aligned, r, inductor)


def test_only_inductor_pads_the_head_dimension():
    base = TrainingConfig(tp=1, pp=1, dp=1, microbatch=1, global_batch=1, seq=64)
    assert Scale.of(base.with_(kernels="inductor")).pads_bmm
    assert not Scale.of(base).pads_bmm  # Megatron's kernels: the vocabulary is padded, heads are not
    assert not Scale.of(base.with_(kernels="inductor", gemm_padding=False)).pads_bmm


def test_eager_pytorch_pays_for_gpt2s_vocabulary_on_hopper_and_megatron_does_not():
    cm = CostModel(spec=PRESETS["gpt2-124m"])
    cluster = load_cluster("dgx-h100", 1)
    config = TrainingConfig(tp=1, pp=1, dp=1, microbatch=8, global_batch=8, seq=1024, dtype="bf16")
    padded = cm.estimate(cluster, config).step_time_s
    unpadded = cm.estimate(cluster, config.with_(gemm_padding=False)).step_time_s
    # two of the LM head's three GEMMs (each 2 x 8192 x 768 x 50257 FLOPs) at a fifth of their rate
    assert unpadded > padded * 1.05
    llama = CostModel(spec=PRESETS["llama2-7b"])  # every dimension aligned: nothing to pad
    c7 = config.with_(microbatch=1, global_batch=1, seq=4096)
    assert (
        llama.estimate(cluster, c7).step_time_s
        == llama.estimate(cluster, c7.with_(gemm_padding=False)).step_time_s
    )


def test_stacks_say_whether_they_pad():
    padding = {name: load_stack(name).gemm_padding for name in stack_names()}
    assert padding["megatron"] and padding["torchtitan-compile"] and padding["deepspeed"]
    assert padding["coplan"]  # the runner pads its LM head (``Head.pad_to``)
    assert not padding["eager"] and not padding["torchtitan"] and not padding["fsdp"]
    base = TrainingConfig(tp=1, pp=1, dp=1, microbatch=1, global_batch=1, seq=64)
    assert load_stack("eager").with_kernels(base).gemm_padding is False
    assert load_stack("megatron").with_kernels(base) == base


def test_padded_head_is_the_same_function_and_gradients():
    torch.manual_seed(0)
    spec = ModelSpec(name="odd", n_layers=1, d_model=32, n_heads=4, vocab_size=509, seq_len=16)
    plain = Transformer(spec)
    padded = copy.deepcopy(plain)
    padded.lm_head.pad_to = 64
    assert padded.lm_head.weight is padded.wte.weight  # still tied
    idx, tgt = torch.randint(0, 509, (2, 16)), torch.randint(0, 509, (2, 16))
    losses = []
    for model in (plain, padded):
        loss = model(idx, tgt)
        loss.backward()
        losses.append(loss.detach())
    assert torch.equal(losses[0], losses[1])
    for (name, a), b in zip(plain.named_parameters(), padded.parameters(), strict=True):
        assert a.grad is not None and b.grad is not None
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-7, msg=name)


def test_runner_plans_pad_and_its_eager_baseline_does_not():
    from coplan.apply.predict import make_context, run_cluster

    def context():
        cluster = run_cluster(load_cluster("dgx-h100"), 1, "cuda")
        return make_context(PRESETS["gpt2-124m"], cluster, 8, 1024, "cuda")

    runner, eager = context(), context()
    eager.stack = dataclasses.replace(eager.stack, gemm_padding=False)  # as ``run_plan`` prices it
    assert runner.stack.gemm_padding
    plan = runner.default_plan()
    assert eager.price(plan).step_time_s > runner.price(plan).step_time_s


def test_gemm_padding_must_be_a_bool():
    from coplan.cost import ConfigError

    with pytest.raises(ConfigError, match="gemm_padding"):
        TrainingConfig(tp=1, pp=1, dp=1, microbatch=1, global_batch=1, seq=64, gemm_padding="no")  # type: ignore[arg-type]


def test_the_batched_gemms_fraction_falls_back_to_the_linears():
    # a device that measured one fraction prices both paths with it (the Hopper parts)
    h100 = load_cluster("dgx-h100").groups[0].device
    assert h100.efficiency_of("bmm_unaligned") == h100.efficiency_of("matmul_unaligned") == pytest.approx(0.2)
    a100 = load_cluster("dgx-a100-80gb").groups[0].device
    assert a100.efficiency_of("bmm_unaligned") < a100.efficiency_of("matmul_unaligned")
    unaligned = _unfused_attention(225)
    r = Rates.of(a100, "fp16")
    megatron = Scale(1, False, (2.0, 2.0, 4.0, 4.0, 1.0, 1.0), 2, False, True, True)
    only_linear = dataclasses.replace(r, bmm_unaligned=1.0)
    # the attention's batched GEMMs read only their own fraction
    assert kernel_time(unaligned, only_linear, megatron) < kernel_time(unaligned, r, megatron)
