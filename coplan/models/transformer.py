"""Built-in decoder-only transformers (nanoGPT-style GPT, LLaMA-style, mixture of experts) from a spec.

Module names are chosen so that IR module paths read naturally: ``h.3.attn.c_attn``,
``h.3.mlp.c_fc``, ``lm_head``. Every shape is static (the MoE uses fixed expert capacity), so the
model traces under fake tensors and its graph is the same for every batch of the same size.

``Transformer.recompute`` turns on activation recomputation for real training runs (the cost
model's ``TrainingConfig.recompute`` modes): ``"full"`` checkpoints every block, ``"selective"``
only the attention core. Capture for the cost model leaves it at ``"none"``: the cost model adds the
recomputation itself, so a captured graph must be the plain step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from coplan.models.spec import ModelSpec


def _norm(spec: ModelSpec) -> nn.Module:
    if spec.norm == "rmsnorm":
        return nn.RMSNorm(spec.d_model, eps=spec.norm_eps)
    return nn.LayerNorm(spec.d_model, eps=spec.norm_eps, bias=spec.bias)


class Rotary(nn.Module):
    """Rotary position embedding tables (non-persistent buffers, not parameters)."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        hd = spec.head_dim
        inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        t = torch.arange(spec.seq_len, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (B, H, T, hd). Rotate-half formulation, as in LLaMA's reference code.
        t = x.shape[-2]
        cos, sin = self.cos[:t], self.sin[:t]
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin


#: Activation recomputation modes of ``Transformer.recompute`` (as ``TrainingConfig.recompute``).
RECOMPUTE_MODES: tuple[str, ...] = ("none", "selective", "full")


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.n_heads, self.kv_heads, self.hd = spec.n_heads, spec.kv_heads, spec.head_dim
        self.causal = spec.causal
        self.checkpoint_core = False  # selective recomputation: re-run the attention core in backward
        kv = self.kv_heads * self.hd
        self.c_attn = nn.Linear(spec.d_model, spec.d_model + 2 * kv, bias=spec.bias)
        self.c_proj = nn.Linear(spec.d_model, spec.d_model, bias=spec.bias)
        self.rotary = Rotary(spec) if spec.position == "rope" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        kv = self.kv_heads * self.hd
        q, k, v = self.c_attn(x).split([c, kv, kv], dim=2)
        q = q.view(b, t, self.n_heads, self.hd).transpose(1, 2)
        k = k.view(b, t, self.kv_heads, self.hd).transpose(1, 2)
        v = v.view(b, t, self.kv_heads, self.hd).transpose(1, 2)
        if self.rotary is not None:
            q, k = self.rotary(q), self.rotary(k)
        k, v, gqa = kv_heads_for(q, k, v, q.is_cuda and q.dtype == torch.float32)
        if self.checkpoint_core and torch.is_grad_enabled():
            y = checkpoint(
                F.scaled_dot_product_attention,
                q,
                k,
                v,
                use_reentrant=False,
                is_causal=self.causal,
                enable_gqa=gqa,
            )
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, enable_gqa=gqa)
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.c_proj(y)


def kv_heads_for(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, expand: bool
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(k, v, enable_gqa) for ``scaled_dot_product_attention``: grouped-query heads as they are,
    or (``expand``) repeated to the query's. PyTorch runs ``enable_gqa`` only in its flash kernel,
    which takes 16-bit inputs, and in the math one; an fp32 step on a GPU (the gradient check's
    reference) would fall to math, which keeps a (seq x seq) score matrix per head and layer
    (Llama 3.2 1B at 16K tokens: 4 GiB each, in fp32). Repeated heads let the memory-efficient
    kernel take it: the same function."""
    groups = q.shape[1] // k.shape[1]
    if groups == 1:
        return k, v, False
    if not expand:
        return k, v, True
    return k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1), False


def ungated(h: torch.Tensor, activation: str) -> torch.Tensor:
    """The activation of an ungated MLP: tanh-GELU, or squared ReLU (``relu2``)."""
    if activation == "relu2":
        return torch.square(F.relu(h))
    return F.gelu(h, approximate="tanh")


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.swiglu = spec.activation == "swiglu"
        self.activation = spec.activation
        self.c_fc = nn.Linear(spec.d_model, spec.ffn, bias=spec.bias)
        if self.swiglu:
            self.c_gate = nn.Linear(spec.d_model, spec.ffn, bias=spec.bias)
        self.c_proj = nn.Linear(spec.ffn, spec.d_model, bias=spec.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            return self.c_proj(F.silu(self.c_gate(x)) * self.c_fc(x))
        return self.c_proj(ungated(self.c_fc(x), self.activation))


class MoE(nn.Module):
    """Token-choice top-k routing with a fixed expert capacity (GShard/Switch style).

    Each expert takes the ``capacity`` tokens with the largest routing weight for it; tokens that
    did not pick the expert have weight 0, so a slot they fill contributes nothing (padding). Shapes
    never depend on data, which keeps tracing and the cost model exact.
    """

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        e, d, f = spec.n_experts, spec.d_model, spec.ffn
        self.router = nn.Linear(d, e, bias=False)
        self.swiglu = spec.activation == "swiglu"
        scale = d**-0.5
        self.w_fc = nn.Parameter(torch.randn(e, d, f) * scale)
        self.w_gate = nn.Parameter(torch.randn(e, d, f) * scale) if self.swiglu else None
        self.w_proj = nn.Parameter(torch.randn(e, f, d) * f**-0.5)
        self.b_gate: nn.Parameter | None = None
        if spec.bias:
            self.b_fc = nn.Parameter(torch.zeros(e, 1, f))
            if self.swiglu:
                self.b_gate = nn.Parameter(torch.zeros(e, 1, f))
            self.b_proj = nn.Parameter(torch.zeros(e, 1, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        n = b * t
        flat = x.reshape(n, d)
        probs = F.softmax(self.router(flat), dim=-1, dtype=torch.float32)
        top_w, top_i = probs.topk(self.spec.top_k, dim=-1)
        top_w = (top_w / top_w.sum(dim=-1, keepdim=True)).to(x.dtype)
        weights = torch.zeros(n, self.spec.n_experts, dtype=x.dtype, device=x.device)
        weights = weights.scatter(1, top_i, top_w)
        cap = self.spec.expert_capacity(n)
        slot_w, slot_i = weights.t().topk(cap, dim=1)  # (E, C): each expert's chosen tokens
        xe = flat[slot_i]  # (E, C, d)
        h = torch.bmm(xe, self.w_fc)
        if self.spec.bias:
            h = h + self.b_fc
        if self.w_gate is not None:
            g = torch.bmm(xe, self.w_gate)
            if self.b_gate is not None:
                g = g + self.b_gate
            h = F.silu(g) * h
        else:
            h = ungated(h, self.spec.activation)
        ye = torch.bmm(h, self.w_proj)
        if self.spec.bias:
            ye = ye + self.b_proj
        ye = ye * slot_w.unsqueeze(-1)
        out = torch.zeros_like(flat).index_add(0, slot_i.reshape(-1), ye.reshape(-1, d))
        return out.view(b, t, d)


class Block(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.ln_1 = _norm(spec)
        self.attn = Attention(spec)
        self.ln_2 = _norm(spec)
        self.mlp: nn.Module = MoE(spec) if spec.is_moe else MLP(spec)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Head(nn.Linear):
    """The LM head: ``nn.Linear`` over the vocabulary, whose weight GEMMs can run padded.

    ``pad_to`` (settable; 0: off) pads the weight's vocabulary rows with zeros up to a multiple of
    it inside ``forward`` and slices the logits back: the same function and gradients (the zero rows
    produce logits that are sliced away, and their gradient rows are dropped), but the three GEMMs
    load operands whose leading dimension is aligned where the vocabulary (GPT-2's 50,257) is not,
    as Megatron-LM pads the vocabulary and Inductor's ``pad_mm`` pads matrix multiplies."""

    pad_to: int = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = self.weight.shape[0]
        extra = -rows % self.pad_to if self.pad_to > 0 else 0
        if not extra:
            return super().forward(x)
        return F.linear(x, F.pad(self.weight, (0, 0, 0, extra)))[..., :rows]


class Transformer(nn.Module):
    """``forward(idx, targets)`` returns the mean cross-entropy loss of next-token prediction.

    ``recompute`` (settable after construction, one of ``RECOMPUTE_MODES``): ``"none"`` keeps what
    autograd saves; ``"full"`` saves only each block's input and re-runs the block in backward
    (``torch.utils.checkpoint``, non-reentrant); ``"selective"`` re-runs only the attention core
    (the ``scaled_dot_product_attention`` call), as Megatron-LM's selective recomputation.
    """

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self._recompute = "none"
        self.wte = nn.Embedding(spec.vocab_size, spec.d_model)
        self.wpe = nn.Embedding(spec.seq_len, spec.d_model) if spec.position == "learned" else None
        self.h = nn.ModuleList(Block(spec) for _ in range(spec.n_layers))
        self.ln_f = _norm(spec)
        self.lm_head = Head(spec.d_model, spec.vocab_size, bias=False)
        if spec.tied_embeddings:
            self.lm_head.weight = self.wte.weight
        self._init_weights()

    def _init_weights(self) -> None:
        """GPT-2's initialisation, as nanoGPT and Megatron-LM use it: weights N(0, 0.02), biases 0,
        and the projections that write into the residual stream (attention and MLP ``c_proj``, the
        experts' ``w_proj``) N(0, 0.02 / sqrt(2 * layers)). PyTorch's module defaults (N(0, 1)
        embeddings, which a tied LM head shares) start a tied-embedding GPT far above ln(vocab) (the
        CPU benchmark's gpt-a at a loss of 87 against 7.6), with logits spread over ~150: not a state
        anyone trains from, and on a CPU it also makes the log-softmax run at half speed (its
        exponentials underflow), so measured steps would not be a real training run's."""
        std = 0.02
        residual = std / (2 * self.spec.n_layers) ** 0.5
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, 0.0, residual if name.endswith("c_proj") else std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, 0.0, std)
            elif isinstance(module, MoE):
                for w in (module.w_fc, module.w_gate):
                    if w is not None:
                        nn.init.normal_(w, 0.0, std)
                nn.init.normal_(module.w_proj, 0.0, residual)
                # the expert biases are created as zeros already

    @property
    def recompute(self) -> str:
        return self._recompute

    @recompute.setter
    def recompute(self, mode: str) -> None:
        if mode not in RECOMPUTE_MODES:
            raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE_MODES)}, got {mode!r}")
        self._recompute = mode
        for module in self.modules():
            if isinstance(module, Attention):
                module.checkpoint_core = mode == "selective"

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        _, t = idx.shape
        x = self.wte(idx)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(t, device=idx.device))
        full = self._recompute == "full" and torch.is_grad_enabled()
        for block in self.h:
            x = checkpoint(block, x, use_reentrant=False) if full else block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def build_model(spec: ModelSpec) -> Transformer:
    return Transformer(spec)


def example_batch(spec: ModelSpec, batch: int, seq: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    s = seq or spec.seq_len
    idx = torch.randint(0, spec.vocab_size, (batch, s))
    return idx, torch.randint(0, spec.vocab_size, (batch, s))
