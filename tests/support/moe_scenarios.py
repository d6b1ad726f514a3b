"""Tiny mixture-of-experts models and the same training run done two ways (see scenarios.py): one plain
transformers process (``train_reference_moe``: the family's own modules and its own
``load_balancing_loss_func``), and ndparallel on every rank of a layout (``train_parallel_moe``).

The router loss weight is 0.1 (transformers' default 0.001 would hide a wrongly normalized aux loss in
the gradients); ``output_router_logits`` is on, so transformers adds the loss as it would in training.
"""

from __future__ import annotations

import importlib

import torch
from transformers import (
    AutoModelForCausalLM,
    DeepseekV3Config,
    GptOssConfig,
    MixtralConfig,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
)

from support.scenarios import VOCAB, reference_mask, train_parallel, train_reference

AUX_COEF = 0.1
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=8,
    max_position_embeddings=512,
    attention_dropout=0.0,
    tie_word_embeddings=False,
    output_router_logits=True,
    router_aux_loss_coef=AUX_COEF,
)

_CONFIGS = {
    # 8 experts, top-2, q/k norms; GQA 8/4 heads.
    "qwen3_moe": lambda: Qwen3MoeConfig(
        **_COMMON,
        num_key_value_heads=4,
        head_dim=8,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
    ),
    # 4 experts, top-2, GQA 8/2 heads.
    "mixtral": lambda: MixtralConfig(
        **_COMMON, num_key_value_heads=2, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2
    ),
    # attention sinks, alternating sliding-window layers, expert and router biases, clamped SwiGLU.
    "gpt_oss": lambda: GptOssConfig(
        **_COMMON,
        num_key_value_heads=4,
        head_dim=8,
        intermediate_size=32,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=8,
    ),
    # a gated shared expert beside 8 routed experts.
    "qwen2_moe": lambda: Qwen2MoeConfig(
        **_COMMON,
        num_key_value_heads=4,
        intermediate_size=96,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        num_experts=8,
        num_experts_per_tok=2,
    ),
    # DeepSeek-V3: latent attention, one dense first layer, shared experts, grouped sigmoid routing (no aux loss).
    "deepseek_v3": lambda: DeepseekV3Config(
        **{**_COMMON, "num_attention_heads": 4},
        num_key_value_heads=4,
        intermediate_size=96,
        moe_intermediate_size=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        q_lora_rank=None,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        rope_scaling=None,
    ),
}


def make_moe_model(family: str, *, seed: int = 0, vocab_size: int = VOCAB):
    torch.manual_seed(seed)
    config = _CONFIGS[family]()
    config.vocab_size = vocab_size
    attention = "eager" if family == "gpt_oss" else "sdpa"
    return AutoModelForCausalLM.from_config(config, attn_implementation=attention, dtype=torch.float32).train()


def _gpt_oss_masks(mb: dict, window: int) -> dict:
    """gpt-oss takes one additive mask per layer type; packed rows need them explicit."""
    full = reference_mask(mb)["attention_mask"]
    windowed = reference_mask(mb, window)["attention_mask"]
    to_additive = lambda allowed: torch.zeros(allowed.shape, device=allowed.device).masked_fill(  # noqa: E731
        ~allowed, torch.finfo(torch.float32).min
    )
    return {"full_attention": to_additive(full), "sliding_attention": to_additive(windowed)}


def _reference_inputs(model, mb: dict) -> tuple[dict, torch.Tensor | None]:
    """Model inputs for one process, and the 2-D padding mask the router loss counts tokens with."""
    padding = mb.get("attention_mask")
    if model.config.model_type == "gpt_oss" and "position_ids" in mb:
        inputs = {
            "input_ids": mb["input_ids"],
            "position_ids": mb["position_ids"],
            "attention_mask": _gpt_oss_masks(mb, model.config.sliding_window),
        }
        return inputs, padding
    # Qwen2-MoE keeps sliding_window=0 with use_sliding_window=False: no window.
    window = getattr(model.config, "sliding_window", None) or None
    if getattr(model.config, "use_sliding_window", True) is False:
        window = None
    return reference_mask(mb, window), padding


def moe_micro_loss(model, mb: dict, labels: torch.Tensor, num_tokens: int, num_micro: int) -> torch.Tensor:
    """One process, one micro-batch: CE sum / targets + coef * transformers' aux loss / micro-batches."""
    cfg = model.config
    modeling = importlib.import_module(type(model).__module__)
    inputs, padding = _reference_inputs(model, mb)
    out = model.model(**inputs, output_router_logits=cfg.output_router_logits)
    logits = model.lm_head(out.last_hidden_state)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") / num_tokens
    if hasattr(modeling, "load_balancing_loss_func") and cfg.output_router_logits:
        aux = modeling.load_balancing_loss_func(
            out.router_logits, model.num_experts, model.num_experts_per_tok, padding
        )
        loss = loss + cfg.router_aux_loss_coef * aux / num_micro
    return loss


def train_reference_moe(model, batches, **kwargs) -> dict:
    """One plain process: loss = sum CE / targets + coef * mean over micro-batches of transformers' aux loss."""
    return train_reference(model, batches, micro_loss=moe_micro_loss, **kwargs)


def train_parallel_moe(family: str, layout: dict, batches, **kwargs) -> dict:
    """The same run through ndparallel on this rank's part of ``layout``; rank 0 returns the full weights."""
    return train_parallel(family, layout, batches, build=lambda name: make_moe_model(name), **kwargs)
