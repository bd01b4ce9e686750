"""The MLP activation run eagerly (NeMo 2.x's squared ReLU) against Megatron's fused kernels."""

from __future__ import annotations

import pytest

from coplan.cost import CostModel, TrainingConfig
from coplan.cost.parts import vdot
from coplan.hardware import load_cluster
from coplan.models.spec import PRESETS, ModelSpec

RELU2 = ModelSpec(
    name="relu2-test",
    n_layers=2,
    d_model=512,
    n_heads=8,
    ffn_hidden=2048,
    vocab_size=1024,
    seq_len=256,
    activation="relu2",
    position="rope",
    bias=False,
)
B, S = 2, 256


def _bytes(kernels) -> float:
    ones = (1.0,) * 6
    return sum(vdot(k.bytes, ones) for k in kernels)


def test_eager_squared_relu_backward_pays_pytorchs_pow_gradient():
    # fused: one kernel reads the gradient and relu's output and writes the input gradient (3 passes
    # of b x s x ffn); eager: pow's gradient as PyTorch runs it, x.pow(1) and 2 * ... (2 passes each)
    # then grad * ... (3), and relu's threshold_backward (3): 10 passes in 4 kernels
    part = CostModel(spec=RELU2).profile(B, S).templates[0]
    fwd, bwd = part.eager_activation
    n = B * S * RELU2.ffn
    assert fwd == part.forward  # relu and square are kernels of their own already (relu's output is kept)
    assert len(bwd) - len(part.backward) == 3
    assert _bytes(bwd) - _bytes(part.backward) == pytest.approx(7 * n)


def test_estimate_prices_the_eager_activation_only_when_asked():
    cluster = load_cluster("dgx-h100", 1)
    config = TrainingConfig(microbatch=B, global_batch=B, seq=S)
    cm = CostModel(spec=RELU2)
    fused, eager = cm.estimate(cluster, config), cm.estimate(cluster, config.with_(activation_fusion=False))
    assert eager.stages[0].forward_s == fused.stages[0].forward_s
    assert eager.stages[0].backward_s > fused.stages[0].backward_s
    assert eager.kernels_per_step - fused.kernels_per_step == 3 * RELU2.n_layers
    # GeLU is one op each way whatever the fusion: nothing to split
    gpt = CostModel(spec=PRESETS["gpt-tiny"])
    tiny = TrainingConfig(microbatch=1, global_batch=1, seq=64)
    assert (
        gpt.estimate(cluster, tiny).step_time_s
        == gpt.estimate(cluster, tiny.with_(activation_fusion=False)).step_time_s
    )
    # SwiGLU's SiLU and product, one fused kernel each way under Megatron, split when eager
    llama = CostModel(spec=PRESETS["llama-tiny"])
    assert (
        llama.estimate(cluster, tiny.with_(activation_fusion=False)).kernels_per_step
        > llama.estimate(cluster, tiny).kernels_per_step
    )


def test_eager_fusion_mode_runs_pows_gradient_as_pytorch_does():
    # fusion "none" is eager PyTorch throughout: the extra passes are in its kernels already
    cm = CostModel(spec=RELU2)
    eager = cm.profile(B, S, "none").templates[0]
    assert eager.eager_activation == ()
    passes = [k for k in eager.backward if k.kind == "vector" and k.mm_flops == 0 and len(k.ops) == 1]
    square_bwd = [k for k in passes if cm.profile(B, S, "none").graph.ops[k.ops[0]].target == "square_bwd"]
    assert len(square_bwd) == 3  # the IR's op and PyTorch's two extra passes
