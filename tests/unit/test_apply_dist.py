"""Plans applied across processes: DDP, FSDP2 and tensor parallelism over gloo on a CPU (NCCL on
GPUs). Each test spawns two processes (about 10 s); DDP runs in the default tier, the others in
``-m slow``; the GPU variant skips where no CUDA device is visible."""

from __future__ import annotations

import pytest
import torch

from coplan.apply.precision import tolerance
from coplan.apply.predict import make_context, megatron_recompute, plan_for, run_cluster
from coplan.apply.run import RunRequest, run_plan
from coplan.hardware import load_cluster
from coplan.models.spec import PRESETS
from coplan.plan.types import PrecisionPlan, RematPlan

SPEC = PRESETS["gpt-tiny"]
B, S = 8, 32


def _run(compute: str = "fp32", device: str = "cpu", recompute: str = "none", **layout: int) -> dict:
    base = load_cluster("cpu")
    ctx = make_context(SPEC, run_cluster(base, 2, device), B, S)
    plan = plan_for(ctx, compute=compute, **layout)
    if recompute == "full":
        names = [n for v in ctx.index.saved_names.values() for n in v if not n.endswith("mlp_residual")]
        plan = plan.with_(remat=RematPlan(recompute=frozenset(names)))
    req = RunRequest(
        plan=plan, spec=SPEC, steps=3, nproc=2, global_batch=B, seq=S, cluster=base, device=device
    )
    return run_plan(req)


def _check(out: dict, saved_tol: float = 0.05) -> None:
    assert out["grad_check"]["ok"], out["grad_check"]
    m, p = out["measured"], out["predicted"]
    assert abs(m["saved_activation_bytes"] / p["saved_activation_bytes"] - 1) <= saved_tol
    assert len(out["loss"]) == 3 and out["run"]["nproc"] == 2


def test_ddp_two_processes_full_recompute():
    out = _run(recompute="full")
    _check(out)
    assert out["run"]["layout"].startswith("TP1 PP1 DP2")
    assert not out["run"]["not_found"]


@pytest.mark.slow
def test_fsdp2_two_processes_bf16():
    # FSDP2's root (embedding, final norm, LM head, loss) runs eagerly: its all-gathered LM head
    # weight, saved by ``linear`` as a view, is a parameter, not an activation
    out = _run("bf16", zero=1)
    _check(out, saved_tol=0.01)
    assert out["grad_check"]["tolerance"] == tolerance(PrecisionPlan(compute="bf16"), SPEC.n_layers)


@pytest.mark.slow
@pytest.mark.parametrize("compute", ["fp32", "bf16"])
def test_tensor_parallel_two_processes(compute):
    # the embedding, LM head and loss are vocabulary-parallel, as the cost model prices them: each
    # rank keeps half of the fp32 log-softmax (replicated, the measurement was 15-21% above)
    out = _run(compute, tp=2)
    _check(out, saved_tol=0.01)
    assert not out["run"]["not_found"]
    assert out["run"]["layout"].startswith("TP2")


@pytest.mark.slow
@pytest.mark.parametrize(("compute", "recompute"), [("fp32", "none"), ("bf16", "full")])
def test_pipeline_two_stages(compute, recompute):
    # 1F1B over two processes: stage 0 holds two microbatches in flight, stage 1 one; the tied
    # embedding's two copies get the summed gradient (compared with the whole model's)
    out = _run(compute, recompute=recompute, pp=2)
    assert out["grad_check"]["ok"], out["grad_check"]
    assert out["run"]["layout"].startswith("TP1 PP2 DP1")
    note = out["run"]["notes"][0]
    assert "Schedule1F1B, 2 microbatches over 2 stages" in note
    measured = [int(b) for b in note.split("per stage: ")[1].split(" bytes")[0].split(", ")]
    ctx = make_context(SPEC, run_cluster(load_cluster("cpu"), 2, "cpu"), B, S)
    plan = plan_for(ctx, compute=compute, pp=2)
    if recompute == "full":
        plan = plan.with_(remat=RematPlan(recompute=megatron_recompute(ctx, "full")))
    predicted = [st.memory.activations_bytes for st in ctx.price(plan).stages]
    # both stages as priced, to the byte: stage 0 (embedding, block 0, two microbatches in flight)
    # keeps the outputs it sent (torch.distributed.pipelining backpropagates through them), the
    # last stage the input it received
    assert measured[0] == pytest.approx(predicted[0], abs=16)
    assert measured[1] == pytest.approx(predicted[1], abs=16)
    # only the loss, which runs outside the compiled stages, has no node in them
    assert set(out["run"]["not_found"]) <= {".log_softmax", "loss", "total_weight"}


@pytest.mark.gpu
def test_ddp_on_two_gpus_with_nccl():
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs two CUDA devices, {torch.cuda.device_count()} visible")
    _check(_run("bf16", device="cuda"))
