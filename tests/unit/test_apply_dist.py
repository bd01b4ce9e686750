"""Plans applied across processes: DDP, FSDP2 and tensor parallelism over gloo on a CPU (NCCL on
GPUs). Each test spawns two processes (about 10 s); DDP runs in the default tier, the others in
``-m slow``; the GPU variant skips where no CUDA device is visible."""

from __future__ import annotations

import pytest
import torch

from coplan.apply.predict import make_context, plan_for, run_cluster
from coplan.apply.run import RunRequest, run_plan
from coplan.hardware import load_cluster
from coplan.models.spec import PRESETS
from coplan.plan.types import RematPlan

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
    out = _run("bf16", zero=1)
    _check(out)
    assert out["grad_check"]["tolerance"] == 5e-2


@pytest.mark.slow
def test_tensor_parallel_two_processes():
    out = _run(tp=2)
    # known gap: the cost model prices a vocabulary-parallel LM head and loss (the fp32
    # log-softmax halves per rank), the runner keeps them replicated: measured is ~15% above
    _check(out, saved_tol=0.2)
    assert not out["run"]["not_found"]
    assert out["run"]["layout"].startswith("TP2")


@pytest.mark.gpu
def test_ddp_on_two_gpus_with_nccl():
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs two CUDA devices, {torch.cuda.device_count()} visible")
    _check(_run("bf16", device="cuda"))
