"""Model specs: a transformer family described by a handful of numbers, plus named presets.

A spec is enough both to build a real ``nn.Module`` (``coplan.models.transformer``) and to build the
IR directly (``coplan.capture.synthetic``); the two agree by test.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from coplan.errors import SpecError
from coplan.fileio import looks_like_file, read_text
from coplan.limits import (
    MAX_CAPACITY_FACTOR,
    MAX_D_MODEL,
    MAX_EXPERTS,
    MAX_FFN_HIDDEN,
    MAX_LAYERS,
    MAX_SEQ,
    MAX_VOCAB,
    bounded_int,
    shown,
)

#: "relu2" is squared ReLU, relu(x)^2 (Primer; Nemotron-4), on an ungated MLP like "gelu".
ACTIVATIONS = ("gelu", "swiglu", "relu2")
NORMS = ("layernorm", "rmsnorm")
POSITIONS = ("learned", "rope")


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSpec:
    """A transformer of pre-norm blocks: a decoder (causal attention, GPT/LLaMA), or with ``causal``
    false an encoder (bidirectional attention, trained as a masked language model is: a prediction
    over the vocabulary at every position). Sizes are counts (not bytes); ``seq_len`` is the
    default context."""

    n_layers: int
    d_model: int
    n_heads: int
    vocab_size: int
    name: str = "custom"
    ffn_hidden: int | None = None  # None: 4 * d_model
    n_kv_heads: int | None = None  # None: n_heads (multi-head); fewer: grouped-query attention
    seq_len: int = 1024
    activation: str = "gelu"
    norm: str = "layernorm"
    position: str = "learned"
    tied_embeddings: bool = True
    bias: bool = True
    n_experts: int = 0  # 0 or 1: dense MLP; >1: mixture of experts in every block
    top_k: int = 1
    capacity_factor: float = 1.0  # experts process ceil(tokens * top_k / n_experts * factor) tokens
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Dropout probabilities as Megatron-LM names them (--hidden-dropout, --attention-dropout; both
    # default to 0.1 there, 0.0 in Llama-style recipes): ``hidden_dropout`` drops the attention and
    # MLP outputs before each residual add (Megatron's fused bias-dropout-add), ``attention_dropout``
    # the attention probabilities. 0.0 builds no dropout ops, so the graph is the same as without.
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    # False: every position attends to every other (an encoder's attention, BERT's), which a flash
    # kernel computes whole, twice the FLOPs of a causal one that skips the tiles above the diagonal
    causal: bool = True

    def __post_init__(self) -> None:
        src = f"model '{self.name}'"
        for f, bound in (
            ("n_layers", MAX_LAYERS),
            ("d_model", MAX_D_MODEL),
            ("n_heads", MAX_D_MODEL),
            ("vocab_size", MAX_VOCAB),
            ("seq_len", MAX_SEQ),
        ):
            _size(src, f, getattr(self, f), bound)
        if self.d_model % self.n_heads:
            raise SpecError(src, "n_heads", f"{self.n_heads} does not divide d_model={self.d_model}")
        if self.ffn_hidden is not None:
            _size(src, "ffn_hidden", self.ffn_hidden, MAX_FFN_HIDDEN)
        if self.n_kv_heads is not None:
            _size(src, "n_kv_heads", self.n_kv_heads, MAX_D_MODEL)
            if self.n_heads % self.n_kv_heads:
                raise SpecError(
                    src, "n_kv_heads", f"{self.n_kv_heads} does not divide n_heads={self.n_heads}"
                )
        for f, allowed in (("activation", ACTIVATIONS), ("norm", NORMS), ("position", POSITIONS)):
            if getattr(self, f) not in allowed:
                raise SpecError(src, f, f"must be one of {', '.join(allowed)}, got {getattr(self, f)!r}")
        _size(src, "n_experts", self.n_experts, MAX_EXPERTS, minimum=0)
        if self.is_moe and (
            isinstance(self.top_k, bool)
            or not isinstance(self.top_k, int)
            or not 1 <= self.top_k <= self.n_experts
        ):
            raise SpecError(
                src, "top_k", f"must be between 1 and n_experts={self.n_experts}, got {self.top_k!r}"
            )
        for f in ("hidden_dropout", "attention_dropout"):
            p = getattr(self, f)
            if isinstance(p, bool) or not isinstance(p, int | float) or not 0.0 <= p < 1.0:
                raise SpecError(src, f, f"must be a probability in [0, 1), got {p!r}")
        if _positive(src, "capacity_factor", self.capacity_factor) > MAX_CAPACITY_FACTOR:
            raise SpecError(
                src,
                "capacity_factor",
                f"must be at most {MAX_CAPACITY_FACTOR:,} (coplan's bound), got {self.capacity_factor!r}",
            )
        # an epsilon is added to a variance of order 1: 1 or more would swamp it
        if _positive(src, "norm_eps", self.norm_eps) >= 1.0:
            raise SpecError(src, "norm_eps", f"must be in (0, 1), got {self.norm_eps!r}")
        _positive(src, "rope_theta", self.rope_theta)
        if not isinstance(self.causal, bool):
            raise SpecError(src, "causal", f"must be true or false, got {self.causal!r}")
        if self.position == "rope" and self.head_dim % 2:
            raise SpecError(src, "n_heads", f"rotary embeddings need an even head dim, got {self.head_dim}")

    # Derived sizes -------------------------------------------------------------------------------

    @property
    def ffn(self) -> int:
        return self.ffn_hidden if self.ffn_hidden is not None else 4 * self.d_model

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 1

    def resolve_seq(self, seq: int | None) -> int:
        """The sequence length a step uses: ``seq``, or the model's context when None. Anything but
        a positive integer (0 included: it does not mean "the default") is refused, and so is a
        sequence longer than the context (position table, rotary tables)."""
        if seq is None:
            return self.seq_len
        src = f"model '{self.name}'"
        why = bounded_int(seq, MAX_SEQ)
        if why is not None:
            raise SpecError(src, "seq", why)
        if seq > self.seq_len:
            raise SpecError(src, "seq_len", f"sequence {seq} exceeds the model's seq_len {self.seq_len}")
        return seq

    def expert_capacity(self, tokens: int) -> int:
        """Tokens each expert processes for a microbatch of ``tokens`` tokens (static shape)."""
        return max(1, math.ceil(tokens * self.top_k / self.n_experts * self.capacity_factor))

    def mlp_params(self) -> int:
        """Parameters of one MLP (one expert's, in a mixture of experts)."""
        d, f = self.d_model, self.ffn
        b = 1 if self.bias else 0
        n_mats = 3 if self.activation == "swiglu" else 2
        return n_mats * d * f + b * ((n_mats - 1) * f + d)

    def block_params(self) -> int:
        d, hd = self.d_model, self.head_dim
        kv = self.kv_heads * hd
        b = 1 if self.bias else 0
        norm = 2 * d if self.norm == "layernorm" and self.bias else d
        attn = d * (d + 2 * kv) + b * (d + 2 * kv) + d * d + b * d
        mlp = self.mlp_params()
        if self.is_moe:
            mlp = self.n_experts * mlp + d * self.n_experts  # experts + router (router has no bias)
        return 2 * norm + attn + mlp

    def active_param_count(self) -> int:
        """Parameters a token passes through: all of ``param_count`` but, in a mixture of experts,
        the experts it is not routed to."""
        unrouted = self.n_experts - self.top_k if self.is_moe else 0
        return self.param_count() - self.n_layers * unrouted * self.mlp_params()

    def param_count(self) -> int:
        """Exact trainable-parameter count of the model this spec builds (tied weights once)."""
        d = self.d_model
        emb = self.vocab_size * d
        pos = self.seq_len * d if self.position == "learned" else 0
        final_norm = 2 * d if self.norm == "layernorm" and self.bias else d
        head = 0 if self.tied_embeddings else self.vocab_size * d
        return emb + pos + self.n_layers * self.block_params() + final_norm + head

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        if self.causal:  # a decoder's dict, and every fingerprint taken of one, reads as before
            del out["causal"]
        return out

    @classmethod
    def from_dict(cls, data: Any, source: str = "<dict>") -> ModelSpec:
        if not isinstance(data, dict):
            raise SpecError(source, None, f"expected a JSON object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        for key in data:
            if key not in known:
                raise SpecError(source, key, f"unknown field (known: {', '.join(sorted(known))})")
        for key in ("n_layers", "d_model", "n_heads", "vocab_size"):
            if key not in data:
                raise SpecError(source, key, "required field is missing")
        types = {f.name: f.type for f in fields(cls)}
        for key, value in data.items():
            _check_type(source, key, str(types[key]), value)
        try:
            return cls(**data)
        except SpecError as e:
            raise SpecError(source, e.field, e.reason) from None


def _check_type(source: str, key: str, type_name: str, value: Any) -> None:
    if value is None and "None" in type_name:
        return
    if type_name.startswith("int") and (not isinstance(value, int) or isinstance(value, bool)):
        raise SpecError(source, key, f"must be an integer, got {value!r}")
    if type_name.startswith("float") and (not isinstance(value, int | float) or isinstance(value, bool)):
        raise SpecError(source, key, f"must be a number, got {value!r}")
    if type_name == "bool" and not isinstance(value, bool):
        raise SpecError(source, key, f"must be true or false, got {value!r}")
    if type_name == "str" and not isinstance(value, str):
        raise SpecError(source, key, f"must be a string, got {value!r}")


def _size(src: str, field: str, value: object, maximum: int, minimum: int = 1) -> None:
    why = bounded_int(value, maximum, minimum)
    if why is not None:
        raise SpecError(src, field, why)


def _positive(src: str, field: str, value: object) -> float:
    """``value`` as a positive finite float. NaN and infinity are refused here because they would
    otherwise pass every comparison-based check and reach the model as NaN losses."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SpecError(src, field, f"must be a number, got {value!r}")
    try:
        number = float(value)
    except OverflowError:  # an integer beyond the float range
        number = math.inf
    if not math.isfinite(number):
        got = repr(value) if isinstance(value, float) else shown(value)
        raise SpecError(src, field, f"must be a finite number, got {got}")
    if number <= 0:
        raise SpecError(src, field, f"must be positive, got {value!r}")
    return number


def _gpt2(name: str, n_layers: int, d_model: int, n_heads: int) -> ModelSpec:
    return ModelSpec(name=name, n_layers=n_layers, d_model=d_model, n_heads=n_heads, vocab_size=50257)


def _bert(name: str, n_layers: int, d_model: int, n_heads: int) -> ModelSpec:
    return ModelSpec(
        name=name,
        n_layers=n_layers,
        d_model=d_model,
        n_heads=n_heads,
        vocab_size=30522,
        seq_len=512,
        causal=False,
    )


def _megatron_gpt(name: str, n_layers: int, d_model: int, n_heads: int, vocab_size: int) -> ModelSpec:
    """A GPT as Megatron-LM trains it: sequence 2048, hidden and attention dropout 0.1 (its defaults)."""
    return ModelSpec(
        name=name,
        n_layers=n_layers,
        d_model=d_model,
        n_heads=n_heads,
        vocab_size=vocab_size,
        seq_len=2048,
        hidden_dropout=0.1,
        attention_dropout=0.1,
    )


def _llama(name: str, n_layers: int, d_model: int, n_heads: int, ffn: int, **kw: Any) -> ModelSpec:
    base: dict[str, Any] = dict(
        vocab_size=32000,
        seq_len=4096,
        activation="swiglu",
        norm="rmsnorm",
        position="rope",
        tied_embeddings=False,
        bias=False,
        norm_eps=1e-5,
    )
    base.update(kw)
    return ModelSpec(name=name, n_layers=n_layers, d_model=d_model, n_heads=n_heads, ffn_hidden=ffn, **base)


def _nemotron4(name: str, n_layers: int, d_model: int, n_heads: int) -> ModelSpec:
    """Nemotron-4 (NVIDIA 2024, arXiv 2402.16819 and 2406.11704): squared-ReLU 4h MLP without
    gating, LayerNorm, rotary positions, 8 KV heads, no biases, untied 256,000-token vocabulary,
    sequence 4096. Its RoPE rotates half of each head (priced as full: a few elementwise FLOPs)."""
    return ModelSpec(
        name=name,
        n_layers=n_layers,
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=8,
        ffn_hidden=4 * d_model,
        vocab_size=256000,
        seq_len=4096,
        activation="relu2",
        norm="layernorm",
        position="rope",
        tied_embeddings=False,
        bias=False,
    )


def _llama3(name: str, n_layers: int, d_model: int, n_heads: int, ffn: int) -> ModelSpec:
    return _llama(
        name,
        n_layers,
        d_model,
        n_heads,
        ffn,
        n_kv_heads=8,
        vocab_size=128256,
        seq_len=8192,
        rope_theta=500000.0,
    )


#: Llama 3's sizes (layers, width, heads, FFN width): "The Llama 3 Herd of Models", Table 3.
_LLAMA3_SHAPES: dict[str, tuple[int, int, int, int]] = {
    "8b": (32, 4096, 32, 14336),
    "70b": (80, 8192, 64, 28672),
    "405b": (126, 16384, 128, 53248),
}


# Published configurations: GPT-2 (Radford et al. 2019, nanoGPT's configs), LLaMA 2 (Touvron et al.
# 2023), Llama 3 and 3.1 (Meta 2024, "The Llama 3 Herd of Models" Table 3: 8B, 70B, 405B; 3.1 keeps
# the shapes), Llama 3.2 1B (Meta 2024, the released config.json of Llama-3.2-1B: 16 x 2048, 32 heads,
# 8 KV heads, FFN 8192, the 128,256-token vocabulary tied to the embedding), GPT-3 175B (Brown et al.
# 2020), the GPT-3 5B and 20B that NeMo's performance tables train (NeMo-Framework-Launcher
# conf/training/gpt3/5b.yaml, 20b.yaml: 24 x 4096 x 32 heads, 44 x 6144 x 48 heads, GPT-2's tokenizer,
# dropout 0.1), Nemotron-4 15B and 340B, Mixtral 8x7B (Jiang et al. 2024), Megatron-LM's 1T
# configuration (Narayanan et al. 2021, table 1). The tiny presets are for tests. The GPT-3 models and
# the 1T model carry the dropout published runs of them used (hidden and attention 0.1: Megatron-LM's
# --hidden-dropout / --attention-dropout defaults, which its GPT-3 and Table 1 scripts keep, and
# NeMo's GPT-3 recipes up to NeMo 1.x); the others train without, as their recipes do.
# The encoders: BERT-Base and BERT-Large's sizes (Devlin et al. 2019, section 3: L=12, H=768, A=12
# and L=24, H=1024, A=16, FFN 4H, GELU, learned positions up to 512; the released WordPiece
# vocabulary has 30,522 tokens, tied to the output layer), bidirectional attention and a prediction
# at every position (BertForMaskedLM's head computes logits for every token). coplan's blocks are
# pre-norm where BERT's are post-norm, the same kernels in another order; BERT's token-type
# embeddings, pooler and the head's extra dense + norm (under 1% of BERT-Large's FLOPs) are not built.
PRESETS: dict[str, ModelSpec] = {
    s.name: s
    for s in (
        _gpt2("gpt2-124m", 12, 768, 12),
        _gpt2("gpt2-350m", 24, 1024, 16),
        _gpt2("gpt2-774m", 36, 1280, 20),
        _gpt2("gpt2-1.5b", 48, 1600, 25),
        _llama("llama2-7b", 32, 4096, 32, 11008),
        _llama("llama2-13b", 40, 5120, 40, 13824),
        _llama("llama2-70b", 80, 8192, 64, 28672, n_kv_heads=8),
        *(
            _llama3(f"{family}-{size}", *shape)
            for family in ("llama3", "llama3.1")
            for size, shape in _LLAMA3_SHAPES.items()
        ),
        _llama(
            "llama3.2-1b",
            16,
            2048,
            32,
            8192,
            n_kv_heads=8,
            vocab_size=128256,
            seq_len=8192,
            rope_theta=500000.0,
            tied_embeddings=True,
        ),
        _megatron_gpt("gpt3-5b", 24, 4096, 32, 50257),
        _megatron_gpt("gpt3-20b", 44, 6144, 48, 50257),
        _megatron_gpt("gpt3-175b", 96, 12288, 96, 50257),
        _nemotron4("nemotron4-15b", 32, 6144, 48),
        _nemotron4("nemotron4-340b", 96, 18432, 96),
        _megatron_gpt("megatron-1t", 128, 25600, 160, 51200),
        _llama(
            "mixtral-8x7b",
            32,
            4096,
            32,
            14336,
            n_kv_heads=8,
            seq_len=4096,
            n_experts=8,
            top_k=2,
            rope_theta=1e6,
        ),
        _llama("moe-small", 8, 512, 8, 1408, n_kv_heads=4, seq_len=1024, n_experts=8, top_k=2),
        _bert("bert-base", 12, 768, 12),
        _bert("bert-large", 24, 1024, 16),
        ModelSpec(
            name="encoder-tiny", n_layers=2, d_model=64, n_heads=4, vocab_size=512, seq_len=64, causal=False
        ),
        ModelSpec(name="gpt-tiny", n_layers=2, d_model=64, n_heads=4, vocab_size=512, seq_len=64),
        _llama("llama-tiny", 2, 64, 4, 176, n_kv_heads=2, vocab_size=512, seq_len=64),
        _llama("moe-tiny", 2, 64, 4, 96, n_kv_heads=2, vocab_size=512, seq_len=64, n_experts=4, top_k=2),
    )
}


def load_model_spec(name_or_path: str) -> ModelSpec:
    """A preset by name, or a JSON spec file. Errors name the file (or preset) and the field."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    path = Path(name_or_path)
    if name_or_path.lower().endswith(".json") or looks_like_file(name_or_path):
        try:
            data = json.loads(read_text(path, name_or_path))
        except json.JSONDecodeError as e:
            raise SpecError(
                name_or_path, None, f"invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}"
            ) from None
        except ValueError as e:  # an integer of more digits than Python converts
            raise SpecError(name_or_path, None, f"invalid JSON: {e}") from None
        if isinstance(data, dict) and "name" not in data:
            data = {**data, "name": path.stem}
        return ModelSpec.from_dict(data, source=name_or_path)
    import difflib

    close = difflib.get_close_matches(name_or_path, PRESETS, n=3)
    hint = f" (did you mean {', '.join(close)}?)" if close else f" (presets: {', '.join(PRESETS)})"
    raise SpecError(f"model '{name_or_path}'", None, f"not a preset or a spec file{hint}")
