"""Training jobs sampled for the learned planner: a model, a cluster, a batch and a memory budget.

Job ``i`` of seed ``s`` is drawn from its own generator (``random.Random(f"{s}:{i}")``), so any
shard of a dataset can be (re)made alone, in any process, in any order, and comes out the same.

What is sampled, and why:

- **families**: ``gpt`` (LayerNorm, GELU, learned positions, biases: GPT-2's shapes) and ``llama``
  (RMSNorm, SwiGLU, rotary positions, grouped-query attention) are trained on; ``moe`` (the
  LLaMA block with routed experts) and ``encoder`` (BERT's block: GPT's with bidirectional
  attention, BERT's 30,522-token vocabulary and 512 positions at most) are held-out families,
  never trained on, to test whether what was learned carries to a block, and to a model that is
  not a decoder, it has not seen;
- **sizes**: depth and width across the range coplan plans (2 to 48 layers, widths 512 to 8,192);
  widths in ``HELDOUT_WIDTHS`` are kept out of training for the trained families too, so the
  held-out graphs split asks for shapes the policy has not seen;
- **devices**: the GPU presets, and with probability ``HYPOTHETICAL_P`` a device that does not
  exist, each of matrix and vector throughput, memory bandwidth, capacity and the links scaled
  by its own factor in [1/2, 2] (log-uniform), so the policy is conditioned on the device
  description rather than on its name;
- **jobs**: GPU counts 1 to 1,024 (mostly up to 64, where labelling takes seconds), global
  batches a multiple of the GPU count, and memory budgets from the default (capacity less the
  reserve) down to a third of it, where recomputation and sharding must be chosen; some budgets
  fit nothing, which is an answer the policy must learn;
- **stacks**: ``coplan`` (coplan's runner: every decision per op), ``megatron`` (coplan's default:
  Megatron's kernels and checkpointing policies, the widest parallel space) and ``torchtitan``,
  so the policy learns what each stack can run (the stack is one of its global features).
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from dataclasses import dataclass
from typing import Any

from coplan.hardware.cluster import ClusterSpec
from coplan.hardware.registry import load_cluster
from coplan.models.spec import ModelSpec

__all__ = [
    "FAMILIES",
    "HELDOUT_FAMILIES",
    "HELDOUT_WIDTHS",
    "LARGE_SPLITS",
    "SPLITS",
    "STACKS",
    "Job",
    "sample_job",
]

FAMILIES = ("gpt", "llama", "moe", "encoder")
#: the families never trained on, and the split each one's jobs are in
FAMILY_SPLITS = {"moe": "heldout_family", "encoder": "heldout_encoder"}
HELDOUT_FAMILIES = tuple(FAMILY_SPLITS)
#: widths of the trained families held out of training (the held-out graphs)
HELDOUT_WIDTHS = (1536, 3072)
#: train, validation, held-out graphs of trained families, the held-out families (MoE; encoders)
SPLITS = ("train", "val", "heldout", "heldout_family", "heldout_encoder")
#: the large jobs search distillation fine-tunes on and holds out (``distill.sample_large_job``)
LARGE_SPLITS = ("large_train", "large_heldout")
VAL_SHARE = 0.1
HYPOTHETICAL_P = 0.3

_WIDTHS = (512, 768, 1024, 1536, 2048, 2560, 3072, 4096, 5120, 8192)
_DEPTHS = (2, 4, 6, 8, 12, 16, 24, 32, 48)
_SEQS = (512, 1024, 2048, 4096)
#: encoders train at BERT's lengths: 128 tokens for most of pre-training, 512 for the rest (Devlin
#: et al. 2019, appendix A.2)
_ENCODER_SEQS = (128, 256, 512)
_GPUS = (1, 2, 4, 8, 16, 32, 64)
_MANY_GPUS = (128, 256, 512, 1024)
MANY_GPUS_P = 0.15
STACKS = ("coplan", "megatron", "torchtitan")
_STACK_WEIGHTS = (0.5, 0.3, 0.2)
_CLUSTERS = ("dgx-a100-40gb", "dgx-a100-80gb", "dgx-h100", "dgx-h200", "dgx-b200", "mi300x-node")
_BUDGETS = (1.0, 1.0, 0.6, 0.35)
#: parameters per job at most, so that labelling one job stays within seconds
_MAX_PARAMS = 2.0e10


@dataclass(frozen=True, slots=True)
class Job:
    """One planning problem: a model, a cluster (with its device, real or hypothetical), the
    global batch and sequence, and the memory budget as a fraction of the default one."""

    index: int
    family: str
    split: str
    spec: ModelSpec
    cluster: ClusterSpec
    global_batch: int
    seq: int
    budget_fraction: float
    hypothetical: bool
    stack: str = "coplan"

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"family must be one of {', '.join(FAMILIES)}, got {self.family!r}")
        if self.split not in SPLITS + LARGE_SPLITS:
            raise ValueError(f"split must be one of {', '.join(SPLITS + LARGE_SPLITS)}, got {self.split!r}")
        if self.stack not in STACKS:
            raise ValueError(f"stack must be one of {', '.join(STACKS)}, got {self.stack!r}")
        if not 0.0 < self.budget_fraction <= 1.0:
            raise ValueError(f"budget_fraction must be in (0, 1], got {self.budget_fraction!r}")

    @property
    def gpus(self) -> int:
        return self.cluster.num_devices

    @property
    def id(self) -> str:
        """A short content hash: the same job has the same id in every dataset."""
        blob = json.dumps(self.to_dict() | {"index": 0}, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def context(self) -> Any:
        """The ``PlanContext`` of this job, planned for its stack."""
        from coplan.cost import CostModel, load_stack
        from coplan.plan import PlanContext
        from coplan.plan.context import default_budget

        cap = min(d.memory_bytes for d in self.cluster.devices)
        budget = default_budget(cap) * self.budget_fraction
        return PlanContext(
            CostModel(spec=self.spec),
            self.cluster,
            self.global_batch,
            self.seq,
            budget_bytes=budget,
            stack=load_stack(self.stack),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "family": self.family,
            "split": self.split,
            "spec": self.spec.to_dict(),
            "cluster": self.cluster.to_dict(),
            "global_batch": self.global_batch,
            "seq": self.seq,
            "budget_fraction": self.budget_fraction,
            "hypothetical": self.hypothetical,
            "stack": self.stack,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "<job>") -> Job:
        return cls(
            index=int(data["index"]),
            family=str(data["family"]),
            split=str(data["split"]),
            spec=ModelSpec.from_dict(data["spec"], source=source),
            cluster=ClusterSpec.from_dict(data["cluster"], source=source),
            global_batch=int(data["global_batch"]),
            seq=int(data["seq"]),
            budget_fraction=float(data["budget_fraction"]),
            hypothetical=bool(data["hypothetical"]),
            stack=str(data.get("stack", "coplan")),
        )


def _loguniform(rng: random.Random, lo: float, hi: float) -> float:
    return math.exp(rng.uniform(math.log(lo), math.log(hi)))


def _spec(rng: random.Random, family: str, width: int, depth: int, seq: int) -> ModelSpec:
    head_dim = 64 if width <= 2048 else 128
    heads = max(1, width // head_dim)
    name = f"{family}-{depth}x{width}"
    if family in ("gpt", "encoder"):
        return ModelSpec(
            name=name,
            n_layers=depth,
            d_model=width,
            n_heads=heads,
            vocab_size=50257 if family == "gpt" else 30522,
            seq_len=seq,
            causal=family == "gpt",
        )
    # LLaMA's FFN width: 8/3 of the model's, rounded up to a multiple of 256 (Touvron et al.)
    ffn = int(math.ceil(width * 8 / 3 / 256) * 256)
    kv = rng.choice([h for h in (heads, max(1, heads // 4), max(1, heads // 8)) if heads % h == 0])
    experts: dict[str, Any] = {"n_experts": rng.choice((4, 8)), "top_k": 2} if family == "moe" else {}
    if family == "moe":
        ffn = int(math.ceil(ffn / 2 / 256) * 256)  # finer experts, as Mixtral-style MoEs use
    return ModelSpec(
        name=name,
        n_layers=depth,
        d_model=width,
        n_heads=heads,
        vocab_size=rng.choice((32000, 128256)),
        seq_len=seq,
        ffn_hidden=ffn,
        n_kv_heads=kv,
        activation="swiglu",
        norm="rmsnorm",
        position="rope",
        tied_embeddings=False,
        bias=False,
        **experts,
    )


def _hypothetical(rng: random.Random, cluster: ClusterSpec) -> ClusterSpec:
    """``cluster`` with every device replaced by one that does not exist (see the module doc)."""
    compute, bandwidth, capacity, links = (_loguniform(rng, 0.5, 2.0) for _ in range(4))
    data = cluster.to_dict()
    tag = f"~c{compute:.2f}b{bandwidth:.2f}m{capacity:.2f}n{links:.2f}"
    for group in data["groups"]:
        dev = group["device"]
        dev["name"] = dev["name"] + tag
        dev["peak_flops"] = {k: v * compute for k, v in dev["peak_flops"].items()}
        dev["vector_flops"] *= compute
        dev["memory_bandwidth"] *= bandwidth
        dev["memory_bytes"] = round(dev["memory_bytes"] * capacity / 2**30) * 2**30
        dev["source"] = f"hypothetical: {dev['source'][:80]}... scaled {tag}"
        group["intra_node"]["bandwidth"] *= links
    if data.get("inter_node"):
        data["inter_node"]["bandwidth"] *= links
    data["name"] = data["name"] + tag
    return ClusterSpec.from_dict(data, source="hypothetical device")


def _params(spec: ModelSpec) -> float:
    ffn = spec.ffn_hidden or 4 * spec.d_model
    mats = 3 if spec.activation == "swiglu" else 2
    experts = max(1, spec.n_experts)
    per_layer = 4 * spec.d_model**2 + mats * spec.d_model * ffn * experts
    return spec.n_layers * per_layer + 2 * spec.vocab_size * spec.d_model


def sample_job(seed: int, index: int) -> Job:
    """Job ``index`` of the dataset of ``seed`` (deterministic; see the module doc)."""
    rng = random.Random(f"{seed}:{index}")
    family = rng.choices(FAMILIES, weights=(0.4, 0.35, 0.13, 0.12))[0]
    while True:
        width = rng.choice(_WIDTHS)
        depth = rng.choice(_DEPTHS)
        seq = rng.choice(_SEQS if family != "encoder" else _ENCODER_SEQS)
        spec = _spec(rng, family, width, depth, seq)
        if _params(spec) <= _MAX_PARAMS:
            break
    if family in HELDOUT_FAMILIES:
        split = FAMILY_SPLITS[family]
    elif width in HELDOUT_WIDTHS:
        split = "heldout"
    else:
        split = "val" if rng.random() < VAL_SHARE else "train"
    gpus = rng.choice(_MANY_GPUS if rng.random() < MANY_GPUS_P else _GPUS)
    cluster = load_cluster(rng.choice(_CLUSTERS), gpus)
    hypothetical = rng.random() < HYPOTHETICAL_P
    if hypothetical:
        cluster = _hypothetical(rng, cluster)
    batch = gpus * rng.choice((1, 2, 4, 8))
    return Job(
        index=index,
        family=family,
        split=split,
        spec=spec,
        cluster=cluster,
        global_batch=batch,
        seq=seq,
        budget_fraction=rng.choice(_BUDGETS),
        hypothetical=hypothetical,
        stack=rng.choices(STACKS, weights=_STACK_WEIGHTS)[0],
    )
