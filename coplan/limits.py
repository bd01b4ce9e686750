"""Upper bounds on the sizes coplan accepts, in one place.

coplan prices a job symbolically, so a huge size costs no memory, but it is not free in time:
planning builds the training step's graph op by op (a few hundred ops per layer) once for every
microbatch, fusion and precision it prices, and enumerates parallel layouts over the divisors of
the GPU count and of the batch. Absurd sizes (2^31 layers, 10^9 GPUs) would run for hours instead
of failing, so every size is bounded. Each bound is several times the largest published training
job of its kind, so no real model or cluster is refused; a size above one is refused by a one-line
error that states the bound.

The bounds keep each size finite, not the number of parallel layouts a search prices, which grows
with how many divisors the depth, the head count and the GPU count share: within the bounds, a
contrived job whose three all have many (240 layers and 120 heads on 60,480 GPUs) priced 112,463
plans in 12 minutes of CPU, where the published jobs take seconds to two minutes.
"""

from __future__ import annotations

#: Megatron-LM's 1T model has 128 layers, Llama 3 405B 126, PaLM 540B 118. Planning builds the
#: whole step's graph for every microbatch, fusion and precision it prices, so its time grows with
#: depth: on a 2-core machine a 128-layer model plans in 30 s of CPU on one GPU, 256 layers in 52 s
#: (144 s on 131,072 GPUs), and 1,000 layers ran past five minutes. The bound is twice the deepest
#: published model rather than more, to keep planning within minutes.
MAX_LAYERS = 256

#: Model width: Megatron-LM's 1T model is 25,600 wide, Nemotron-4 340B 18,432. 2^17 is five times
#: the widest. Heads and KV heads divide the width, so this bounds them too.
MAX_D_MODEL = 2**17

#: MLP width: Llama 3 405B's is 53,248 (3.25 x 16,384). 2^19 is four times MAX_D_MODEL, the
#: usual ratio at the bound, and ten times the widest published.
MAX_FFN_HIDDEN = 2**19

#: Vocabulary: Nemotron-4 and Gemma use 256,000 tokens, Llama 3 128,256. 2^21 (2,097,152) is
#: eight times the largest.
MAX_VOCAB = 2**21

#: Sequence length (the model's context and a job's sequence): Llama 3.1 trains to 2^17 (128K)
#: tokens; million-token contexts have been trained. 2^20 (1,048,576) admits those; the graph's
#: size does not depend on it, only the attention tile count (a loop over query tiles).
MAX_SEQ = 2**20

#: Experts per MoE layer: Switch-C has 2,048, DeepSeek-V3 256 routed. The experts are one batched
#: tensor in the graph, so their number costs no planning time; 2^12 is twice the largest.
MAX_EXPERTS = 2**12

#: An MoE layer's capacity factor (each expert takes ``tokens * top_k / n_experts * factor`` tokens):
#: published runs use 1 to 2, and at ``n_experts / top_k`` every expert already has room for every
#: token, so no useful factor exceeds MAX_EXPERTS; above it the expert tensors only grow.
MAX_CAPACITY_FACTOR = MAX_EXPERTS

#: Devices (GPUs) in one cluster or one job: the largest training clusters built hold about
#: 100,000 to 200,000 GPUs (Llama 3 405B trained on 16,384). 2^18 (262,144) admits them. Layouts
#: are enumerated over divisors (O(sqrt n) each), so planning time depends on how many divisors the
#: count has and on the model's depth, not on the count itself: GPT-2 124M plans on 262,144 GPUs in
#: under a minute, Megatron-LM's 1T model on 3,072 in two.
MAX_DEVICES = 2**18

#: Devices in one node (one intra-node interconnect domain, which bounds tensor parallelism):
#: a DGX has 8, an NVL72 rack 72, NVIDIA's NVL576 576. 1,024 admits all of them.
MAX_DEVICES_PER_NODE = 1024

#: Sequences per optimizer step: GPT-3 used 1,536, Megatron-LM's 1T 3,072, Llama 3 405B up to
#: 2,048 (of 8,192 tokens: 16M tokens). 2^20 is over 300 times the largest.
MAX_GLOBAL_BATCH = 2**20


def shown(value: int) -> str:
    """An integer for an error message: with thousands separators, or its size in bits when it has
    too many digits to print (Python refuses to format integers of more than 4,300 digits)."""
    return f"{value:,}" if value.bit_length() <= 64 else f"an integer of {value.bit_length()} bits"


def bounded_int(value: object, maximum: int, minimum: int = 1) -> str | None:
    """Why ``value`` is not an integer in [minimum, maximum] (booleans refused: JSON ``true`` would
    pass as 1), or None when it is."""
    if isinstance(value, bool) or not isinstance(value, int):
        return f"must be an integer, got {value!r}"
    if value < minimum:
        bound = "a positive integer" if minimum == 1 else f">= {minimum}"
        return f"must be {bound}, got {shown(value)}"
    if value > maximum:
        return f"must be at most {maximum:,} (coplan's bound), got {shown(value)}"
    return None
