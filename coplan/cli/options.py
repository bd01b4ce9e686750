"""The options the commands share: one flag, one meaning, one default job, fixed choices listed.

Vocabulary (every command):
- ``--global-batch`` / ``--batch`` / ``-b``: sequences per optimizer step, over all GPUs;
- ``--microbatch``: sequences per microbatch (one forward/backward of one pipeline stage);
- ``--seq`` / ``-s``: tokens per sequence; ``--gpus`` / ``-g``: devices in the job;
- sizes read and printed in GiB (2^30 bytes), with the unit shown.

The default job is the same everywhere: GPT-2 124M on one H100 of a DGX, 32 sequences per step.
Choices are Typer enums so ``--help`` lists them and a wrong one is refused before any work; the
enums repeat the library's registries (imported lazily, as the library takes seconds to import),
and a test holds each to its registry.
"""

from __future__ import annotations

import enum
import math
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from coplan.cost.stacks import StackSpec

DEFAULT_MODEL = "gpt2-124m"
DEFAULT_CLUSTER = "dgx-h100"
DEFAULT_GPUS = 1
#: Sequences per optimizer step of the default job. With more data-parallel replicas than that,
#: the default rounds up to a multiple of the replicas so every replica gets whole microbatches.
DEFAULT_GLOBAL_BATCH = 32


def default_global_batch(unit: int) -> int:
    """The default job's global batch for ``unit`` sequences per round (microbatch x data-parallel
    replicas): the smallest multiple of ``unit`` of at least ``DEFAULT_GLOBAL_BATCH``."""
    return unit * max(1, math.ceil(DEFAULT_GLOBAL_BATCH / unit))


class Strategy(enum.StrEnum):  # coplan.search.STRATEGIES
    sequential = "sequential"
    sequential_best = "sequential-best"
    iterated = "iterated"
    hierarchical = "hierarchical"
    joint = "joint"
    joint_exact = "joint-exact"
    exhaustive = "exhaustive"
    learned = "learned"
    learned_greedy = "learned-greedy"
    learned_search = "learned-search"


class StackName(enum.StrEnum):  # coplan.cost.stacks.stack_names()
    coplan = "coplan"
    deepspeed = "deepspeed"
    eager = "eager"
    eager_compile = "eager-compile"
    fsdp = "fsdp"
    fsdp_compile = "fsdp-compile"
    megatron = "megatron"
    open = "open"
    torchtitan = "torchtitan"
    torchtitan_compile = "torchtitan-compile"
    xla = "xla"


class Device(enum.StrEnum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


ModelOpt = Annotated[
    str, typer.Option("--model", "-m", help="Model preset (e.g. gpt2-124m, llama2-7b) or a spec JSON file.")
]
ClusterOpt = Annotated[
    str,
    typer.Option(
        "--cluster",
        "-c",
        help="Cluster or device preset (coplan hardware), or a JSON file (e.g. calibrated).",
    ),
]
GpusOpt = Annotated[int, typer.Option("--gpus", "-g", help="Devices in the job.")]
GlobalBatchOpt = Annotated[
    int | None,
    typer.Option(
        "--global-batch",
        "--batch",
        "-b",
        help=f"Sequences per optimizer step, all GPUs together \\[default: {DEFAULT_GLOBAL_BATCH}, "
        "rounded up to a multiple of the data-parallel replicas].",
        show_default=False,
    ),
]
MicrobatchOpt = Annotated[
    int, typer.Option("--microbatch", help="Sequences per microbatch (one forward and backward).")
]
SeqOpt = Annotated[
    int | None, typer.Option("--seq", "-s", help="Tokens per sequence \\[default: the model's seq_len].")
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")]
HtmlOpt = Annotated[
    Path | None, typer.Option("--html", help="Write a self-contained interactive HTML report here.")
]
BudgetOpt = Annotated[
    float | None,
    typer.Option(
        "--memory-budget-gb",
        help="Memory per GPU the plan may use, GiB \\[default: capacity x 0.95 - 1 GiB reserve].",
        show_default=False,
    ),
]
StackOpt = Annotated[
    StackName | None,
    typer.Option(
        "--stack",
        help="The training stack that runs the step (its kernels, attention kernel, sharding and "
        "overlaps; docs/stacks.md) \\[default: megatron].",
        show_default=False,
    ),
]
StackFileOpt = Annotated[
    Path | None,
    typer.Option("--stack-file", help="A stack read from a JSON file of a preset's shape (docs/stacks.md)."),
]


def resolve_stack(stack: StackName | None, stack_file: Path | None) -> StackSpec:
    """The stack ``--stack`` or ``--stack-file`` names (megatron when neither does)."""
    from coplan.plan.capabilities import plan_stack

    return plan_stack(stack.value if stack is not None else None, stack_file)


CompileOpt = Annotated[
    bool | None,
    typer.Option(
        "--compile/--no-compile",
        help="Blocks compiled with torch.compile, on a stack with a compile flag (torchtitan's "
        "training.compile, fms-fsdp's use_torch_compile, nanoGPT's compile): priced with its "
        "compiled preset's kernels (the stack's compile_preset), with its float8 and async TP "
        r"\[default: the stack's own kernels].",
        show_default=False,
    ),
]


def compiled_stack(stack: StackSpec, on: bool | None) -> StackSpec:
    """``stack`` as ``--compile`` / ``--no-compile`` runs it: its ``compile_preset`` compiled, itself
    eager; unchanged where neither is given. A flag the stack has no setting for is bad input."""
    from coplan.cost.stacks import load_stack, stack_names
    from coplan.errors import SpecError

    if on is None or (not on and stack.kernels != "inductor"):
        return stack
    if stack.compile_preset:
        return stack.kernels_for("compiled")
    if stack.kernels == "inductor":
        if on:
            return stack
        eager = [n for n in stack_names() if load_stack(n).compile_preset == stack.name]
        alt = f"; its eager form is --stack {eager[0]}" if eager else ""
        raise SpecError("--no-compile", None, f"stack {stack.name!r} always compiles{alt}")
    raise SpecError(
        "--compile", None, f"stack {stack.name!r} has no torch.compile flag (it runs {stack.kernels} kernels)"
    )
