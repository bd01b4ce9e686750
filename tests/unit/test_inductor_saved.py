"""What ``torch.compile``'s default partitioner saves for a Llama-style block, measured on this CPU
against what the compiled stacks price (``coplan.cost.remat.inductor_recomputes``): SwiGLU's SiLU
output recomputed in backward, grouped-query attention's repeated keys and values kept for SDPA."""

from __future__ import annotations

import pytest
import torch
from test_eager import (
    MB,
    SEQ,
    _measured_per_block,
    _priced_per_block,
    _probe,
    _spec,
    priced_vector_kernels,
    saved_storages,
)

from coplan.cost import CostModel, TrainingConfig, load_stack
from coplan.cost.remat import inductor_recomputes
from coplan.hardware import load_cluster
from coplan.models.spec import PRESETS


@pytest.mark.compile
@pytest.mark.parametrize("kv", [8, 2])
def test_a_compiled_block_saves_what_the_compiled_stacks_price(kv):
    measured = _measured_per_block(_spec(1, kv), compile=True)
    # the same with 2 key/value heads of 8: the repeated copies are SDPA's inputs, saved
    assert measured == pytest.approx(_measured_per_block(_spec(1, 8), compile=True) if kv != 8 else measured)
    assert _priced_per_block(kv, "torchtitan-compile") == pytest.approx(measured, rel=0.03)


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


#: torchtitan's per-op policy (pytorch/torchtitan@9dec370ad2 parallelize_llama.py ``_save_list`` and
#: ``_custom_policy``): save mm outputs but every second one, and SDPA's; the CPU's SDPA op stands
#: in for the CUDA flash / efficient ones
_SAVE = {
    torch.ops.aten.mm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten.abs.default,
    torch.ops.aten.max.default,
}


def _sac_block(kv: int):  # type: ignore[no-untyped-def]
    """The step probe's block wrapped in torchtitan's per-op checkpointing, the caching modes it
    creates kept in ``made``."""
    from collections import defaultdict

    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    probe = _probe()
    made: list = []

    def context_fn():  # type: ignore[no-untyped-def]
        meta: dict[str, int] = defaultdict(int)

        def policy(ctx, func, *args, **kwargs):  # type: ignore[no-untyped-def]
            mode = "recompute" if ctx.is_recompute else "forward"
            if func == torch.ops.aten.mm.default:
                meta[mode] += 1
            save = func in _SAVE and not (func == torch.ops.aten.mm.default and meta[mode] % 2 == 0)
            return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

        got = create_selective_checkpoint_contexts(policy)
        made.append(got[0])
        return got

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.b = probe.Block(_spec(1, kv)).to(torch.bfloat16)

        def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
            return checkpoint(
                self.b, x, table, use_reentrant=False, context_fn=context_fn, preserve_rng_state=False
            )

    s = _spec(1, kv)
    return Block(), probe.rope_table(s.head_dim, SEQ, s.rope_theta), made


def _sac_measured(kv: int, compiled: bool) -> float:
    """Bytes one block keeps under the per-op policy, its input included (the next block's output,
    which the priced per-block difference counts): in eager PyTorch what the caching mode holds;
    compiled, what the forward returns for backward."""
    torch.manual_seed(0)
    torch._dynamo.reset()
    block, table, made = _sac_block(kv)
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    params.add(table.untyped_storage().data_ptr())
    x = torch.randn(MB, SEQ, 256, dtype=torch.bfloat16, requires_grad=True)
    with saved_storages(params) as seen:
        (torch.compile(block) if compiled else block)(x, table)
    seen[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
    if not compiled:
        for per_op in made[0].storage.values():
            for out in per_op.values():
                for leaf in torch.utils._pytree.tree_leaves(out):
                    t = getattr(leaf, "val", None)
                    if isinstance(t, torch.Tensor):
                        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return float(sum(seen.values()))


def _sac_priced(kv: int, stack: str) -> float:
    from coplan.cost.checkpoint import selective_op_names

    cluster = load_cluster("dgx-h100", 1)

    def act(layers: int) -> float:
        model = CostModel(spec=_spec(layers, kv))
        config = load_stack(stack).configure(TrainingConfig(microbatch=MB, global_batch=MB, seq=SEQ))
        names = selective_op_names(model.profile(MB, SEQ, config.fusion).graph)
        return model.estimate(cluster, config.with_(recompute=names)).memory.activations_bytes

    return act(2) - act(1)


@pytest.mark.compile
@pytest.mark.parametrize("kv", [8, 2])
def test_per_op_checkpointing_keeps_what_each_stack_prices(kv):
    """Eager selective checkpointing holds every ``MUST_SAVE`` output (wq, wv, w1, w2 and SDPA's),
    a compiled block only those its backward reads (not w2's); neither keeps wk's, the policy's
    second ``mm``."""
    eager, compiled = _sac_measured(kv, False), _sac_measured(kv, True)
    d, ffn, kv_cols = 256, 704, 256 * kv // 8
    w2 = MB * SEQ * d * 2
    assert eager - compiled == w2
    assert (
        compiled == MB * SEQ * 2 * (d + d + kv_cols + ffn + d) + 8 * MB * SEQ * 4
    )  # x, wq, wv, w1, out; lse
    assert _sac_priced(kv, "torchtitan") == pytest.approx(eager)
    assert _sac_priced(kv, "torchtitan-compile") == pytest.approx(compiled)


@pytest.mark.compile
def test_a_compiled_blocks_other_kernels_move_what_inductor_counts():
    """The non-GEMM, non-attention kernels priced for one compiled torchtitan-style block beside
    what Inductor generated for it on this CPU (a model of one and of two blocks, the difference):
    its generated kernels and the ATen complex products RoPE falls back to, four a block (q and k,
    each way), by the bytes its scheduler counts for them (every buffer a kernel reads or writes
    once). Inductor fuses the residual adds into the norms, so it launches fewer; the bytes agree
    within 10%."""
    from coplan.inspect.api import inspect_module

    probe = _probe()

    class Stack(torch.nn.Module):
        def __init__(self, n: int) -> None:
            super().__init__()
            s = _spec(n, 8)
            self.blocks = torch.nn.ModuleList(probe.Block(s) for _ in range(n))
            self.table = probe.rope_table(s.head_dim, SEQ, s.rope_theta)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for b in self.blocks:
                x = b(x, self.table)
            return x

    def inductor(n: int) -> tuple[int, int, float]:
        torch.manual_seed(0)
        torch._dynamo.reset()
        x = torch.randn(MB, SEQ, 256, dtype=torch.bfloat16, requires_grad=True)
        rec = inspect_module(
            Stack(n).to(torch.bfloat16), (x,), loss_fn=lambda out, *a: out.float().mean(), steps=0
        )
        ks = rec.record["kernel_table"]
        gen = [k for k in ks if k["kind"] == "generated"]
        products = [k for k in ks if k["kind"] == "fallback" and k["name"].startswith("torch.ops.aten.mul.")]
        return len(gen), len(products), float(sum(k["bytes"] for k in (*gen, *products)))

    one, two = inductor(1), inductor(2)
    generated, products, moved = (b - a for a, b in zip(one, two, strict=True))
    assert products == 4

    (k1, b1), (k2, b2) = (priced_vector_kernels("torchtitan-compile", 8, n) for n in (1, 2))
    assert generated + products < k2 - k1
    assert b2 - b1 == pytest.approx(moved, rel=0.10)
