"""Mixture-of-experts models: what ndparallel needs to know about them, from the config and the module tree.

Nothing here is distributed. transformers 5.x builds every MoE family (Qwen3-MoE, Qwen2-MoE, Mixtral,
gpt-oss, DeepSeek-V3, OLMoE ...) the same way: a decoder layer's ``mlp`` is a block holding

- a router (``gate`` or ``router``) whose forward returns ``(router_logits, top_k_weights, top_k_index)``;
- ``experts``: all experts' weights as 3-D parameters, ``gate_up_proj`` (or ``up_proj``) and ``down_proj``,
  shaped (num_experts, out, in), or (num_experts, in, out) when the class says ``is_transposed``, with
  optional biases (num_experts, out); transformers dispatches its forward through ``ExpertsInterface`` by
  ``config._experts_implementation``;
- optionally shared experts every token passes (Qwen2-MoE ``shared_expert``, DeepSeek-V3 ``shared_experts``).

Some layers of a MoE model may hold a dense MLP instead (``mlp_only_layers``, ``first_k_dense_replace``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

from torch import nn

# Attention plans for MoE families whose transformers plan has none (gpt-oss ships only the embedding's).
_ATTENTION_PLANS = {
    "gpt_oss": {
        "layers.*.self_attn.q_proj": "colwise",
        "layers.*.self_attn.k_proj": "colwise",
        "layers.*.self_attn.v_proj": "colwise",
        "layers.*.self_attn.o_proj": "rowwise",
    },
}
# Families whose attention has per-head sink logits (``s_aux``): gpt-oss.
_SINK_FAMILIES = {"gpt_oss"}
_SUPPORTED_ATTENTION_STYLES = {"colwise", "rowwise", "replicated_with_grad_allreduce"}
_ATTENTION_PREFIX = "layers.*.self_attn."
EXPERT_WEIGHTS = ("gate_up_proj", "up_proj", "down_proj")
EXPERT_BIASES = ("gate_up_proj_bias", "up_proj_bias", "down_proj_bias")


@dataclass(frozen=True)
class MoeFacts:
    """A MoE model's routing, read from its config."""

    num_experts: int
    top_k: int
    aux_loss_coef: float
    """Weight of the router's load-balancing loss in the training loss; 0 when the model adds none (the
    config's ``output_router_logits`` is false, or the family has no such loss, e.g. DeepSeek-V3)."""


def num_experts_of(config: Any) -> int:
    for attr in ("num_local_experts", "num_experts", "n_routed_experts"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    return 0


def is_moe_config(config: Any) -> bool:
    """True for a mixture-of-experts config (a Qwen3-MoE config with num_experts=0 is a dense model)."""
    return num_experts_of(config) > 0 and getattr(config, "num_experts_per_tok", None) is not None


def moe_facts(config: Any) -> MoeFacts | None:
    if not is_moe_config(config):
        return None
    # Only families whose config declares the field add the loss (DeepSeek-V3 balances with a bias instead).
    declared = hasattr(type(config), "router_aux_loss_coef")
    coef = float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0) if declared else 0.0
    enabled = bool(getattr(config, "output_router_logits", False))
    return MoeFacts(
        num_experts=num_experts_of(config),
        top_k=int(config.num_experts_per_tok),
        aux_loss_coef=coef if enabled else 0.0,
    )


def has_attention_sinks(config: Any) -> bool:
    return getattr(config, "model_type", None) in _SINK_FAMILIES


def moe_attention_plan(config: Any) -> dict[str, str]:
    """The tensor-parallel plan of a MoE model: its attention only (the MoE blocks are not split by tp; each tp
    rank runs them on its own slice of the sequence). Entries in styles we do not implement are left out here
    and reported by ``moe_problems`` when tp > 1."""
    kind = getattr(config, "model_type", None)
    source = _ATTENTION_PLANS.get(kind) or getattr(config, "base_model_tp_plan", None) or {}
    return {k: v for k, v in source.items() if k.startswith(_ATTENTION_PREFIX) and v in _SUPPORTED_ATTENTION_STYLES}


def moe_problems(config: Any, *, tp: int, cp: int, ep: int) -> Iterator[str]:
    """What a layout cannot do with this model, one line each (empty for a dense model without ep)."""
    kind = getattr(config, "model_type", "this model")
    if not is_moe_config(config):
        if ep > 1:
            yield (
                f"expert_parallel_size={ep} needs a mixture-of-experts model, but {kind} has no experts; "
                f"set expert_parallel_size=1"
            )
        return
    experts = num_experts_of(config)
    if experts % ep:
        divisors = [d for d in range(1, experts + 1) if experts % d == 0]
        yield (
            f"expert_parallel_size={ep} does not divide the model's {experts} experts; choose expert_parallel_size "
            f"from {divisors}"
        )
    if tp > 1:
        source = _ATTENTION_PLANS.get(kind) or getattr(config, "base_model_tp_plan", None) or {}
        attention = {k: v for k, v in source.items() if k.startswith(_ATTENTION_PREFIX)}
        odd = sorted({v for v in attention.values() if v not in _SUPPORTED_ATTENTION_STYLES})
        if not attention:
            yield (
                f"tp_size={tp}: {kind}'s attention has no tensor-parallel plan in transformers; set tp_size=1 "
                f"(FSDP, context and expert parallelism apply)"
            )
        elif odd:
            yield (
                f"tp_size={tp}: {kind}'s attention plan uses {odd}, which ndparallel's tensor parallelism does not "
                f"implement; set tp_size=1 (FSDP, context and expert parallelism apply)"
            )


# ------------------------------------------------------------------------------------------------
# Sizes (for throughput accounting and the planner)
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MoeShape:
    """Parameter counts of a MoE model's MLPs, from its config.

    Memory and traffic per rank, for the planner (s, c, t = dp_shard, cp, tp sizes; edp = s*c*t / ep;
    T = tokens a rank routes per micro-batch = micro_batch * seq / (c * t); b = bytes per compute element):

    - expert weights held (sharded): moe_layers * E * expert_params / (s*c*t), whatever ep is (ep x edp = s*c*t)
    - expert weights gathered at once (one MoE layer): (E / ep) * expert_params * b  -- what ep saves
    - router and shared-expert weights: FSDP over s*c (x t when t > 1: tp does not split MoE blocks)
    - FSDP traffic per MoE layer and step: all-gather (E/ep) * expert_params * b * (edp-1)/edp in forward (and
      again in backward when resharded), reduce-scatter of the gradients in the reduce dtype
    - ep all-to-all per MoE layer and step: 4 * T * k * hidden * b * (ep-1)/ep (dispatch and combine, forward and
      backward, under uniform routing), plus E counts and one host sync per layer and micro-batch
    - activations per MoE layer: about T * k * (2 * hidden + 3 * expert_intermediate) * b, plus T * k * hidden * b
      twice for the all-to-all buffers when ep > 1
    - router loss: one all-reduce of E + 1 floats over all ranks per micro-batch
    """

    moe_layers: int
    dense_layers: int
    num_experts: int
    top_k: int
    expert_params: int
    """One expert's weights: 3 * hidden * expert_intermediate (+ biases)."""
    shared_params: int
    """Per MoE layer: shared experts and their gate, which every token passes."""
    router_params: int
    dense_mlp_params: int
    """One dense-MLP layer's weights (first_k_dense_replace, mlp_only_layers)."""

    @property
    def active_mlp_params_per_layer(self) -> float:
        """MLP weights one token passes through, averaged over the layers (for FLOPs per token)."""
        moe = self.top_k * self.expert_params + self.shared_params + self.router_params
        layers = self.moe_layers + self.dense_layers
        return (self.moe_layers * moe + self.dense_layers * self.dense_mlp_params) / max(1, layers)


def moe_layer_indices(config: Any) -> list[int]:
    layers = config.num_hidden_layers
    if getattr(config, "first_k_dense_replace", None) is not None:  # DeepSeek
        return list(range(config.first_k_dense_replace, layers))
    step = getattr(config, "decoder_sparse_step", 1) or 1
    dense = set(getattr(config, "mlp_only_layers", None) or [])
    return [i for i in range(layers) if i not in dense and (i + 1) % step == 0]


def moe_shape(config: Any) -> MoeShape | None:
    if not is_moe_config(config):
        return None
    h, experts = config.hidden_size, num_experts_of(config)
    inter = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    biases = 2 * inter + h if getattr(config, "model_type", None) == "gpt_oss" else 0  # gate_up (2I) and down (h)
    shared = 0
    if getattr(config, "shared_expert_intermediate_size", None):  # Qwen2-MoE: one gated shared expert
        shared = 3 * h * config.shared_expert_intermediate_size + h
    elif getattr(config, "n_shared_experts", None):  # DeepSeek
        shared = 3 * h * inter * config.n_shared_experts
    moe = len(moe_layer_indices(config))
    return MoeShape(
        moe_layers=moe,
        dense_layers=config.num_hidden_layers - moe,
        num_experts=experts,
        top_k=int(config.num_experts_per_tok),
        expert_params=3 * h * inter + biases,
        shared_params=shared,
        router_params=h * experts + (experts if getattr(config, "model_type", None) == "gpt_oss" else 0),
        dense_mlp_params=3 * h * config.intermediate_size,
    )


# ------------------------------------------------------------------------------------------------
# The module tree
# ------------------------------------------------------------------------------------------------


@dataclass
class MoeBlock:
    """One decoder layer's MoE block and its parts."""

    block: nn.Module
    router: nn.Module
    experts: nn.Module


def experts_module(module: nn.Module) -> bool:
    """A transformers experts module: 3-D expert weights and the experts-interface attributes."""
    weights = [getattr(module, name, None) for name in EXPERT_WEIGHTS]
    return (
        hasattr(module, "has_gate")
        and hasattr(module, "num_experts")
        and any(isinstance(w, nn.Parameter) and w.dim() == 3 for w in weights)
    )


def moe_blocks(layers: nn.ModuleList) -> list[MoeBlock]:
    """The MoE block of every decoder layer that has one (dense-MLP layers are skipped)."""
    found = []
    for layer in layers:
        block = getattr(layer, "mlp", None)
        experts = getattr(block, "experts", None)
        if experts is None or not experts_module(experts):
            continue
        router = getattr(block, "gate", None) or getattr(block, "router", None)
        if router is None:
            raise AssertionError(f"{type(block).__name__} has experts but no router named 'gate' or 'router'")
        found.append(MoeBlock(block=block, router=router, experts=experts))
    return found


def is_moe_weight(owner: nn.Module, key: str) -> bool:
    """Weights that are drawn like linear weights at init although their module is no nn.Linear: stacked expert
    weights, router weights, attention sinks."""
    return experts_module(owner) or hasattr(owner, "top_k") or key.endswith(".sinks")


def expert_parameters(experts: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The experts' own stacked weights and biases (first dim: the expert), by attribute name."""
    names = EXPERT_WEIGHTS + EXPERT_BIASES
    return [(name, getattr(experts, name)) for name in names if isinstance(getattr(experts, name, None), nn.Parameter)]
