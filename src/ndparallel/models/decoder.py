"""Find the parts of a Hugging Face decoder model that parallel strategies act on.

Nothing here is distributed: it reads the module tree and the model's own ``base_model_tp_plan`` (which
transformers ships for Llama, Qwen2, Qwen3, Mistral and most decoder families) and returns named parts.
A family whose plan uses a style we do not implement, or whose tree does not have the usual
embed -> layers -> norm -> lm_head shape, is refused with a message that says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from ndparallel.errors import ModelError
from ndparallel.models.moe import is_moe_config, moe_attention_plan

# transformers' plan styles -> ours. "qk_norm" is a norm applied per head inside attention: its weight is
# replicated over tp and its gradient summed over tp (transformers calls it replicated_with_grad_allreduce).
_STYLE_MAP = {"colwise": "colwise", "rowwise": "rowwise", "replicated_with_grad_allreduce": "qk_norm"}

# Used when a config carries no plan but the layers look like Llama's.
_LLAMA_LIKE_PLAN = {
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise",
    "layers.*.mlp.up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",
}


@dataclass
class DecoderParts:
    """Named parts of a causal LM, with the per-layer TP plan in our style names."""

    model: nn.Module
    base: nn.Module
    layers: nn.ModuleList
    embed: nn.Embedding
    final_norm: nn.Module
    lm_head: nn.Linear
    tied: bool
    layer_plan: dict[str, str] = field(default_factory=dict)
    """Paths inside one layer -> 'colwise' | 'rowwise' | 'qk_norm'."""
    residual_norms: list[str] = field(default_factory=list)
    """Norms of one layer that act on the residual stream (sequence-parallel under TP)."""
    gathered_inputs: list[str] = field(default_factory=list)
    """Sub-modules of one layer whose input is gathered along the sequence before their colwise linears."""


def decoder_parts(model: nn.Module) -> DecoderParts:
    arch = type(model).__name__
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    lm_head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    final_norm = getattr(base, "norm", None)
    if not isinstance(layers, nn.ModuleList) or embed is None or lm_head is None or final_norm is None:
        raise ModelError(
            f"{arch} does not have the decoder shape ndparallel parallelizes (model.embed_tokens, model.layers, "
            f"model.norm, lm_head); supported families: Llama, Qwen2, Qwen3, Mistral and models built like them"
        )
    tied = lm_head.weight is embed.weight
    if is_moe_config(model.config):  # attention only: MoE blocks run unsplit on each tp rank's tokens (models/moe.py)
        plan_source = moe_attention_plan(model.config)
    else:
        plan_source = getattr(model.config, "base_model_tp_plan", None) or _LLAMA_LIKE_PLAN
    layer_plan: dict[str, str] = {}
    for pattern, style in plan_source.items():
        if not pattern.startswith("layers.*."):
            continue
        ours = _STYLE_MAP.get(style)
        if ours is None:
            raise ModelError(
                f"{arch}: tensor parallelism does not support the plan entry {pattern!r}: {style!r}; "
                f"set tp_size=1 for this model (FSDP and CP still apply)"
            )
        layer_plan[pattern[len("layers.*."):]] = ours
    first = layers[0]
    for path in layer_plan:
        if _get(first, path) is None:
            raise ModelError(f"{arch}: the tensor-parallel plan names {path!r}, which layer 0 does not have")
    hidden = embed.weight.shape[1]
    residual_norms = [
        name for name, child in first.named_children()
        if _is_norm(child) and getattr(child, "weight", None) is not None and child.weight.shape == (hidden,)
    ]
    gathered = sorted({path.split(".")[0] for path, style in layer_plan.items() if style == "colwise"})
    return DecoderParts(
        model=model, base=base, layers=layers, embed=embed, final_norm=final_norm, lm_head=lm_head, tied=tied,
        layer_plan=layer_plan, residual_norms=residual_norms, gathered_inputs=gathered,
    )


def _is_norm(module: nn.Module) -> bool:
    name = type(module).__name__.lower()
    return "norm" in name


def _get(module: nn.Module, path: str) -> nn.Module | None:
    for part in path.split("."):
        module = getattr(module, part, None)
        if module is None:
            return None
    return module
