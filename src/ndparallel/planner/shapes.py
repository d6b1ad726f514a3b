"""What the planner needs to know about a decoder model: its dimensions, and parameter counts from them.

Only shapes matter (no weights are read). A ``ModelShape`` comes from a preset name, a Hugging Face config
(object or dict), a local model directory's ``config.json`` or inline JSON; see ``load_model_shape``.

Parameter counts, with h hidden, q = heads x head_dim, kv = kv_heads x head_dim, i intermediate, V vocab:

    one decoder layer   h*q (q_proj) + 2*h*kv (k_proj, v_proj) + q*h (o_proj) + 3*h*i (gate, up, down)
                        + 2*h (two RMSNorm weights) [+ q + 2*kv q/k/v biases] [+ 2*head_dim q/k norms]
    embedding           V*h;  lm_head V*h unless tied;  final norm h

Mixture-of-experts models are planned as the dense model a token sees: ``intermediate`` is the width of the
experts a token passes (top-k x expert width, + shared experts and the router, averaged over the layers), so
compute and activations are a token's; ``idle_expert_params`` (per layer) are the other experts' weights,
which memory and FSDP traffic count and compute does not. Expert parallelism itself is not weighed (its
all-to-all, the gathered experts per rank): ``expert_parallel_size`` is applied to the layout chosen.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import asdict, dataclass, fields
from types import SimpleNamespace
from typing import Any

from ndparallel.errors import ConfigError, NdParallelError
from ndparallel.models import presets
from ndparallel.models.moe import is_moe_config, moe_shape
from ndparallel.safe_io.hub import is_hub_id, model_dir

# Linear layers LoRA adapts ("all-linear"): each gets A (r x in) and B (out x r).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ModelShape:
    """Dimensions of a Llama/Qwen/Mistral-shaped decoder."""

    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int | None = None
    """Defaults to hidden // heads."""
    tied: bool = False
    """Input embedding and lm_head share one weight."""
    attention_bias: bool = False
    """q/k/v projections carry biases (Qwen2)."""
    qk_norm: bool = False
    """Per-head RMSNorm on queries and keys (Qwen3)."""
    name: str = "custom"
    experts: int = 0
    """Mixture of experts: experts per MoE layer (0: a dense model)."""
    active_experts: int = 0
    """Experts each token passes through (top-k)."""
    idle_expert_params: int = 0
    """Per layer (averaged): expert weights stored but not used by a given token."""

    def __post_init__(self) -> None:
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden // max(self.heads, 1))
        for f in ("vocab", "hidden", "intermediate", "layers", "heads", "kv_heads", "head_dim"):
            value = getattr(self, f)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"model {f}={value!r} must be a whole number >= 1; check the model's config")
        if self.heads % self.kv_heads:
            raise ConfigError(
                f"model heads={self.heads} is not a multiple of kv_heads={self.kv_heads}; check the model's config"
            )

    # -- derived sizes ----------------------------------------------------------------------------
    @property
    def q_dim(self) -> int:
        """Width of the query projection: heads x head_dim."""
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of the key (and of the value) projection: kv_heads x head_dim."""
        return self.kv_heads * self.head_dim

    @functools.cache  # noqa: B019 (shapes are few, immutable and hashable)
    def layer_split_params(self) -> int:
        """Parameters of one layer that tensor parallelism splits (all linears and q/k/v biases)."""
        h, q, kv, i = self.hidden, self.q_dim, self.kv_dim, self.intermediate
        n = h * q + 2 * h * kv + q * h + 3 * h * i + self.idle_expert_params
        if self.attention_bias:
            n += q + 2 * kv
        return n

    def layer_linear_weights(self) -> int:
        """Weights of one layer's seven linears (what a quantized base stores as codes)."""
        h, q, kv, i = self.hidden, self.q_dim, self.kv_dim, self.intermediate
        return h * q + 2 * h * kv + q * h + 3 * h * i

    def layer_linear_rows(self) -> int:
        """Output rows of one layer's seven linears (int8 keeps one scale per row)."""
        return self.q_dim + 2 * self.kv_dim + self.hidden + 2 * self.intermediate + self.hidden

    @functools.cache  # noqa: B019 (shapes are few, immutable and hashable)
    def layer_replicated_params(self) -> int:
        """Parameters of one layer every tp rank holds whole (norm weights)."""
        return 2 * self.hidden + (2 * self.head_dim if self.qk_norm else 0)

    def layer_params(self) -> int:
        return self.layer_split_params() + self.layer_replicated_params()

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def head_params(self) -> int:
        """lm_head weight, 0 when tied to the embedding."""
        return 0 if self.tied else self.vocab * self.hidden

    @property
    def params(self) -> int:
        """All parameters."""
        return self.layers * self.layer_params() + self.embedding_params + self.head_params + self.hidden

    @functools.cache  # noqa: B019 (shapes are few, immutable and hashable)
    def split_params(self) -> int:
        """Parameters tensor parallelism splits: layer linears, embedding (vocab-parallel), lm_head."""
        return self.layers * self.layer_split_params() + self.embedding_params + self.head_params

    @functools.cache  # noqa: B019 (shapes are few, immutable and hashable)
    def replicated_params(self) -> int:
        """Parameters held whole by every tp rank: the norms."""
        return self.layers * self.layer_replicated_params() + self.hidden

    @functools.cache  # noqa: B019 (shapes are few, immutable and hashable)
    def matmul_params(self) -> int:
        """Weights used in matrix products per token: layer linears and the output projection (tied or not).

        The embedding lookup is a gather, not a product, so it is left out of the 6*N FLOP count.
        """
        return self.layers * (self.layer_split_params() - self.idle_expert_params) + self.vocab * self.hidden

    def lora_params_per_layer(self, rank: int) -> int:
        """LoRA adapter parameters of one layer, all seven linears adapted: r * (in + out) each."""
        h, q, kv, i = self.hidden, self.q_dim, self.kv_dim, self.intermediate
        ins_outs = [(h, q), (h, kv), (h, kv), (q, h), (h, i), (h, i), (i, h)]
        return rank * sum(a + b for a, b in ins_outs)

    def hf_like(self) -> SimpleNamespace:
        """The attribute names ``parallel.rules.model_problems`` reads from a transformers config."""
        return SimpleNamespace(
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            intermediate_size=self.intermediate,
            vocab_size=self.vocab,
            hidden_size=self.hidden,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    # -- constructors -----------------------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, cfg: Any, *, name: str | None = None) -> "ModelShape":
        """From a transformers config object or its dict (``config.json`` contents).

        Multimodal configs that nest the decoder under ``text_config`` are read from there.
        """
        get = (lambda k, d=None: cfg.get(k, d)) if isinstance(cfg, dict) else (lambda k, d=None: getattr(cfg, k, d))
        text = get("text_config")
        if text is not None and get("hidden_size") is None:
            return cls.from_hf_config(text, name=name)
        missing = [
            k
            for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
            if get(k) is None
        ]
        if missing:
            raise ConfigError(
                f"model config lacks {', '.join(missing)}; give a decoder config (Llama, Qwen, Mistral shape)"
            )
        heads = int(get("num_attention_heads"))
        model_type = str(get("model_type", "") or "")
        experts = _experts(cfg)
        return cls(
            vocab=int(get("vocab_size")),
            hidden=int(get("hidden_size")),
            intermediate=experts.get("intermediate", int(get("intermediate_size"))),
            layers=int(get("num_hidden_layers")),
            heads=heads,
            kv_heads=int(get("num_key_value_heads") or heads),
            head_dim=get("head_dim") or None,
            tied=bool(get("tie_word_embeddings", False)),
            attention_bias=bool(get("attention_bias", model_type == "qwen2")),
            qk_norm=model_type.startswith("qwen3"),
            name=name or str(get("_name_or_path", "") or model_type or "custom"),
            experts=experts.get("experts", 0),
            active_experts=experts.get("active_experts", 0),
            idle_expert_params=experts.get("idle_expert_params", 0),
        )

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, name: str | None = None) -> "ModelShape":
        """From our own field names (``to_dict``) or a Hugging Face config dict; ``name`` if it has none."""
        own = {f.name for f in fields(cls)}
        if "hidden_size" in data or "text_config" in data:
            return cls.from_hf_config(data, name=name)
        unknown = sorted(set(data) - own)
        if unknown:
            raise ConfigError(
                f"model fields {unknown} are unknown; use {sorted(own)} or a Hugging Face config.json's names"
            )
        return cls(**{**({"name": name} if name else {}), **data})

    def to_hf_config(self):
        """A transformers config of this shape (Llama family; Qwen2/Qwen3 when biases / q-k norms are set).

        Used to build small random models for measurements.
        """
        from transformers import LlamaConfig, Qwen2Config, Qwen3Config

        common = dict(
            vocab_size=self.vocab,
            hidden_size=self.hidden,
            intermediate_size=self.intermediate,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            head_dim=self.head_dim,
            tie_word_embeddings=self.tied,
            attention_dropout=0.0,
            max_position_embeddings=1 << 20,
        )
        if self.qk_norm:
            return Qwen3Config(**common)
        if self.attention_bias:
            return Qwen2Config(**common)
        return LlamaConfig(**common, attention_bias=False)


def _experts(cfg: Any) -> dict[str, int]:
    """A mixture-of-experts config's planning fields (see the module docstring); {} for a dense model."""
    config = SimpleNamespace(**cfg) if isinstance(cfg, dict) else cfg
    if not is_moe_config(config):
        return {}
    moe, h, layers = moe_shape(config), config.hidden_size, config.num_hidden_layers
    routed = moe.shared_params + moe.router_params
    active = (
        moe.moe_layers * (moe.top_k * moe.expert_params + routed) + moe.dense_layers * moe.dense_mlp_params
    ) / layers
    idle = moe.moe_layers * (moe.num_experts - moe.top_k) * moe.expert_params / layers
    return {
        "intermediate": max(1, round(active / (3 * h))),
        "experts": moe.num_experts,
        "active_experts": moe.top_k,
        "idle_expert_params": round(idle),
    }


def preset_shape(name: str) -> ModelShape | None:
    """The shape of a preset of ``models/presets.py`` ('8b' or 'llama-8b'), or None."""
    key = presets.canonical_name(name)
    if key is None:
        return None
    return ModelShape.from_hf_config(presets.PRESETS[key], name=presets.display_name(key))


# Every preset by the name the planner prints (llama-1b ... llama-405b, tiny, byte-tiny); both spellings load.
PRESETS: dict[str, ModelShape] = {presets.display_name(key): preset_shape(key) for key in presets.PRESETS}


def load_model_shape(spec: "str | dict | ModelShape | Any") -> ModelShape:
    """A ``ModelShape`` from a preset name, a local model directory, a config.json path, inline JSON,
    a dict, a transformers config object, or a ``ModelShape``."""
    if isinstance(spec, ModelShape):
        return spec
    if isinstance(spec, dict):
        return ModelShape.from_dict(spec)
    if not isinstance(spec, str):
        return ModelShape.from_hf_config(spec)
    text = spec.strip()
    shape = preset_shape(text)
    if shape is not None:
        return shape
    if text.startswith("{"):
        try:
            return ModelShape.from_dict(json.loads(text), name="inline")
        except json.JSONDecodeError as exc:
            raise ConfigError(
                f"--model inline JSON does not parse ({exc.msg} at char {exc.pos}); check quoting"
            ) from None
    path = os.path.join(text, "config.json") if os.path.isdir(text) else text
    name = os.path.basename(os.path.dirname(os.path.abspath(path)))
    if not os.path.exists(path) and _is_hub_id(text):
        path, name = _hub_config(text), text.split("/")[-1]
    if os.path.isfile(path):
        with open(path) as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as exc:
                raise ConfigError(
                    f"model config {path} is not valid JSON ({exc.msg}); fix or replace the file"
                ) from None
        return ModelShape.from_hf_config(data, name=name)
    raise ConfigError(
        f"model={spec!r} is not a preset ({presets.choices()}), a directory with config.json, a config file, "
        f"a hub id (org/name) or inline JSON; pass one of those"
    )


def _is_hub_id(text: str) -> bool:
    return is_hub_id(text)


def _hub_config(name: str) -> str:
    """config.json of hub model ``name``, as train reads it (the hub cache; fetched when missing and online)."""
    try:
        return str(model_dir(name, weights=False, setting="--model") / "config.json")
    except NdParallelError as exc:
        raise ConfigError(str(exc)) from None
