"""What ndparallel knows about each decoder family, read from its config alone (no weights, no processes).

Two users: ``parallel.rules.model_problems`` (so ``ndparallel validate`` and ``parallelize`` refuse an axis a family
cannot take, in one line, before any process starts) and ``models/decoder.py`` (which TP style each
linear and norm gets).

Tensor-parallel plans come from transformers (``config.base_model_tp_plan``), with three kinds of change:
- a family transformers ships without a plan gets ours (Falcon);
- where transformers gathers a projection's output only because a norm after it spans all heads (OLMo 2's
  q/k RMSNorm), we keep the heads split and normalize across ranks instead (``feature_norm``), so
  attention itself is split;
- norms transformers' plan forgets (Cohere's per-head q/k LayerNorms, weight (heads, head_dim)) are split
  by head (``head_norm``).
"""

from __future__ import annotations

import math
from typing import Any

from ndparallel.errors import ModelError
from ndparallel.models.moe import is_moe_config, moe_attention_plan

# Our style names. colwise / rowwise: Megatron-style split (heads, MLP columns) with sequence parallelism
# around them. colwise_gather / rowwise_split: transformers' colwise_gather_output / rowwise_split_input,
# for fused projections whose consumer slices the output by the global head count (Phi-3's qkv_proj,
# Falcon's query_key_value): the linear is split, its output gathered, attention runs on every head on
# every tp rank, and the next linear takes its slice of the input again. qk_norm: a per-head norm with
# one weight shared by all heads (replicated, gradient summed over tp). head_norm / feature_norm: a norm
# whose weight is split like its input, by head or along a feature dim split over tp.
STYLES = ("colwise", "rowwise", "colwise_gather", "rowwise_split", "qk_norm", "head_norm", "feature_norm")

_TRANSFORMERS_STYLES = {
    "colwise": "colwise",
    "rowwise": "rowwise",
    "colwise_gather_output": "colwise_gather",
    "rowwise_split_input": "rowwise_split",
    "replicated_with_grad_allreduce": "qk_norm",
    # older transformers names of the same two styles
    "colwise_rep": "colwise_gather",
    "rowwise_rep": "rowwise_split",
}

# Families transformers ships without a TP plan, in our style names (paths inside one decoder layer).
_OWN_PLANS = {
    "falcon": {
        "self_attention.query_key_value": "colwise_gather",
        "self_attention.dense": "rowwise_split",
        "mlp.dense_h_to_4h": "colwise",
        "mlp.dense_4h_to_h": "rowwise",
    },
}

# OLMo 2/3: q_norm/k_norm are RMSNorms over all heads at once (weight (heads * head_dim,)); transformers
# therefore gathers q/k/v. Split heads and a cross-rank norm do the same arithmetic with attention split.
_OLMO_ATTENTION = {
    "self_attn.q_proj": "colwise",
    "self_attn.k_proj": "colwise",
    "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise",
    "self_attn.q_norm": "feature_norm",
    "self_attn.k_norm": "feature_norm",
}
_PLAN_CHANGES = {"olmo2": _OLMO_ATTENTION, "olmo3": _OLMO_ATTENTION}

# Families that are not attention decoders: one line each, said before any process starts.
_NOT_DECODERS = {
    "falcon_h1": "Falcon-H1 runs Mamba-2 state-space mixers beside attention in every layer",
    "falcon_mamba": "Falcon-Mamba is a state-space (Mamba) model without attention",
    "mamba": "Mamba is a state-space model without attention",
    "mamba2": "Mamba-2 is a state-space model without attention",
    "gemma3": "this Gemma 3 config is the multimodal model (vision tower + language model); "
    "use a text-only config (model_type gemma3_text)",
}
_STATE_SPACE_WHY = (
    "ndparallel trains attention decoders (packed documents would leak recurrent state into each "
    "other, and context/tensor parallelism have no plan for the mixer)"
)


def family_problems(config: Any, *, tp: int, cp: int) -> list[str]:
    """One line per thing this family cannot do on the given tp/cp sizes (empty: all fine)."""
    kind = getattr(config, "model_type", "?")
    if kind in _NOT_DECODERS:
        why = _NOT_DECODERS[kind]
        return [
            f"model_type {kind!r} is not supported: {why}; "
            + (_STATE_SPACE_WHY if "state-space" in why else "it is refused on every layout")
        ]
    problems = []
    if kind == "falcon" and getattr(config, "alibi", False):
        problems.append(
            "Falcon with alibi=True (Falcon-RW) is not supported: its position biases come from the "
            "attention mask, not the position ids, so packed documents would see wrong distances"
        )
    reason = model_attention_reason(config)
    if cp > 1 and reason:
        problems.append(f"cp_size={cp} cannot split this model's attention: {reason}; set cp_size=1")
    vocab = getattr(config, "vocab_size", None)
    if tp > 1 and vocab is not None and math.ceil(vocab / tp) * (tp - 1) >= vocab:
        problems.append(
            f"tp_size={tp} leaves the last tensor-parallel rank no vocabulary rows "
            f"(vocab_size={vocab}); use a smaller tp_size"
        )
    return problems


def needs_eager_attention(config: Any) -> bool:
    """Attention-logit soft-capping (Gemma 2): SDPA cannot express it (transformers 5.24 refuses; older
    versions may drop the cap silently), so the model runs transformers' eager attention."""
    return getattr(config, "attn_logit_softcapping", None) is not None


def model_attention_reason(config: Any) -> str | None:
    """Why this model must keep its own (transformers') attention instead of ndparallel's, or None.

    ndparallel's attention (packed documents without a mask, context parallelism) computes plain scaled
    softmax attention. Attention-logit soft-capping (Gemma 2) is not that; such a model keeps
    transformers' eager attention, which takes packed rows exactly through transformers' own document
    masks but cannot be split along the sequence.
    """
    if needs_eager_attention(config):
        softcap = config.attn_logit_softcapping
        return (
            f"attention-logit soft-capping (attn_logit_softcapping={softcap}) runs in transformers' eager "
            f"attention, which ndparallel's context-parallel kernels do not implement"
        )
    if getattr(config, "model_type", None) == "falcon":
        return "Falcon calls scaled_dot_product_attention itself rather than through transformers' attention interface"
    return None


# What each family does to its logits after lm_head, elementwise (its ...ForCausalLM.forward, transformers
# 5.17-5.24): nothing, a scale, or a soft cap. The fused loss applies the same inside its chunks; a family not
# listed keeps the unfused loss (its forward may do something the fused loss would not reproduce).
_PLAIN_HEADS = {
    "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "phi3", "olmo2", "olmo3",
    "glm", "glm4", "falcon", "gemma", "gpt_oss", "deepseek_v3",
}  # fmt: skip


def logit_transform(config: Any) -> tuple[float, float | None] | None:
    """(scale, softcap) of the logits after lm_head: y = softcap * tanh(scale * z / softcap), or y = scale * z
    without a cap; None for a family whose output transform is not known here."""
    kind = getattr(config, "model_type", None)
    if kind in _PLAIN_HEADS:
        return 1.0, None
    if kind in ("gemma2", "gemma3_text"):
        return 1.0, getattr(config, "final_logit_softcapping", None)
    if kind == "granite":
        return 1.0 / config.logits_scaling, None
    if kind == "cohere":
        return float(config.logit_scale), None
    return None


# Used when a config carries no plan but its layers look like Llama's (decoder.py checks the paths exist).
_LLAMA_LIKE_PLAN = {
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise",
    "layers.*.mlp.up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",
}


def layer_tp_plan(config: Any) -> dict[str, str]:
    """Paths inside one decoder layer -> our TP style, for this family."""
    kind = getattr(config, "model_type", "?")
    if kind in _OWN_PLANS:
        return dict(_OWN_PLANS[kind])
    if is_moe_config(config):  # attention only: MoE blocks run unsplit on each tp rank's tokens (models/moe.py)
        source = moe_attention_plan(config)
    else:
        source = getattr(config, "base_model_tp_plan", None) or _LLAMA_LIKE_PLAN
    plan = {}
    for pattern, style in source.items():
        if not pattern.startswith("layers.*."):
            continue
        ours = _TRANSFORMERS_STYLES.get(style)
        if ours is None:
            raise ModelError(
                f"{kind}: tensor parallelism does not support transformers' plan entry {pattern!r}: "
                f"{style!r}; set tp_size=1 for this model (FSDP and CP still apply)"
            )
        plan[pattern[len("layers.*.") :]] = ours
    plan.update(_PLAN_CHANGES.get(kind, {}))
    if kind == "cohere" and getattr(config, "use_qk_norm", False):
        plan.update({"self_attn.q_norm": "head_norm", "self_attn.k_norm": "head_norm"})
    return plan
