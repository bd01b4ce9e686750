"""What ``torch.compile``'s default partitioner saves for a Llama-style block, measured on this CPU
against what the compiled stacks price (``coplan.cost.remat.inductor_recomputes``): SwiGLU's SiLU
output recomputed in backward, grouped-query attention's repeated keys and values kept for SDPA."""

from __future__ import annotations

import pytest
import torch
from test_eager import MB, PROBE, SEQ, _spec

from coplan.cost import CostModel, TrainingConfig, load_stack
from coplan.cost.remat import inductor_recomputes
from coplan.hardware import load_cluster
from coplan.models.spec import PRESETS


def _measured_per_block(kv: int) -> float:
    """Bytes one compiled block saves for backward (two blocks less one), bf16, parameters
    excluded: the step probe's torchtitan-style block, each block compiled (torchtitan's
    ``apply_compile``)."""
    import sys

    sys.path.insert(0, str(PROBE))
    try:
        import h100_step_probe as probe
    finally:
        sys.path.remove(str(PROBE))
    s = _spec(1, kv)
    table = probe.rope_table(s.head_dim, SEQ, s.rope_theta)

    def saved(n: int) -> int:
        torch.manual_seed(0)
        torch._dynamo.reset()
        blocks = [probe.Block(s).to(torch.bfloat16) for _ in range(n)]
        params = {p.untyped_storage().data_ptr() for b in blocks for p in b.parameters()}
        params.add(table.untyped_storage().data_ptr())
        x = torch.randn(MB, SEQ, s.d_model, dtype=torch.bfloat16, requires_grad=True)
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            st = t.untyped_storage()
            if st.data_ptr() not in params and st.data_ptr() != x.untyped_storage().data_ptr():
                seen[st.data_ptr()] = st.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            for b in blocks:
                x = torch.compile(b)(x, table)
        return sum(seen.values())

    return float(saved(2) - saved(1))


def _priced_per_block(kv: int) -> float:
    base = TrainingConfig(microbatch=MB, global_batch=MB, seq=SEQ)
    config = load_stack("torchtitan-compile").configure(base).with_(recompute="none")
    cluster = load_cluster("dgx-h100", 1)

    def act(layers: int) -> float:
        return CostModel(spec=_spec(layers, kv)).estimate(cluster, config).memory.activations_bytes

    return act(2) - act(1)


@pytest.mark.compile
@pytest.mark.parametrize("kv", [8, 2])
def test_a_compiled_block_saves_what_the_compiled_stacks_price(kv):
    measured = _measured_per_block(kv)
    # the same with 2 key/value heads of 8: the repeated copies are SDPA's inputs, saved
    assert measured == pytest.approx(_measured_per_block(8) if kv != 8 else measured)
    assert _priced_per_block(kv) == pytest.approx(measured, rel=0.03)


def test_inductor_recomputes_swiglus_silu_and_nothing_gelu_feeds_a_gemm():
    """A Llama block's SiLU output (read in backward by the product's gradient, pointwise, and made
    from ``x W1``, kept anyway) is recomputed; GPT-2's GELU output is read by the second GEMM's
    weight gradient, so it is saved; outside blocks nothing is."""
    llama = CostModel(spec=_spec(2, 2)).profile(MB, SEQ, "megatron")
    got = [inductor_recomputes(llama.graph, p)[0] for p in llama.templates]
    assert ("h.0.mlp.silu",) in got
    assert all(n.endswith(".mlp.silu") for names in got for n in names)
    gpt = CostModel(spec=PRESETS["gpt2-124m"]).profile(1, 128, "megatron")
    assert all(inductor_recomputes(gpt.graph, p)[0] == () for p in gpt.templates)


def test_the_cost_model_and_the_planner_agree_on_the_min_cut_set():
    """``coplan.passes.remat.mincut_names`` (what a compiled plan starts from) and the estimate's
    rule for compiled stacks name the same reference-block tensors."""
    from coplan.passes.remat import mincut_names
    from coplan.plan.context import PlanContext

    for spec in (_spec(2, 2), PRESETS["gpt2-124m"], PRESETS["llama3-8b"]):
        model = CostModel(spec=spec)
        ctx = PlanContext(model, load_cluster("dgx-h100", 8), global_batch=8, seq=SEQ,
                          stack=load_stack("torchtitan-compile"))  # fmt: skip
        prof = ctx.reference_profile
        ref = {n for p in prof.templates for n in inductor_recomputes(prof.graph, p)[0] if ".0." in n}
        assert ref == {n for n in mincut_names(ctx) if ".0." in n}
