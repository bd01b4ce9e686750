"""Which ATen ops ``nn.RMSNorm`` dispatches to on this machine, forward and backward, in the cases
the cost model prices differently (``StackSpec.fused_rmsnorm``):

- ``runner``: coplan's runner's eager baseline, an fp32 input and fp32 weight under bf16 autocast
  (its residual stream stays fp32);
- ``bf16``: input and weight both bf16 (a model cast to bf16, or FSDP's bf16 parameters);
- ``mixed``: a bf16 input against an fp32 weight (a linear's autocast output into an fp32 norm).

PyTorch's CUDA build runs ``aten._fused_rms_norm`` where input and weight share a dtype and its
composite ops (``pow``, ``mean``, ``rsqrt``, ``mul``) where they do not, with a warning
(aten/src/ATen/native/layer_norm.cpp); a CPU build decomposes every case. Prints one JSON object.

    python benchmarks/data/rmsnorm_dispatch.py [--device cuda|cpu]
"""

from __future__ import annotations

import argparse
import json
import warnings

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class _Ops(TorchDispatchMode):
    """The names of the ATen ops dispatched inside it, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops.append(str(func.overloadpacket).removeprefix("aten."))
        return func(*args, **(kwargs or {}))


CASES = {
    "runner": (torch.float32, torch.float32, True),
    "bf16": (torch.bfloat16, torch.bfloat16, False),
    "mixed": (torch.bfloat16, torch.float32, False),
}


def dispatched(device: str, x_dtype: torch.dtype, w_dtype: torch.dtype, autocast: bool) -> dict[str, object]:
    """The ops of one forward and backward of ``nn.RMSNorm`` over a (4, 64, 256) input."""
    norm = torch.nn.RMSNorm(256, device=device, dtype=w_dtype)
    x = torch.randn(4, 64, 256, device=device, dtype=x_dtype, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with _Ops() as fwd, torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            y = norm(x)
        with _Ops() as bwd:
            y.float().sum().backward()
    ops = fwd.ops + bwd.ops
    return {
        "forward": fwd.ops,
        "backward": bwd.ops,
        "fused": any(o.startswith("_fused_rms_norm") for o in ops),
        "fallback_warning": any("Cannot dispatch to fused" in str(w.message) for w in caught),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    out = {"device": args.device, "torch": torch.__version__}
    out.update({name: dispatched(args.device, *case) for name, case in CASES.items()})
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
