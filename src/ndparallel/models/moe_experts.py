"""The experts of one MoE block applied to tokens already grouped by expert, and the experts function
transformers calls (``experts_forward``, selected through its ``ExpertsInterface``). Nothing here is
distributed: with expert parallelism the rows travel through the ``exchange`` that ``parallel/expert.py`` binds.

transformers' experts modules (models/moe.py) keep all experts' weights as 3-D tensors; this applies a
contiguous range of them (all of them, or the ``num_experts / ep`` an expert-parallel rank holds) to rows
sorted by expert, with the same arithmetic as transformers' own implementations:

    x (N, H) rows of expert e together, sizes[e] rows each
      -> up:    x_e @ W_up[e]^T (+ b_up[e])    (N, 2I) gated, or (N, I)
      -> gate:  experts._apply_gate (SwiGLU, gpt-oss' clamped variant ...) or experts.act_fn
      -> down:  h_e @ W_down[e]^T (+ b_down[e]) (N, H)

On a GPU in bf16 each projection is one grouped matmul (``_compat.grouped_mm``); elsewhere (CPU, fp32) a
loop over the experts, which is the dense-loop baseline the GPU benchmark compares against.

LoRA on experts (``adapters/lora_experts.py``): a weight with adapters is used as W + scaling * B @ A per expert,
the adapters (E, r, in) and (E, out, r) indexed like the weight.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from transformers.integrations.moe import ExpertsInterface

from ndparallel import _compat
from ndparallel.models.moe import num_experts_of

EXPERTS_NAME = "ndparallel-experts"


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of an expert-parallel DTensor (its experts, along dim 0); plain tensors pass."""
    return t.to_local() if isinstance(t, DTensor) else t


def adapted_weight(experts: nn.Module, name: str) -> torch.Tensor:
    """``experts.<name>`` (this rank's experts), with its LoRA delta added when it has adapters."""
    weight = local(getattr(experts, name))
    lora_a = getattr(experts, f"{name}_lora_A", None)
    if lora_a is None:
        return weight
    lora_b = getattr(experts, f"{name}_lora_B")
    delta = torch.bmm(local(lora_b), local(lora_a)) * experts.lora_scaling  # (E, out, r) @ (E, r, in) = (E, out, in)
    if experts.is_transposed:
        delta = delta.transpose(1, 2)
    return weight + delta.to(weight.dtype)


def _grouped_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, counts: torch.Tensor, transposed: bool
) -> torch.Tensor:
    """x (N, in) grouped by expert, counts[e] rows each -> (N, out). weight (E, out, in), or (E, in, out) when
    ``transposed``; bias (E, out)."""
    w = weight if transposed else weight.transpose(1, 2)  # (E, in, out)
    if _compat.grouped_mm_available(x, w):
        # offsets stay on the device: no host sync on this path
        out = _compat.grouped_mm(x, w, torch.cumsum(counts.to(x.device), 0, dtype=torch.int32))
    else:
        out = torch.cat([rows @ w[e] for e, rows in enumerate(x.split(counts.tolist()))])
    if bias is not None:
        out = out + torch.repeat_interleave(bias, counts.to(bias.device), dim=0, output_size=x.shape[0])
    return out


def run_experts(experts: nn.Module, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Apply this rank's experts to ``x`` (N, H): the first ``counts[0]`` rows to its first expert, and so on."""
    up_name = "gate_up_proj" if experts.has_gate else "up_proj"
    bias_up = local(getattr(experts, f"{up_name}_bias")) if experts.has_bias else None
    bias_down = local(experts.down_proj_bias) if experts.has_bias else None
    x = x.to(getattr(experts, up_name).dtype)
    hidden = _grouped_linear(x, adapted_weight(experts, up_name), bias_up, counts, experts.is_transposed)
    hidden = experts._apply_gate(hidden) if experts.has_gate else experts.act_fn(hidden)
    out = _grouped_linear(hidden, adapted_weight(experts, "down_proj"), bias_down, counts, experts.is_transposed)
    if getattr(experts, "has_post_expert_norm", False):
        out = experts.post_expert_norm(out)
    return out


def inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return inverse


def combine(
    expert_out: torch.Tensor, order: torch.Tensor, top_k_weights: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Rows in expert order (T*k, H) -> each token's weighted sum over its k experts (T, H)."""
    tokens, k = top_k_weights.shape
    per_choice = expert_out.index_select(0, inverse_permutation(order)).view(tokens, k, -1)
    return (per_choice * top_k_weights.unsqueeze(-1)).sum(dim=1).to(dtype)


def sort_by_expert(top_k_index: torch.Tensor) -> torch.Tensor:
    """Order of the (token, choice) pairs, flattened, that groups them by expert (stable: token order kept)."""
    return torch.argsort(top_k_index.reshape(-1), stable=True)


@dataclass(frozen=True)
class ExpertSetup:
    """The static part of the experts' forward for a run."""

    num_experts: int
    ep_size: int = 1
    ep_group: Any = None
    """The process group of the ep ranks (expert parallelism), None when every expert is here."""
    exchange: Callable | None = None
    """With ep_size > 1 (``parallel/expert.py``): ``exchange(experts, rows sorted by expert, rows per expert,
    setup)`` sends the rows to the ranks holding their experts, runs them there and returns their outputs."""


def experts_forward(
    experts: nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    *,
    setup: ExpertSetup,
) -> torch.Tensor:
    """transformers' experts signature: hidden (T, H), top_k_index / top_k_weights (T, k) -> (T, H)."""
    k = top_k_index.shape[-1]
    order = sort_by_expert(top_k_index)
    rows = hidden_states.index_select(0, order // k)  # (T*k, H), grouped by expert = by owning rank
    flat = top_k_index.reshape(-1)
    counts = torch.zeros(setup.num_experts, dtype=torch.long, device=flat.device)
    counts = counts.scatter_add(0, flat, torch.ones_like(flat))  # rows per expert (bincount would sync the host)
    if setup.ep_size == 1:
        out = run_experts(experts, rows, counts)
    else:
        out = setup.exchange(experts, rows, counts, setup)
    return combine(out, order, top_k_weights, hidden_states.dtype)


def register_experts(model: nn.Module, setup: ExpertSetup, group_name: str) -> None:
    """Select ndparallel's experts function (bound to ``setup``) through transformers' ExpertsInterface."""
    name = f"{EXPERTS_NAME}-{group_name}"
    ExpertsInterface.register(name, functools.partial(experts_forward, setup=setup))
    model.set_experts_implementation(name)


def uses_ndparallel_experts(model: nn.Module) -> bool:
    return str(getattr(model.config, "_experts_implementation", "")).startswith(EXPERTS_NAME)


def ensure_ndparallel_experts(model: nn.Module) -> None:
    """Outside ``parallelize`` (one process, e.g. an export): the local experts function, so expert adapters apply."""
    if not uses_ndparallel_experts(model):
        register_experts(model, ExpertSetup(num_experts_of(model.config)), "local")
