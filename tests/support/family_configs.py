"""Tiny transformers configs of the dense decoder families (2 layers, hidden 64, 8 heads of 8).

Every family-specific feature is switched on with a value large enough that dropping it moves the loss
far beyond the parity tolerance (``test_family_features_matter`` proves it for each one): soft caps
well inside the logits' range, multipliers far from 1, sliding windows shorter than the rows.
"""

from __future__ import annotations

from transformers import (
    CohereConfig,
    FalconConfig,
    Gemma2Config,
    Gemma3TextConfig,
    Glm4Config,
    GlmConfig,
    GraniteConfig,
    Olmo2Config,
    Phi3Config,
)

# Windows of 12 tokens inside rows of 32-64: sliding layers really see less than full layers.
WINDOW = 12
_ALTERNATING = ["sliding_attention", "full_attention"]

FAMILY_CONFIGS = {
    # Attention-logit and final-logit soft-capping, alternating sliding/full layers, scaled and tied
    # embeddings, (1 + w) RMSNorms before and after attention and MLP, query_pre_attn_scalar scaling.
    "gemma2": lambda **kw: Gemma2Config(
        **{
            **dict(
                num_key_value_heads=4,
                head_dim=8,
                sliding_window=WINDOW,
                layer_types=_ALTERNATING,
                attn_logit_softcapping=2.0,
                final_logit_softcapping=1.5,
                query_pre_attn_scalar=8,
                initializer_range=0.2,
            ),
            **kw,
        }
    ),
    # Per-head q/k norms, sliding/full layers with their own rotary bases, scaled tied embeddings.
    "gemma3": lambda **kw: Gemma3TextConfig(
        **{
            **dict(
                num_key_value_heads=4,
                head_dim=8,
                sliding_window=WINDOW,
                layer_types=_ALTERNATING,
                query_pre_attn_scalar=8,
                initializer_range=0.2,
            ),
            **kw,
        }
    ),
    # Fused qkv_proj and gate_up_proj (transformers' plan: colwise_gather_output / rowwise_split_input), a
    # sliding window on every layer (Phi-3-mini's config has one).
    "phi3": lambda **kw: Phi3Config(
        **{**dict(num_key_value_heads=4, sliding_window=WINDOW, pad_token_id=0, initializer_range=0.2), **kw}
    ),
    # Embedding, residual and attention multipliers and logit scaling.
    "granite": lambda **kw: GraniteConfig(
        **{
            **dict(
                num_key_value_heads=4,
                embedding_multiplier=4.0,
                residual_multiplier=0.3,
                attention_multiplier=4.0,
                logits_scaling=0.5,
                initializer_range=0.05,
            ),
            **kw,
        }
    ),
    # Norms after attention/MLP (no pre-norm), q/k RMSNorm over all heads at once (not per head).
    "olmo2": lambda **kw: Olmo2Config(**{**dict(num_key_value_heads=4, pad_token_id=0), **kw}),
    # Parallel attention+MLP block on one LayerNorm, logit_scale, tied embeddings, per-head q/k LayerNorms
    # with weights per head, interleaved rotary.
    "cohere": lambda **kw: CohereConfig(
        **{**dict(num_key_value_heads=4, logit_scale=4.0, use_qk_norm=True, pad_token_id=0), **kw}
    ),
    # Fused gate_up_proj, partial interleaved rotary, q/k/v biases.
    "glm": lambda **kw: GlmConfig(**{**dict(num_key_value_heads=4, head_dim=8, pad_token_id=0), **kw}),
    # GLM plus norms after attention and MLP.
    "glm4": lambda **kw: Glm4Config(**{**dict(num_key_value_heads=4, head_dim=8, pad_token_id=0), **kw}),
    # Falcon (new decoder architecture): transformer.h blocks, fused grouped query_key_value, parallel
    # attention and MLP on two LayerNorms, GELU MLP, biases off.
    "falcon": lambda **kw: FalconConfig(
        **{
            **dict(
                new_decoder_architecture=True,
                num_kv_heads=4,
                parallel_attn=True,
                bias=False,
                alibi=False,
                ffn_hidden_size=kw.pop("intermediate_size", 128),
                bos_token_id=0,
                eos_token_id=0,
            ),
            **kw,
        }
    ),
}
