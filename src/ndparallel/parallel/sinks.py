"""Attention with per-head sink logits (gpt-oss), exact for packed and padded rows, without context parallelism.

A sink is one extra logit per head that joins every query's softmax and contributes no value:

    out = softmax([q k^T * scale + mask, s_h])[:, :-1] @ v

ndparallel's attention (parallel/context.py) does not take sinks yet, so models that have them use this
function instead: the math of transformers' own gpt-oss eager attention, with the mask built from
ndparallel's segment ids (causal, within a document, within the layer's sliding window; padding sees only
padding). It materializes the (L x L) scores of a row and refuses cp > 1: a stopgap until the
linear-cost attention takes sinks (merge a sink as a key block of logit s_h and value 0:
out' = out * exp(lse) / (exp(lse) + exp(s_h)), lse' = logaddexp(lse, s_h)).
Under tensor parallelism the sinks are a DTensor split over the heads like q_proj; each rank uses its part.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

from ndparallel.errors import ConfigError
from ndparallel.parallel.context import SEGMENTS_HOST_KWARG, SEGMENTS_KWARG, SINGLE_KWARG

SINK_ATTENTION_NAME = "ndparallel-sinks"


def sink_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                   **kwargs):
    """transformers' attention signature: q (B, H, L, D), k/v (B, Hkv, L, D) -> ((B, L, H, D), None)."""
    segments = kwargs.pop(SEGMENTS_KWARG, None)
    kwargs.pop(SEGMENTS_HOST_KWARG, None)
    kwargs.pop(SINGLE_KWARG, None)
    sinks = kwargs.get("s_aux")
    if sinks is None:
        raise ConfigError(f"{type(module).__name__} has no attention sinks; ndparallel selected the sink attention "
                          f"by mistake (please report this)")
    if dropout:
        raise ConfigError(f"attention dropout {dropout} is not supported; set the model's attention_dropout to 0")
    sinks = sinks.to_local() if isinstance(sinks, DTensor) else sinks
    allowed = _allowed(query, segments, attention_mask, kwargs.get("sliding_window"))
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    scores = (query @ key.transpose(-1, -2)) * scale  # (B, H, L, L)
    scores = scores.masked_fill(~allowed, float("-inf"))
    sink_col = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1)
    logits = torch.cat([scores, sink_col], dim=-1)
    logits = logits - logits.amax(dim=-1, keepdim=True)
    probs = torch.softmax(logits, dim=-1)[..., :-1].to(value.dtype)
    return (probs @ value).transpose(1, 2).contiguous(), None


def _allowed(query: torch.Tensor, segments: torch.Tensor | None, attention_mask: torch.Tensor | None,
             window: int | None) -> torch.Tensor:
    """Boolean (B or 1, 1, L, L): may query i attend to key j."""
    length = query.shape[2]
    if segments is None and attention_mask is not None and attention_mask.dtype == torch.bool:
        return attention_mask[..., :length, :length]  # transformers' own mask (a call outside ndparallel batches)
    i = torch.arange(length, device=query.device)
    allowed = i[:, None] >= i[None, :]
    if window is not None:
        allowed = allowed & (i[:, None] - i[None, :] < window)
    allowed = allowed[None, None]
    if segments is not None:
        if segments.shape[1] != length:
            raise ConfigError("attention sinks with context parallelism are not supported yet; set cp_size=1")
        allowed = allowed & (segments[:, None, :, None] == segments[:, None, None, :])
    return allowed


def apply_sink_attention(model: nn.Module) -> None:
    """Select ``sink_attention`` for a model whose attention has sinks (call after apply_context_parallel)."""
    AttentionInterface.register(SINK_ATTENTION_NAME, sink_attention)
    AttentionMaskInterface.register(SINK_ATTENTION_NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    model.set_attn_implementation(SINK_ATTENTION_NAME)


def has_sinks(model: nn.Module) -> bool:
    return any(isinstance(getattr(m, "sinks", None), nn.Parameter) for m in model.modules())
