"""Generated reductions wider than a register-resident row (``cost.looped``): exact extra loads of
the loops Inductor's Triton backend makes, paid on GPUs only, and nothing for library kernels."""

from __future__ import annotations

from dataclasses import replace

import pytest

from coplan.cost import CostModel
from coplan.cost.kernels import Rates, Scale, kernel_time
from coplan.cost.looped import PERSISTENT_ROWS, loop_reads
from coplan.cost.parts import ZERO, vdot
from coplan.cost.profile import _Ctx, profile_graph
from coplan.hardware import load_cluster
from coplan.models.spec import PRESETS
from coplan.plan import PlanContext


def graph(width: int):
    """gpt-tiny with rows ``width`` wide: the vocabulary and the hidden size."""
    spec = replace(PRESETS["gpt-tiny"], vocab_size=width, d_model=width, n_heads=16)
    return PlanContext(CostModel(spec=spec), load_cluster("dgx-h100", 1), 8, 64).index.graph


def op(g, name_prefix: str, phase: str = "forward"):
    return next(o for o in g.ops if o.name.startswith(name_prefix) and o.phase.value == phase)


def test_a_wide_softmax_reads_its_input_twice_a_narrow_one_once():
    wide = graph(2 * PERSISTENT_ROWS)
    ls = op(wide, "log_softmax_")
    vec = _Ctx(wide).vec
    assert loop_reads(wide, (ls.id,), vec) == vec(wide.tensors[ls.inputs[0]])
    narrow = graph(PERSISTENT_ROWS)
    assert loop_reads(narrow, (op(narrow, "log_softmax_").id,), _Ctx(narrow).vec) == ZERO


def test_an_inlined_producer_is_recomputed_in_each_loop_from_its_inputs():
    g = graph(2 * PERSISTENT_ROWS)
    vec = _Ctx(g).vec
    norm = op(g, "layer_norm_")
    add = g.ops[g.tensors[norm.inputs[0]].producer]  # the embeddings' sum feeding the first norm
    assert add.kind.value == "elementwise"
    got = loop_reads(g, (add.id, norm.id), vec)
    # the add is evaluated in both loops: both its inputs are loaded twice; the norm's weight and
    # bias are read in both loops too
    expect = [0.0] * len(got)
    for t in (*add.inputs, *norm.inputs[1:]):
        for i, v in enumerate(vec(g.tensors[t])):
            expect[i] += v
    assert got == pytest.approx(tuple(expect), rel=1e-12)


def test_a_gradient_read_only_after_the_reduction_is_loaded_once():
    """log_softmax's backward: sum the incoming gradient (loop 0), then write ``g - exp(out) * sum``
    (loop 1): the gradient is loaded in both loops, the saved output only in the second."""
    g = graph(2 * PERSISTENT_ROWS)
    bwd = op(g, "log_softmax_bwd_", "backward")
    vec = _Ctx(g).vec
    grad, out = bwd.inputs
    assert g.tensors[out].producer == op(g, "log_softmax_").id
    assert loop_reads(g, (bwd.id,), vec) == vec(g.tensors[grad])


def test_paid_on_gpus_only_and_only_by_generated_kernels():
    g = graph(2 * PERSISTENT_ROWS)
    ls = op(g, "log_softmax_")
    groups = tuple((o.id,) for o in g.ops)
    compiled = profile_graph(g, groups)
    k = next(
        k
        for part in (compiled.pre, compiled.post, *compiled.templates)
        for k in part.forward
        if ls.id in k.ops
    )
    assert any(k.loop_reads)
    cfg_scale = Scale(1, False, (2, 2, 4, 4, 1, 1), 2, True, False)
    gpu = Rates.of(load_cluster("dgx-h100", 1).devices[0], "bf16")
    cpu = Rates.of(load_cluster("cpu", 1).devices[0], "bf16")
    assert gpu.looped_reductions and not cpu.looped_reductions
    extra = vdot(k.loop_reads, cfg_scale.weights) / gpu.bandwidth
    assert kernel_time(k, gpu, cfg_scale) - kernel_time(replace(k, loop_reads=ZERO), gpu, cfg_scale) == (
        pytest.approx(extra, rel=1e-9)
    )
    assert kernel_time(k, cpu, cfg_scale) == kernel_time(replace(k, loop_reads=ZERO), cpu, cfg_scale)
    # eager PyTorch's softmax kernel stages the row in shared memory: nothing to re-read
    eager = profile_graph(g, "none")
    assert not any(
        any(k.loop_reads)
        for part in (eager.pre, eager.post, *eager.templates)
        for k in (*part.forward, *part.backward)
    )
