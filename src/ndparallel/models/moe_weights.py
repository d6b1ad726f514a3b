"""Stacked expert weights from checkpoints that store one tensor per expert (the Hugging Face Hub layout).

transformers 5.x keeps each MoE layer's experts as 3-D parameters but reads and writes checkpoints in the
per-expert layout the Hub models were published in (its conversion mapping). ndparallel reads a checkpoint
tensor by tensor, so the stacked tensor it needs is assembled here from the per-expert ones:

    <layer>.mlp.experts.gate_up_proj (E, 2I, H) = stack over e of [gate_proj[e]; up_proj[e]]   (Qwen2/3-MoE,
    <layer>.mlp.experts.down_proj    (E, H, I)  = stack over e of down_proj[e]                   DeepSeek ...)

Mixtral names its experts ``block_sparse_moe.experts.<e>.w1`` (gate), ``w3`` (up), ``w2`` (down), and its
router ``block_sparse_moe.gate``. Checkpoints that already hold the stacked tensors (gpt-oss, or those
written by ndparallel) are read as they are, by the caller.
"""

from __future__ import annotations

import re
from typing import Callable

import torch

from ndparallel.errors import ModelError

# per-expert names of (gate, up) and down, by checkpoint layout: Qwen/DeepSeek style, Mixtral style
_LAYOUTS = (("mlp", ("gate_proj", "up_proj"), "down_proj"), ("block_sparse_moe", ("w1", "w3"), "w2"))
_STACKED = re.compile(r"^(?P<layer>.+)\.mlp\.experts\.(?P<name>gate_up_proj|down_proj)$")
_MIXTRAL_ROUTER = re.compile(r"^(?P<layer>.+)\.mlp\.gate\.weight$")


def hub_expert_tensor(key: str, has: Callable[[str], bool], read: Callable[[str], torch.Tensor]) -> torch.Tensor | None:
    """The tensor of model key ``key`` assembled from per-expert checkpoint tensors, or None if there are none."""
    router = _MIXTRAL_ROUTER.match(key)
    if router and has(f"{router['layer']}.block_sparse_moe.gate.weight"):
        return read(f"{router['layer']}.block_sparse_moe.gate.weight")
    if has(f"{key}_blocks"):  # gpt-oss as published: MXFP4 blocks and scales
        raise ModelError(
            f"the checkpoint holds {key} quantized (MXFP4 {key}_blocks / _scales); ndparallel trains from "
            f"unquantized weights: load it once with transformers' Mxfp4Config(dequantize=True) and "
            f"save_pretrained the result, then use that directory"
        )
    match = _STACKED.match(key)
    if match is None:
        return None
    layer, name = match["layer"], match["name"]
    for block, (gate, up), down in _LAYOUTS:
        prefix = f"{layer}.{block}.experts"
        if not has(f"{prefix}.0.{down}.weight"):
            continue
        experts = _count(prefix, down, has)
        if name == "down_proj":
            return torch.stack([read(f"{prefix}.{e}.{down}.weight") for e in range(experts)])
        return torch.stack(
            [
                torch.cat([read(f"{prefix}.{e}.{gate}.weight"), read(f"{prefix}.{e}.{up}.weight")])
                for e in range(experts)
            ]
        )
    return None


def _count(prefix: str, down: str, has: Callable[[str], bool]) -> int:
    n = 0
    while has(f"{prefix}.{n}.{down}.weight"):
        n += 1
    return n
