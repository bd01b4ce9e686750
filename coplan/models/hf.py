"""Hugging Face ``transformers`` models built from a coplan spec (configs only: no weights, no network).

GPT-2-family specs (LayerNorm, GELU, learned positions) become ``GPT2LMHeadModel``, or
``BertForMaskedLM`` where the spec is an encoder (``causal`` false: BERT's post-norm blocks, its
token-type embeddings and its head's extra dense layer and norm, which coplan's own model leaves
out); LLaMA-family specs (RMSNorm, SwiGLU, RoPE) become ``LlamaForCausalLM``. Mixture-of-experts
specs are refused: ``transformers``' MoE layers route with data-dependent shapes (grouped GEMMs
over per-expert offsets), which fake-tensor tracing cannot follow; the built-in MoE has static shapes instead.
``transformers`` is an optional dependency (extra ``hf``).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from coplan.errors import SpecError
from coplan.models.spec import ModelSpec


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise SpecError(
            "--impl hf", None, "needs the 'transformers' package: pip install 'coplan[hf]'"
        ) from None
    transformers.logging.set_verbosity_error()
    return transformers


def hf_model(spec: ModelSpec) -> nn.Module:
    """The ``transformers`` model for ``spec``; build it under a ``FakeTensorMode`` to use no memory."""
    tf = _transformers()
    src = f"model '{spec.name}'"
    gpt_like = spec.norm == "layernorm" and spec.activation == "gelu" and spec.position == "learned"
    llama_like = spec.norm == "rmsnorm" and spec.activation == "swiglu" and spec.position == "rope"
    if not spec.causal:
        if not (gpt_like and spec.bias) or spec.is_moe:
            raise SpecError(
                src,
                "causal",
                "an encoder is built as BertForMaskedLM: layernorm, gelu, learned positions, biases",
            )
        return tf.BertForMaskedLM(
            tf.BertConfig(
                num_hidden_layers=spec.n_layers,
                hidden_size=spec.d_model,
                num_attention_heads=spec.n_heads,
                intermediate_size=spec.ffn,
                vocab_size=spec.vocab_size,
                max_position_embeddings=spec.seq_len,
                layer_norm_eps=spec.norm_eps,
                hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0,
                tie_word_embeddings=spec.tied_embeddings,
                pad_token_id=0,
                attn_implementation="sdpa",
            )
        )
    if gpt_like and not spec.is_moe:
        if not spec.bias:
            raise SpecError(src, "bias", "GPT2LMHeadModel always has biases")
        cfg = tf.GPT2Config(
            n_layer=spec.n_layers,
            n_embd=spec.d_model,
            n_head=spec.n_heads,
            vocab_size=spec.vocab_size,
            n_positions=spec.seq_len,
            n_inner=spec.ffn,
            layer_norm_epsilon=spec.norm_eps,
            attn_pdrop=0.0,
            embd_pdrop=0.0,
            resid_pdrop=0.0,
            tie_word_embeddings=spec.tied_embeddings,
            bos_token_id=0,
            eos_token_id=0,
            attn_implementation="sdpa",
        )
        return tf.GPT2LMHeadModel(cfg)
    if spec.is_moe:
        raise SpecError(
            src,
            "n_experts",
            "Hugging Face MoE models cannot be traced with fake tensors "
            "(data-dependent routing); use the built-in implementation",
        )
    if llama_like:
        common: dict[str, Any] = dict(
            num_hidden_layers=spec.n_layers,
            hidden_size=spec.d_model,
            num_attention_heads=spec.n_heads,
            num_key_value_heads=spec.kv_heads,
            intermediate_size=spec.ffn,
            vocab_size=spec.vocab_size,
            max_position_embeddings=spec.seq_len,
            rms_norm_eps=spec.norm_eps,
            rope_theta=spec.rope_theta,
            tie_word_embeddings=spec.tied_embeddings,
            attention_bias=spec.bias,
            bos_token_id=0,
            eos_token_id=0,
            pad_token_id=None,
            attn_implementation="sdpa",
        )
        return tf.LlamaForCausalLM(tf.LlamaConfig(mlp_bias=spec.bias, **common))
    raise SpecError(
        src,
        "norm",
        "no Hugging Face model family matches this spec "
        "(layernorm+gelu+learned is GPT-2, rmsnorm+swiglu+rope is LLaMA)",
    )
