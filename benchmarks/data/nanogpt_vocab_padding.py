"""nanoGPT's vocabulary padding: what its author measured against what the cost model prices.

    python benchmarks/data/nanogpt_vocab_padding.py [--cluster dgx-a100-40gb] [--json OUT]

karpathy/nanoGPT@77e7e04c (2023-02-04) padded GPT-2's vocabulary from 50,257 to 50,304 rows, "the
nearest multiple of 64", and its commit message gives the measured effect: "about 25% faster. this
is because the last layer is a major latency bottleneck consuming about 40% of latency due to the
very high channel count". An odd vocabulary makes the LM head's gradient GEMMs load operands whose
leading dimension is not a multiple of 16 bytes, and cuBLAS then runs kernels built for narrower
alignment: the cost model prices them at the device's ``matmul_unaligned`` fraction of the GEMM
rate (``coplan.cost.kernels``). The A100 presets' 0.34 is the fraction at which this check prices
both measured figures; the unfused attention's odd head dimension keeps the lower ``bmm_unaligned``
fitted on BLOOM's trials (``bloom_width_pairs.py``). This check prices the same step both ways.

The step is ``bench.py`` at that commit as it ran by default: GPT-2 124M (12 layers, 12 heads, 768
wide, LayerNorm and Linear without biases, the LM head tied to the token embedding, GeLU MLP),
batch 12 x 1,024 tokens, bfloat16 autocast, ``torch.compile`` of the model (PyTorch 2.0 nightlies
of early 2023), SDPA's causal flash kernel (``model.py``: ``self.flash`` when
``scaled_dot_product_attention`` exists and dropout is 0), fused AdamW where the nightly has it
(``configure_optimizers``: ``fused=True``), one A100 40GB (the README's GPU). Inductor did not pad
matrix multiplies then: ``shape_padding`` came in off by default (pytorch/pytorch#88709, 2022-11,
``TORCHINDUCTOR_SHAPE_PADDING`` defaulting to "0") and was turned on in pytorch/pytorch#101915
(2023-05-25, "Turns on torchinductor mm padding"), so both steps are priced with the model's shapes
as they are (``TrainingConfig.gemm_padding`` off).

Printed: the priced step at each vocabulary, the padded step's speed over the unpadded one
(measured "about 25% faster"), and the unpadded step's share in the LM head and its loss (measured
"about 40% of latency"). The commit does not say which GPU or script took the figures; these are
the defaults of the script it edits.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from coplan.cost import CostModel, load_stack
from coplan.cost.config import TrainingConfig
from coplan.cost.explain import kernel_costs
from coplan.hardware import load_cluster
from coplan.models.spec import load_model_spec

#: karpathy/nanoGPT@77e7e04c model.py GPTConfig and bench.py defaults, where they differ from the
#: registry's GPT-2 124M: no biases (bench.py ``bias = False``), the LM head tied to the token
#: embedding, no dropout
GPT2 = dict(tied_embeddings=True, bias=False, hidden_dropout=0.0, attention_dropout=0.0)
BATCH = 12
MEASURED_SPEEDUP = 1.25  # "about 25% faster"
MEASURED_HEAD_SHARE = 0.40  # "consuming about 40% of latency"


def price(vocab: int, cluster_name: str) -> dict[str, Any]:
    """The priced step of nanoGPT's ``bench.py`` at ``vocab`` rows, and its LM head's share."""
    spec = replace(load_model_spec("gpt2-124m"), vocab_size=vocab, **GPT2)
    cluster = load_cluster(cluster_name, 1)
    model = CostModel(spec=spec)
    base = TrainingConfig(microbatch=BATCH, global_batch=BATCH, seq=1024, dtype="bf16", flash_attention=True)
    stack = replace(load_stack("eager-compile"), gemm_padding=False)
    config = stack.configure(base).with_(optimizer="fused")
    est = model.estimate(cluster, config)
    rows = kernel_costs(model.profile_for(config), cluster, config, 0)
    total = sum(k.total_s for k in rows)
    head = sum(k.total_s for k in rows if k.part == "head")
    busy = est.breakdown_s["compute"] + est.breakdown_s["recompute"]
    head_s = head / total * busy if total else 0.0
    return {
        "vocab": vocab,
        "step_s": est.step_time_s,
        "head_s": head_s,
        "head_share": head_s / est.step_time_s,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cluster", default="dgx-a100-40gb")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    odd, padded = price(50257, args.cluster), price(50304, args.cluster)
    speedup = odd["step_s"] / padded["step_s"]
    print(f"nanoGPT bench.py at 77e7e04c on {args.cluster}, compiled, vocabulary unpadded by Inductor")
    for r in (odd, padded):
        print(
            f"  vocab {r['vocab']:>6}: step {r['step_s'] * 1e3:7.1f} ms, LM head and loss "
            f"{r['head_s'] * 1e3:6.1f} ms ({r['head_share']:.0%} of the step)"
        )
    print(
        f"  padded over unpadded: priced {speedup:.2f}x faster, "
        f"measured 'about 25%' ({MEASURED_SPEEDUP:.2f}x)"
    )
    print(
        f"  LM head share of the unpadded step: priced {odd['head_share']:.0%}, "
        f"measured 'about 40%' ({MEASURED_HEAD_SHARE:.0%})"
    )
    if args.json:
        args.json.write_text(
            json.dumps({"unpadded": odd, "padded": padded, "speedup": speedup}, indent=1) + "\n"
        )


if __name__ == "__main__":
    main()
