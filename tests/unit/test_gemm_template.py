"""GEMMs a plan fuses other ops into run as Inductor's generated templates, not the library's call.

On one H200 Inductor's autotuning timed its best Triton template at 0.84-0.98 of cuBLAS (median
0.91) for Llama 3.2 1B's GEMMs (``devices.json``, ``matmul_template``), and the library call with
a separate epilogue won most of the joint plan's GEMM groups. A GEMM alone, or a library GEMM's
own bias (the IR's linear op), is priced at the library's rate.
"""

from __future__ import annotations

import dataclasses

import pytest

from coplan.cost.kernels import Rates, Scale, kernel_time
from coplan.cost.parts import ZERO, Kernel
from coplan.hardware import load_cluster
from coplan.ir.types import OpKind, Phase

SCALE = Scale(1, False, (2.0, 2.0, 4.0, 4.0, 1.0, 1.0), 2, True, False, True)


def _gemm(template: bool) -> Kernel:
    m, n, k = 16384, 2048, 8192
    return Kernel(Phase.FORWARD, "matmul", 0, 2.0 * m * n * k, 0.0, ZERO, dims=(m, n, k), template=template)


@pytest.mark.parametrize(
    ("cluster", "fraction"), [("dgx-h100", 0.91), ("dgx-h200", 0.91), ("dgx-a100-80gb", 1.0)]
)
def test_a_template_gemm_runs_at_the_devices_fraction(cluster, fraction):
    r = Rates.of(load_cluster(cluster).groups[0].device, "bf16")
    assert r.mm_template == pytest.approx(fraction)
    library = kernel_time(_gemm(False), r, SCALE) - r.launch_s
    assert kernel_time(_gemm(True), r, SCALE) - r.launch_s == pytest.approx(library / fraction)


def test_a_template_masks_unaligned_rows_instead_of_cublas_slow_kernels():
    r = Rates.of(load_cluster("dgx-h100").groups[0].device, "bf16")
    k = Kernel(Phase.BACKWARD, "matmul", 0, 2.0 * 65536 * 768 * 50257, 0.0, ZERO, dims=(65536, 768, 50257))
    unpadded = dataclasses.replace(SCALE, pads=False)
    aligned = kernel_time(k, r, SCALE) - r.launch_s
    assert kernel_time(k, r, unpadded) - r.launch_s == pytest.approx(aligned / r.mm_unaligned)
    templ = dataclasses.replace(k, template=True)
    assert kernel_time(templ, r, unpadded) - r.launch_s == pytest.approx(aligned / r.mm_template)


def test_only_a_plan_group_holding_a_gemm_and_more_is_a_template():
    from coplan.capture.synthetic import build_graph
    from coplan.cost.profile import profile_graph
    from coplan.models.spec import PRESETS

    g = build_graph(PRESETS["gpt-tiny"], 2, 64)
    # the MLP's up projection and the activation reading it: an epilogue
    mm, reader = next(
        (mm, op)
        for mm in g.ops
        if mm.kind is OpKind.MATMUL and mm.phase is Phase.FORWARD
        for op in g.ops
        if mm.outputs[0] in op.inputs and op.kind is OpKind.ELEMENTWISE
    )
    groups = ((mm.id, reader.id),)

    def kernels(fusion):
        prof = profile_graph(g, fusion)
        block = next(p for p in (prof.pre, prof.post, *prof.templates) if mm.id in p.op_ids)
        return [k for k in block.forward if mm.id in k.ops]

    (fused,) = kernels(groups)
    assert fused.template and reader.id in fused.ops
    (alone,) = kernels(((mm.id,),))
    assert not alone.template
    (named,) = kernels("megatron")  # a named kernel set is the library's
    assert not named.template


def test_the_exact_search_bounds_with_library_gemms():
    """``search.exact``'s bound prices the widest fusion with its GEMMs at the library's rate: no
    per-op fusion of the same layout prices below it (a template only slows the GEMM it carries),
    and on a device without templates priced the bound is the plan's own price."""
    from coplan.cli.plan_cmd import make_context
    from coplan.cost.stacks import load_stack
    from coplan.search.exact import library_gemms
    from coplan.search.space import fusion_option

    assert library_gemms(load_cluster("dgx-a100-80gb", 8)) is None
    ctx = make_context("gpt2-124m", "dgx-h100", 1, 8, 1024, 60.0, 0.0, load_stack("coplan"))
    lib = library_gemms(ctx.cluster)
    assert lib is not None and lib.groups[0].device.efficiency["matmul_template"] == 1.0
    base = ctx.default_plan()
    for option in ("epilogue", "greedy", "eager"):
        plan = base.with_(fusion=fusion_option(ctx, option))
        own = ctx.price(plan).step_time_s
        low = ctx.model.estimate(lib, ctx.config_of(plan)).step_time_s
        assert low <= own * (1 + 1e-12)
        assert (low < own) == (option == "epilogue")  # only the epilogue option holds templates
