"""The MLP over sequence tiles: only one tile's intermediates exist at a time.

A dense MLP's intermediates are the widest per-token tensors of a layer: gate, up, act(gate) and their
product, each (L, I) for I = 4-5x the hidden size (1B: 4 x 131,072 x 8,192 bf16 = 8 GiB at 131k tokens),
and under full activation checkpointing they all exist while a layer is recomputed and differentiated.
The MLP is per-token, so running it on tiles of the sequence gives the same numbers; each tile runs
under its own (non-reentrant) activation checkpoint, which keeps only the tile's input and recomputes the
tile in its backward. The cost is one more MLP forward per step.

Tile count: ``num_tiles`` when given (Axolotl's ``tiled_mlp_num_shards``), else enough tiles that one
tile's four (tile, I) intermediates take no more than one (L, H) hidden-state tensor, with tiles of at
least ``MIN_TILE_TOKENS`` (the GEMMs stay efficient, and short rows are not tiled at all).

Under tensor parallelism the MLP's input is sequence-sharded (B, L/t, H): each rank cuts its own shard
into tiles, and the i-th tiles of all ranks form one sequence-sharded tile (a different set of positions
than a contiguous slice, which a per-token block cannot tell apart), gathered by the MLP's own
pre-hook and reduce-scattered by its row-parallel output as for the whole row. Under context
parallelism each rank tiles its own part of the row. FSDP gathers the layer's weights once for the
whole layer; the tiles only reuse them.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from ndparallel import _compat
from ndparallel.models.decoder import DecoderParts
from ndparallel.models.moe import is_moe_config

MIN_TILE_TOKENS = 2048


def tile_count(tokens: int, *, hidden: int, intermediate: int, num_tiles: int | None = None) -> int:
    """Tiles for an MLP input of ``tokens`` local tokens (1: not tiled)."""
    if num_tiles is not None:
        return max(1, min(num_tiles, tokens))
    tile = max(MIN_TILE_TOKENS, math.ceil(tokens * hidden / (4 * intermediate)))
    return max(1, math.ceil(tokens / tile))


def apply_tiled_mlp(parts: DecoderParts, *, num_tiles: int | None = None) -> int:
    """Run each decoder layer's dense MLP over sequence tiles; returns how many MLPs were tiled (MoE blocks
    are not: their routing is per token too, but their experts' work is already split by token)."""
    config = parts.model.config
    if is_moe_config(config):
        return 0
    hidden = config.hidden_size
    count = 0
    for layer in parts.layers:
        mlp = getattr(layer, "mlp", None)
        if not isinstance(mlp, nn.Module):
            continue
        width = getattr(mlp, "intermediate_size", None) or getattr(config, "intermediate_size", None) or 4 * hidden
        run = functools.partial(_run_tiled, hidden=hidden, intermediate=width, num_tiles=num_tiles)
        layer.mlp = _compat.checkpoint_wrapper(mlp, checkpoint_fn=run)  # state_dict names stay mlp.*
        count += 1
    return count


def _run_tiled(mlp: nn.Module, x: torch.Tensor, *, hidden: int, intermediate: int, num_tiles: int | None):
    local = x.to_local() if isinstance(x, DTensor) else x
    tiles = tile_count(local.shape[1], hidden=hidden, intermediate=intermediate, num_tiles=num_tiles)
    if tiles == 1 or (isinstance(x, DTensor) and x.shape[1] % x.device_mesh.size()):
        return mlp(x)  # one tile, or uneven sequence shards (the i-th tiles would not line up across ranks)
    outputs = []
    for piece in local.chunk(tiles, dim=1):
        tile = _like(x, piece)
        out = checkpoint(mlp, tile, use_reentrant=False, preserve_rng_state=False)
        outputs.append(out.to_local() if isinstance(out, DTensor) else out)
        placements = (out.device_mesh, out.placements) if isinstance(out, DTensor) else None
    joined = torch.cat(outputs, dim=1)
    if placements is None:
        return joined
    return DTensor.from_local(joined, placements[0], placements[1], run_check=False)


def _like(x: torch.Tensor, piece: torch.Tensor) -> torch.Tensor:
    """``piece`` of x's local tensor as a tensor laid out like x (a sequence-sharded DTensor under TP)."""
    if not isinstance(x, DTensor):
        return piece
    return DTensor.from_local(piece, x.device_mesh, x.placements, run_check=False)
