"""Where a row's tokens live under context parallelism, and which document each token belongs to.

Load balancing: a row of S tokens is cut into 2*cp chunks of n = S/(2*cp); cp rank c holds chunks c and
2*cp-1-c. Under a causal mask a late chunk does far more work than an early one, and pairing the i-th
chunk with its mirror gives every rank the same amount.

Segment ids say which document a token belongs to: a packed row's documents restart their position ids
at 0, and padding is segment -1. Nothing here talks to other ranks except ``cp_gather``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ndparallel.errors import ConfigError
from ndparallel.mesh.topology import Topology

PAD_SEGMENT = -1


def chunk_ids(cp_rank: int, cp: int) -> tuple[int, int]:
    """The two global chunk indices cp rank ``cp_rank`` of ``cp`` holds: its own and the mirrored one."""
    return cp_rank, 2 * cp - 1 - cp_rank


def cp_shard(
    x: torch.Tensor, *, cp: int | None = None, cp_rank: int, dim: int = 1, cp_size: int | None = None
) -> torch.Tensor:
    """This rank's load-balanced part of ``x`` along ``dim`` (length must divide into 2*cp chunks).
    ``cp_size``: the former spelling of ``cp`` (still accepted)."""
    cp = cp if cp is not None else cp_size
    if cp is None:
        raise TypeError("cp_shard() needs cp= (the context-parallel size)")
    if cp == 1:
        return x
    if x.shape[dim] % (2 * cp):
        raise ConfigError(
            f"sequence length {x.shape[dim]} does not split into 2 x cp_size = {2 * cp} chunks; "
            f"prepare_batch pads rows to a multiple of {2 * cp} for you"
        )
    chunks = x.chunk(2 * cp, dim=dim)
    first, second = chunk_ids(cp_rank, cp)
    return torch.cat([chunks[first], chunks[second]], dim=dim)


def rank_tokens(x: torch.Tensor, *, cp: int, cp_rank: int, tp: int = 1, tp_rank: int = 0, dim: int = 1) -> torch.Tensor:
    """The tokens of ``x`` (whole rows) this rank computes where tp ranks hold different tokens, as between the
    sequence-parallel norms (the MoE blocks and their router): its cp chunks (``cp_shard``), then its 1/tp of
    them. ``cp=1``: ``x`` is already this rank's cp part."""
    x = cp_shard(x, cp=cp, cp_rank=cp_rank, dim=dim)
    return x.chunk(tp, dim=dim)[tp_rank] if tp > 1 else x


def natural_order_index(cp: int, chunk_len: int, device: torch.device | None = None) -> torch.Tensor:
    """Index that puts rank-major gathered tokens (rank 0's two chunks, rank 1's, ...) back in row order."""
    owner_order = [c for rank in range(cp) for c in chunk_ids(rank, cp)]
    slot_of_chunk = torch.empty(2 * cp, dtype=torch.long)
    slot_of_chunk[torch.tensor(owner_order)] = torch.arange(2 * cp)
    index = (slot_of_chunk[:, None] * chunk_len + torch.arange(chunk_len)).flatten()
    return index.to(device) if device is not None else index


def cp_gather(x: torch.Tensor, topology: Topology, *, dim: int = 1) -> torch.Tensor:
    """Inverse of ``cp_shard`` over the cp group: the full tensor, in row order, on every cp rank.

    For logits and debugging; not differentiable.
    """
    cp = topology.layout.cp
    if cp == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(cp)]
    dist.all_gather(parts, x.contiguous(), group=topology.cp.get_group())
    gathered = torch.cat(parts, dim=dim)
    chunk_len = x.shape[dim] // 2
    return gathered.index_select(dim, natural_order_index(cp, chunk_len, x.device))


def segment_ids_from(position_ids: torch.Tensor, padding: torch.Tensor | None) -> torch.Tensor:
    """Document id per token: a new document starts where the position id is 0; padding gets -1."""
    segments = torch.cumsum((position_ids == 0).long(), dim=-1)
    if padding is not None:
        segments = segments.masked_fill(padding, PAD_SEGMENT)
    return segments


def single_segment(segment_ids_host: torch.Tensor) -> bool:
    """Every row is one document with no padding (plain causal attention is exact)."""
    return bool((segment_ids_host == segment_ids_host[:, :1]).all()) and bool(
        (segment_ids_host[:, 0] != PAD_SEGMENT).all()
    )
