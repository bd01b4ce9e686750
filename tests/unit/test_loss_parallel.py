"""DTensor's loss parallelism (torchtitan under tensor parallelism): its loss holds one fp32 logits
tensor more than ATen's at its peak, measured on this CPU, and the ``parallel`` loss form prices
exactly that much more (``coplan.cost.eager``, ``parallel``)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from coplan.cost import CostModel, TrainingConfig, load_stack
from coplan.hardware import load_cluster
from coplan.models.spec import ModelSpec

#: One process per form: glibc returns every block above the mmap threshold to the system when it
#: is freed, so the process's peak resident size, restarted before the loss (``clear_refs``), less
#: its size then is the peak of the loss's live tensors; a world of one rank, the logits one
#: DTensor shard.
PROBE = """
import sys, torch, torch.nn.functional as F, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import loss_parallel
import contextlib
torch.manual_seed(0)
form, tokens, vocab = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
h = torch.randn(tokens, 64, dtype=torch.bfloat16, requires_grad=True)
w = torch.randn(vocab, 64, dtype=torch.bfloat16, requires_grad=True)
labels = torch.randint(0, vocab, (tokens,))
pred = h @ w.t()
if form == "parallel":
    pred = DTensor.from_local(pred, mesh, [Shard(1)])
def peak():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak resident size restarts from the present one
base = peak()
with loss_parallel() if form == "parallel" else contextlib.nullcontext():
    loss = F.cross_entropy(pred.float(), labels)
    fwd = peak()
    del pred
    loss.backward()
n = tokens * vocab
# per logit, the 16-bit logits (live from the start) included
print((fwd - base) / n + 2, (peak() - base) / n + 2)
dist.destroy_process_group()
"""


def _measured(form: str, tokens: int = 2048, vocab: int = 16384) -> tuple[float, float]:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    got = subprocess.run(
        [sys.executable, "-c", PROBE, form, str(tokens), str(vocab)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert got.returncode == 0, got.stderr[-2000:]
    out = got.stdout.split()
    return float(out[-2]), float(out[-1])


@pytest.mark.capture
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc and glibc's mmap threshold")
def test_loss_parallel_holds_one_fp32_logits_tensor_more_than_atens_loss():
    aten = _measured("float")
    parallel = _measured("parallel")
    # bytes a logit: forward (16-bit logits, their fp32 copy, the log-probabilities; loss
    # parallel's shifted logits and their exp besides) and the whole step's peak (the
    # log-probabilities and two gradients; loss parallel's zeros, exp and their sum besides)
    # (within 0.3 a logit: the token-sized masks, targets and statistics besides)
    assert aten == pytest.approx((10.0, 12.0), abs=0.3)
    assert parallel == pytest.approx((14.0, 16.0), abs=0.3)


def _spec() -> ModelSpec:
    return ModelSpec(name="tt", n_layers=2, d_model=256, n_heads=8, n_kv_heads=8, ffn_hidden=704,
                     vocab_size=32768, seq_len=128, activation="swiglu", norm="rmsnorm", position="rope",
                     tied_embeddings=False, bias=False)  # fmt: skip


@pytest.mark.parametrize("stack", ["torchtitan", "torchtitan-compile"])
def test_the_parallel_loss_prices_one_fp32_logits_shard_more_at_the_peak(stack):
    """Eager kernels, or compiled blocks with the loss eager (a torchtitan run before 2025-04)."""
    model = CostModel(spec=_spec())
    cluster = load_cluster("dgx-h100", 2)
    base = TrainingConfig(microbatch=4, global_batch=4, seq=128, tp=2, sequence_parallel=True)
    config = load_stack(stack).configure(base)
    if stack == "torchtitan-compile":
        config = config.with_(eager_loss=True)
    assert config.eager_loss_cast == "parallel"
    parallel = model.estimate(cluster, config).memory
    aten = model.estimate(cluster, config.with_(eager_loss_cast="float")).memory
    shard = 4 * 128 * 32768 / 2  # logits of one microbatch on one of two ranks
    assert parallel.transient_bytes - aten.transient_bytes == pytest.approx(4 * shard)
    assert parallel.peak_bytes - aten.peak_bytes == pytest.approx(4 * shard)
    # and more kernels: the log-softmax written out, its backward fused into nll_loss's
    assert (
        model.estimate(cluster, config).step_time_s
        > model.estimate(cluster, config.with_(eager_loss_cast="float")).step_time_s
    )


def test_without_tensor_parallelism_the_loss_is_atens():
    """torchtitan turns loss parallelism on only under tensor parallelism (its logits are sharded
    over the vocabulary only there)."""
    config = load_stack("torchtitan").configure(TrainingConfig(microbatch=4, global_batch=8, seq=128, zero=3))
    assert config.eager_loss_cast == "float"


def test_a_compiled_loss_is_inductors_whatever_the_eager_form():
    """Where torch.compile covers the loss (a torchtitan run from 2025), the eager form prices
    nothing: the same step and memory with and without ``parallel``."""
    model = CostModel(spec=_spec())
    cluster = load_cluster("dgx-h100", 2)
    base = TrainingConfig(microbatch=4, global_batch=4, seq=128, tp=2, sequence_parallel=True)
    config = load_stack("torchtitan-compile").configure(base)
    assert not config.eager_loss
    a = model.estimate(cluster, config)
    b = model.estimate(cluster, config.with_(eager_loss_cast="float"))
    assert (a.step_time_s, a.memory.peak_bytes) == (b.step_time_s, b.memory.peak_bytes)
