"""Context parallelism, part 1: splitting rows along the sequence and the attention entry point.

Load balancing: a row of S tokens is cut into 2*cp chunks of S/(2*cp); cp rank c holds chunks c and
2*cp-1-c. Under a causal mask a late chunk does far more work than an early one, and pairing the i-th
chunk with its mirror gives every rank the same amount.

Which tokens may attend to which is described by two things per token, computed once per batch from
the full row (every CP rank of a group holds the same rows, so none needs communication):
- its index in the row (causality: a query attends to keys at an index <= its own), and
- its segment id: the document it belongs to (packed rows: a position id of 0 starts a document) or -1
  for padding. A query attends only inside its segment, so no token sees across a document boundary.
Padding forms a segment of its own: its queries still see themselves (no empty softmax rows), and no
real token sees it.

The model's attention is switched, through transformers' ``AttentionInterface``, to an ndparallel
function bound to the topology's cp group (``CPSetup``: static for the run). Per batch, the segment ids
travel as plain keyword tensors (``ndp_segments``...) that transformers passes through to the attention
function: no globals, no patching, and nothing per-batch that ``torch.compile`` would guard on by identity.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ndparallel.errors import ConfigError
from ndparallel.topology import Topology

ATTENTION_NAME = "ndparallel"
SEGMENTS_KWARG, SEGMENTS_HOST_KWARG, SINGLE_KWARG = "ndp_segments", "ndp_segments_host", "ndp_single_segment"
PAD_SEGMENT = -1


# ------------------------------------------------------------------------------------------------
# Sharding along the sequence
# ------------------------------------------------------------------------------------------------


def chunk_ids(cp_rank: int, cp_size: int) -> tuple[int, int]:
    """The two global chunk indices cp rank ``cp_rank`` holds: its own and the mirrored one."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def cp_shard(x: torch.Tensor, *, cp_size: int, cp_rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's load-balanced part of ``x`` along ``dim`` (length must divide into 2*cp_size chunks)."""
    if cp_size == 1:
        return x
    if x.shape[dim] % (2 * cp_size):
        raise ConfigError(
            f"sequence length {x.shape[dim]} does not split into 2 x cp_size = {2 * cp_size} chunks; "
            f"prepare_batch pads rows to a multiple of {2 * cp_size} for you"
        )
    chunks = x.chunk(2 * cp_size, dim=dim)
    first, second = chunk_ids(cp_rank, cp_size)
    return torch.cat([chunks[first], chunks[second]], dim=dim)


def natural_order_index(cp_size: int, chunk_len: int, device: torch.device | None = None) -> torch.Tensor:
    """Index that puts rank-major gathered tokens (rank 0's two chunks, rank 1's, ...) back in row order."""
    owner_order = [c for rank in range(cp_size) for c in chunk_ids(rank, cp_size)]
    position_of_chunk = {chunk: slot for slot, chunk in enumerate(owner_order)}
    index = [position_of_chunk[c] * chunk_len + i for c in range(2 * cp_size) for i in range(chunk_len)]
    return torch.tensor(index, dtype=torch.long, device=device)


def cp_gather(x: torch.Tensor, topology: Topology, *, dim: int = 1) -> torch.Tensor:
    """Inverse of ``cp_shard`` over the cp group: the full tensor, in row order, on every cp rank.

    For logits and debugging; not differentiable.
    """
    cp_size = topology.layout.cp
    if cp_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(cp_size)]
    dist.all_gather(parts, x.contiguous(), group=topology.cp.get_group())
    gathered = torch.cat(parts, dim=dim)
    chunk_len = x.shape[dim] // 2
    return gathered.index_select(dim, natural_order_index(cp_size, chunk_len, x.device))


# ------------------------------------------------------------------------------------------------
# Per-batch attention context
# ------------------------------------------------------------------------------------------------


def segment_ids_from(position_ids: torch.Tensor, padding: torch.Tensor | None) -> torch.Tensor:
    """Document id per token: a new document starts where the position id is 0; padding gets -1."""
    segments = torch.cumsum((position_ids == 0).long(), dim=-1)
    if padding is not None:
        segments = segments.masked_fill(padding, PAD_SEGMENT)
    return segments


@dataclass
class CPSetup:
    """The static part of attention for a run: this rank's place in the cp group, and the method."""

    cp_size: int
    cp_rank: int
    method: str
    cp_group: dist.ProcessGroup | None
    plans: dict = field(default_factory=dict, repr=False)
    """Ring plans of the current batch, keyed by (id of its host segment ids, window); see cp_attention."""

    @classmethod
    def from_topology(cls, topology: Topology) -> "CPSetup":
        layout = topology.layout
        return cls(cp_size=layout.cp, cp_rank=topology.cp_rank, method=layout.cp_comm_strategy,
                   cp_group=topology.cp.get_group() if layout.cp > 1 else None)


@dataclass
class AttentionContext:
    """What attention needs to know about one micro-batch beyond q, k and v.

    ``segment_ids`` covers the whole (padded) row, (B, S), on the compute device; ``segment_ids_host`` is
    the same on the CPU, so decisions about which blocks to compute never wait for the device. The
    local tokens are the cp rank's two chunks.
    """

    segment_ids: torch.Tensor
    segment_ids_host: torch.Tensor
    single_segment: bool
    """Every row is one document with no padding: plain causal attention is exact."""
    setup: CPSetup

    @property
    def cp_size(self) -> int:
        return self.setup.cp_size

    @property
    def cp_rank(self) -> int:
        return self.setup.cp_rank

    @property
    def method(self) -> str:
        return self.setup.method

    @property
    def cp_group(self) -> dist.ProcessGroup | None:
        return self.setup.cp_group

    @property
    def seq_len(self) -> int:
        return self.segment_ids.shape[1]

    @property
    def chunk_len(self) -> int:
        return self.seq_len // (2 * self.cp_size)

    def token_index(self, rank: int | None = None, *, device: torch.device | None = None) -> torch.Tensor:
        """Row indices of the tokens cp rank ``rank`` (default: this one) holds, in local order."""
        rank = self.cp_rank if rank is None else rank
        n = self.chunk_len
        a, b = chunk_ids(rank, self.cp_size)
        device = device or self.segment_ids.device
        return torch.cat([torch.arange(a * n, (a + 1) * n, device=device), torch.arange(b * n, (b + 1) * n, device=device)])

    def allowed(self, q_index: torch.Tensor, k_index: torch.Tensor, window: int | None, *,
                host: bool = False) -> torch.Tensor:
        """Boolean mask (B, 1, Lq, Lk): may the query at row index q attend to the key at row index k."""
        seg = self.segment_ids_host if host else self.segment_ids
        q_index, k_index = q_index.to(seg.device), k_index.to(seg.device)
        same = seg[:, q_index].unsqueeze(-1) == seg[:, k_index].unsqueeze(-2)
        diff = q_index.unsqueeze(-1) - k_index.unsqueeze(-2)
        ok = same & (diff >= 0)
        if window is not None:
            ok = ok & (diff < window)
        return ok.unsqueeze(1)

    def is_plain(self, window: int | None) -> bool:
        """True when plain causal attention over the whole row is exact (one document, no padding)."""
        return self.single_segment and (window is None or window >= self.seq_len)


def single_segment(segment_ids_host: torch.Tensor) -> bool:
    return bool((segment_ids_host == segment_ids_host[:, :1]).all()) and bool((segment_ids_host[:, 0] != PAD_SEGMENT).all())


def build_attention_context(segment_ids: torch.Tensor, topology: Topology) -> AttentionContext:
    """``segment_ids`` (B, S) of the whole rows, on the CPU (decisions are made there) or the device."""
    host = segment_ids.cpu()
    return AttentionContext(segment_ids=segment_ids.to(topology.device), segment_ids_host=host,
                            single_segment=single_segment(host), setup=CPSetup.from_topology(topology))


# ------------------------------------------------------------------------------------------------
# The attention function transformers calls
# ------------------------------------------------------------------------------------------------


def ndparallel_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    *,
    setup: CPSetup,
    **kwargs,
):
    """transformers' attention signature: q (B, H, L, D), k/v (B, Hkv, L, D) -> ((B, L, H, D), None)."""
    segments = kwargs.pop(SEGMENTS_KWARG, None)
    segments_host = kwargs.pop(SEGMENTS_HOST_KWARG, None)
    single = kwargs.pop(SINGLE_KWARG, False)
    if segments is None:
        if setup.cp_size > 1:
            raise ConfigError("the model is context-parallel: call it with the inputs of ndparallel.prepare_batch "
                              "(batch.model_inputs()), which carry this rank's sequence chunks and their segments")
        # A batch without packing or padding (or a call outside ndparallel's batches): exactly transformers'
        # own SDPA path, with the mask transformers built.
        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, scaling=scaling,
                                               dropout=dropout, **kwargs)
    if dropout:
        raise ConfigError(
            f"attention dropout {dropout} is not supported with packed/padded or context-parallel batches; "
            f"set the model's attention_dropout to 0"
        )
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    context = AttentionContext(segment_ids=segments, segment_ids_host=segments_host, single_segment=single,
                               setup=setup)
    out = _context_attention(query, key, value, context, scale, kwargs.get("sliding_window"))
    return out.transpose(1, 2).contiguous(), None


@torch.compiler.disable
def _context_attention(query, key, value, context, scale, window):
    # Outside compiled graphs: collectives, custom autograd and host-side decisions (a graph break).
    from ndparallel.parallel.cp_attention import context_attention

    return context_attention(query, key, value, context, scale=scale, window=window)


# Batches without ndparallel segments get transformers' usual SDPA mask (padding, sliding window).
AttentionMaskInterface.register(ATTENTION_NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


def apply_context_parallel(model: nn.Module, topology: Topology) -> None:
    """Route the model's attention through ndparallel (exact for packed/padded rows, CP when cp > 1).

    The attention function is bound to this topology's cp group and registered under a name of its
    own, which the model's config then selects.
    """
    setup = CPSetup.from_topology(topology)
    group = setup.cp_group.group_name if setup.cp_group is not None else "local"
    name = f"{ATTENTION_NAME}-{group}"
    AttentionInterface.register(name, functools.partial(ndparallel_attention, setup=setup))
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    model.set_attn_implementation(name)
