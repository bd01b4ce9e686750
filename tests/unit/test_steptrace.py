"""The allocation trace of training steps (``coplan.cost.steptrace``) and the reserved peak the
caching allocator gives it (``CostModel.reserved``)."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace

import pytest

from coplan.cost import CostModel, TrainingConfig, load_stack
from coplan.cost.caching import replay, round_size
from coplan.cost.checkpoint import selective_op_names
from coplan.cost.stacks import StackError
from coplan.cost.stages import static_bytes
from coplan.cost.steptrace import COMPUTE, GATHER, SCATTER, reserved_memory, step_events
from coplan.hardware import load_cluster
from coplan.ir.types import TensorRole
from coplan.models.spec import PRESETS

LLAMA = replace(PRESETS["llama-tiny"], n_layers=4)


def _graph(mb: int = 2, seq: int = 64):  # type: ignore[no-untyped-def]
    return CostModel(spec=LLAMA).graph_for(mb, seq)


def _config(**kw) -> TrainingConfig:  # type: ignore[no-untyped-def]
    base = dict(microbatch=2, global_batch=2 * kw.get("dp", 1), seq=64, dtype="bf16")
    base.update(kw)
    return TrainingConfig(**base)  # type: ignore[arg-type]


def _left(events) -> int:  # type: ignore[no-untyped-def]
    """Bytes still allocated once every event has run (each request rounded as the allocator does)."""
    live: dict[int, int] = {}
    for h, n, _ in events:
        if n < 0:
            del live[h]
        else:
            live[h] = round_size(n)
    return sum(live.values())


def _params(g) -> list[float]:  # type: ignore[no-untyped-def]
    return [t.numel for t in g.tensors if t.role is TensorRole.PARAMETER and t.alias_of is None]


@pytest.mark.parametrize(
    ("sharding", "kw"),
    [
        ("megatron-distopt", dict(zero=1, dp=8)),
        ("fsdp2", dict(zero=3, dp=8, fsdp_units=True)),
        ("ddp", dict(zero=0, dp=1)),
    ],
)
def test_a_step_leaves_exactly_the_state(sharding: str, kw: dict) -> None:
    """After the steps only the parameters, master weights and moments are allocated, plus the
    gradient buffers where the stack keeps them (Megatron's); PyTorch drops its gradients."""
    g = _graph()
    c = _config(**kw)
    w = gb = o = 0
    for n in _params(g):
        a, b, d = static_bytes(n, c, c.shard_ranks)
        w, gb, o = w + a, gb + b, o + d
    want = w + o + (gb if sharding == "megatron-distopt" else 0)
    left = _left(step_events(g, c, sharding))
    # each tensor rounds up to 512 bytes: a parameter and its three states
    assert want <= left <= want + 4 * 512 * len(_params(g))


def test_recomputation_lowers_the_allocated_peak() -> None:
    g = _graph()
    peaks = {}
    for name, rec in (
        ("none", "none"),
        ("per-op", selective_op_names(g)),
        ("full", "full"),
    ):
        c = _config(recompute=rec)
        peaks[name] = replay(step_events(g, c, "ddp")).allocated_bytes
    assert peaks["full"] < peaks["per-op"] < peaks["none"]
    # a count of fully recomputed blocks lies between none and full
    some = replay(step_events(g, _config(recompute="full", recompute_layers=2), "ddp")).allocated_bytes
    assert peaks["full"] < some < peaks["none"]


def test_fsdp_gathers_and_reduces_on_their_own_streams() -> None:
    g = _graph()
    fsdp = {s for _, n, s in step_events(g, _config(zero=3, dp=8, fsdp_units=True), "fsdp2") if n >= 0}
    assert fsdp == {COMPUTE, GATHER, SCATTER}
    ddp = {s for _, n, s in step_events(g, _config(zero=0, dp=8), "ddp") if n >= 0}
    assert ddp == {COMPUTE}


def test_fsdp1_returns_a_unit_buffer_to_its_pool_one_unit_later() -> None:
    """FSDP1 frees its unsharded flat parameter after ``record_stream`` on the compute stream, so
    the gather stream's pool gets the block back only after the next unit is resharded: the unit
    computed, the one prefetched and the one pending make three buffers live on the gather stream,
    where FSDP2 copies each all-gather output out and frees it at once."""
    g = _graph()
    c = _config(zero=3, dp=8, fsdp_units=True)
    unit = int(LLAMA.block_params() * 2)  # a block's parameters gathered in bf16

    def most_live(sharding: str) -> int:
        live: set[int] = set()
        sizes: dict[int, int] = {}
        most = 0
        for h, n, s in step_events(g, c, sharding):
            if n >= 0:
                sizes[h] = n
                if s == GATHER and n == unit:
                    live.add(h)
            else:
                live.discard(h)
            most = max(most, len(live))
        return most

    assert most_live("fsdp2") == 1
    assert most_live("fsdp1") == 3


@pytest.mark.parametrize(("reduce_fp32", "casts"), [(True, 1), (False, 0)])
def test_fsdp1_holds_autograds_flat_gradient_until_the_next_unit(reduce_fp32: bool, casts: int) -> None:
    """FSDP1's unit gradient is autograd's flat gradient in the parameter dtype, made on the
    compute stream and freed after ``record_stream`` on the post-backward stream: it is held
    through the next unit's backward, until that unit's gradient takes its place. The cast to an
    fp32 reduce dtype is one copy on the post-backward stream; a 16-bit reduction needs none."""
    g = _graph()
    c = _config(zero=3, dp=8, fsdp_units=True, grad_reduce_fp32=reduce_fp32)
    flat = int(LLAMA.block_params() * 2)  # a block's gradients in bf16
    events = step_events(g, c, "fsdp1")
    made = [i for i, (_, n, s) in enumerate(events) if n == flat and s == COMPUTE]
    assert len(made) == 2 * LLAMA.n_layers  # a unit a step, two steps
    freed_at = {h: k for k, (h, n, _) in enumerate(events) if n < 0}
    for step in range(2):
        ours = made[step * LLAMA.n_layers : (step + 1) * LLAMA.n_layers]
        for mine, nxt in itertools.pairwise(ours):
            assert freed_at[events[mine][0]] > nxt  # held until the next unit's is made
    live: set[int] = set()
    most = 0
    for h, n, s in events:
        if n == flat and s == COMPUTE:
            live.add(h)
        elif n < 0:
            live.discard(h)
        most = max(most, len(live))
    assert most == 2  # the unit's and the one before it, never more
    cast = int(LLAMA.block_params() * 4)
    assert sum(1 for _, n, s in events if n == cast and s == SCATTER) == casts * 2 * LLAMA.n_layers


def test_the_reserved_peak_holds_the_allocated_one_and_the_device_caps_it() -> None:
    g = _graph()
    c = _config(zero=3, dp=8, fsdp_units=True)
    free = reserved_memory(g, c, "fsdp2", 1e9, 80e9, expandable=False)
    assert free.reserved_bytes == free.allocated_bytes + free.overhead_bytes
    assert free.overhead_bytes >= 0 and not free.releases_cache
    tight = reserved_memory(g, c, "fsdp2", 1e9, 1e9 + free.overhead_bytes / 2, expandable=False)
    assert tight.reserved_bytes == tight.capacity_bytes and tight.releases_cache
    extra = reserved_memory(g, c, "fsdp2", 1e9, 80e9, expandable=False, extra_fraction=0.1)
    assert extra.overhead_bytes == pytest.approx(free.overhead_bytes + 0.1e9)


def test_the_cost_model_gives_a_reserved_peak_on_gpus_only() -> None:
    cm = CostModel(spec=LLAMA)
    c = load_stack("torchtitan").configure(_config(zero=3, dp=8))
    est = cm.estimate(load_cluster("dgx-h100", 8), c)
    got = cm.reserved(load_cluster("dgx-h100", 8), est, load_stack("torchtitan"))
    assert got is not None and got.expandable_segments
    assert got.reserved_bytes >= est.memory.peak_bytes
    cpu = cm.estimate(load_cluster("cpu", 1), _config(dtype="fp32"))
    assert cm.reserved(load_cluster("cpu", 1), cpu, load_stack("coplan")) is None


def test_estimate_json_reports_the_reserved_peak(cli) -> None:  # type: ignore[no-untyped-def]
    code, out, err = cli(
        "estimate", "--model", "llama-tiny", "--gpus", "8", "--zero", "3", "--stack", "torchtitan", "--json"
    )
    assert code == 0, err
    mem = json.loads(out)["memory"]
    assert mem["reserved_bytes"] >= mem["peak_bytes"]
    assert mem["expandable_segments"] is True
    assert mem["allocator_overhead_bytes"] >= 0


def test_microbatches_accumulate_into_the_gradients_of_the_first() -> None:
    """Under gradient accumulation the step's first backward makes ``.grad`` and later ones add
    into it: the gradients live through the later microbatches' forwards, once, not once per
    microbatch."""
    g = _graph()
    grads = sum(round_size(4 * n) for n in _params(g))
    one = replay(step_events(g, _config(), "ddp")).allocated_bytes
    four = replay(step_events(g, _config(global_batch=8), "ddp")).allocated_bytes
    assert one < four <= one + grads


@pytest.mark.parametrize("sharding", ["fsdp1", "fsdp2"])
def test_fsdp_makes_its_gradient_shards_on_the_reduce_scatter_stream(sharding: str) -> None:
    """FSDP1's post-backward stream and FSDP2's reduce-scatter stream allocate the sharded
    gradients, so the blocks ``zero_grad`` frees stay in that stream's pool, which the next
    forward's activations cannot use: the reserved peak holds them beyond the allocated one."""
    g = _graph()
    c = _config(zero=3, dp=8, fsdp_units=True)
    shard = int(LLAMA.block_params() * 4 / 8)  # a block's fp32 gradient shard
    events = step_events(g, c, sharding)
    streams = [s for _, n, s in events if n == shard]
    assert len(streams) == 2 * LLAMA.n_layers and set(streams) == {SCATTER}  # two steps
    # the first step's shards, freed by zero_grad, stay in the scatter pool through the second
    # step's forward: the reserved peak holds them beyond the allocated one
    assert replay(events).overhead_bytes >= LLAMA.n_layers * round_size(shard)


def test_fsdp2_keeps_its_reduce_scatter_input_until_the_next_unit() -> None:
    """FSDP2 allocates the reduce-scatter input on the compute stream and keeps it until the next
    unit's reduction (``reduce_scatter_states``), through that unit's backward; FSDP1 casts on its
    post-backward stream and frees the cast once its shard is out."""
    g = _graph()
    c = _config(zero=3, dp=8, fsdp_units=True)
    assert c.grad_reduce_fp32
    sizes = {int(LLAMA.block_params() * 4)}  # a block's gradients in the reduce dtype, fp32
    for sharding, where, stream, most in (
        ("fsdp2", "compute", COMPUTE, None),
        ("fsdp1", "compute", SCATTER, 1),
        # FSDP2 before pytorch/pytorch#129721: made on the reduce-scatter stream, dropped once reduced
        ("fsdp2", "reduce-scatter", SCATTER, 1),
    ):
        events = step_events(g, c, sharding, reduce_input=where)
        first = next(i for i, (_, n, _) in enumerate(events) if n in sizes)
        h, _, s = events[first]
        assert s == stream
        end = next(i for i in range(first + 1, len(events)) if events[i][0] == h)
        between = sum(1 for _, n, _ in events[first + 1 : end] if n >= 0)
        if most is None:
            assert between > 1  # the next block's backward allocates while it is held
        else:
            assert between == most  # only its gradient shard


def test_a_stack_names_where_fsdp2_makes_its_reduce_scatter_input() -> None:
    """``StackSpec.reduce_input`` reaches the replay: FSDP2's input on its reduce-scatter stream
    (its early versions) is a spike in that stream's pool, which the compute stream cannot reuse
    (pytorch/pytorch#129721), so it reserves more beside the same allocated peak; a value the
    stack does not know is refused."""
    cm = CostModel(spec=replace(PRESETS["gpt2-124m"], n_layers=4))
    stack = replace(load_stack("torchtitan"), expandable_segments=False)
    assert stack.reduce_input == "compute"
    cluster = load_cluster("dgx-h100", 8)
    est = cm.estimate(cluster, stack.configure(_config(zero=3, dp=8, global_batch=16)))
    late = cm.reserved(cluster, est, stack)
    early = cm.reserved(cluster, est, replace(stack, reduce_input="reduce-scatter"))
    assert late is not None and early is not None
    assert early.allocated_bytes == late.allocated_bytes
    assert early.overhead_bytes > late.overhead_bytes
    with pytest.raises(StackError, match="reduce_input"):
        replace(stack, reduce_input="side")
