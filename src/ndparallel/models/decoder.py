"""Find the parts of a Hugging Face decoder model that parallel strategies act on.

Nothing here is distributed: it reads the module tree and the family's TP plan (``families.py``: transformers'
own ``base_model_tp_plan``, or ours where transformers ships none) and returns named parts. Trees are
found by the names transformers uses across families: the base model (``model`` or ``transformer``), its
layers (``layers`` or ``h``), its final norm (``norm``, ``ln_f`` or ``final_layernorm``). A model without
that shape is refused with a message that says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from ndparallel.errors import ModelError
from ndparallel.models.families import family_problems, layer_tp_plan, model_attention_reason

_LAYER_LISTS = ("layers", "h")
_FINAL_NORMS = ("norm", "ln_f", "final_layernorm")
_ATTENTIONS = ("self_attn", "self_attention", "attn")
# Styles whose linears take the whole sequence: their block's input is gathered once before them.
_GATHERING_STYLES = ("colwise", "colwise_gather")


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
    """Paths inside one layer -> a style of ``families.STYLES``."""
    residual_norms: list[str] = field(default_factory=list)
    """Norms of one layer that act on the residual stream (sequence-parallel under TP)."""
    gathered_inputs: list[str] = field(default_factory=list)
    """Sub-modules of one layer whose input is gathered along the sequence before their colwise linears."""
    own_attention: str | None = None
    """Why the model keeps transformers' attention rather than ndparallel's (None: it takes ndparallel's)."""


def decoder_parts(model: nn.Module) -> DecoderParts:
    arch = type(model).__name__
    config = model.config
    problems = family_problems(config, tp=1, cp=1)
    if problems:
        raise ModelError(problems[0])
    base = getattr(model, "base_model", None)
    layers = _first_attr(base, _LAYER_LISTS)
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    lm_head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    final_norm = _first_attr(base, _FINAL_NORMS)
    if not isinstance(layers, nn.ModuleList) or embed is None or lm_head is None or final_norm is None:
        raise ModelError(
            f"{arch} does not have the decoder shape ndparallel parallelizes (embeddings, a list of layers, a final "
            f"norm, lm_head); supported families are listed in the README's model table"
        )
    first = layers[0]
    if _first_attr(first, _ATTENTIONS) is None:
        raise ModelError(
            f"{arch}: layer 0 has no attention module ({', '.join(_ATTENTIONS)}); ndparallel trains attention decoders"
        )
    # a plan written for a family's variants names projections this variant declares as None (DeepSeek-V3's
    # q_proj without a query LoRA rank, q_b_proj with one): not this model's, so not in its plan
    layer_plan = {path: style for path, style in layer_tp_plan(config).items() if not _declared_absent(first, path)}
    for path in layer_plan:
        if _get(first, path) is None:
            if not getattr(config, "base_model_tp_plan", None):  # no plan of its own, and not built like Llama
                raise ModelError(
                    f"{arch} does not have the decoder shape ndparallel parallelizes (its layers are not built like "
                    f"Llama's: no {path!r}, and transformers ships no tensor-parallel plan for it); supported "
                    f"families are listed in the README's model table"
                )
            raise ModelError(f"{arch}: the tensor-parallel plan names {path!r}, which layer 0 does not have")
    hidden = embed.weight.shape[1]
    residual_norms = [
        name
        for name, child in first.named_children()
        if _is_norm(child) and getattr(child, "weight", None) is not None and child.weight.shape == (hidden,)
    ]
    gathered = sorted({path.split(".")[0] for path, style in layer_plan.items() if style in _GATHERING_STYLES})
    return DecoderParts(
        model=model,
        base=base,
        layers=layers,
        embed=embed,
        final_norm=final_norm,
        lm_head=lm_head,
        tied=lm_head.weight is embed.weight,
        layer_plan=layer_plan,
        residual_norms=residual_norms,
        gathered_inputs=gathered,
        own_attention=model_attention_reason(config),
    )


def _first_attr(module: nn.Module | None, names: tuple[str, ...]) -> nn.Module | None:
    for name in names:
        found = getattr(module, name, None)
        if isinstance(found, nn.Module):
            return found
    return None


def _is_norm(module: nn.Module) -> bool:
    name = type(module).__name__.lower()
    return "norm" in name


def _declared_absent(module: nn.Module, path: str) -> bool:
    """The module at ``path``'s parent exists and holds the name, set to None."""
    parent_path, _, name = path.rpartition(".")
    parent = _get(module, parent_path) if parent_path else module
    if parent is None:
        return False
    # nn.Module keeps None in _modules when a submodule was assigned before, else as a plain attribute
    return any(name in held and held[name] is None for held in (parent._modules, parent.__dict__))


def _get(module: nn.Module, path: str) -> nn.Module | None:
    for part in path.split("."):
        module = getattr(module, part, None)
        if module is None:
            return None
    return module
