"""Context parallelism's entry point: the attention function transformers calls, and how it is installed.

Which tokens may attend to which is described by the segment id of every token of the whole rows
(``sequence.segment_ids_from``): a query sees the keys of its own segment at or before it. Padding is a
segment of its own: its queries still see themselves (no empty softmax rows), and no real token sees it.
Every CP rank of a group holds the same rows, so this needs no communication.

The model's attention is switched, through transformers' ``AttentionInterface``, to an ndparallel
function bound to the topology's cp group (``CPSetup``: static for the run). Per batch, the host segment
ids travel as plain keyword arguments (``ndp_segments_host``, ``ndp_single_segment``) that transformers
passes through to the attention function: no globals, no patching, and nothing per-batch that
``torch.compile`` would guard on by identity. The attention plan derived from them is cached on that
tensor (``attention/plan.cached_plan``) and goes away with the batch.

transformers builds no attention mask for our batches: the mask function registered for our attention
returns None unless the caller passed its own padding mask or decodes with a KV cache (plain calls,
handled exactly as transformers' SDPA would). A batch of whole rows (one document each) passes
``full_rows_mask``, an all-ones padding mask the mask function recognizes: without any mask, transformers
looks for packed documents in the position ids first, and that check waits for the GPU (a ``.all()``
read back to the host, ~2 ms of idle GPU a step on an H200). Packed rows keep that check: it is what
makes an eager-attention fallback exact for them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ndparallel.errors import ConfigError, ModelError
from ndparallel.mesh.topology import Topology
from ndparallel.parallel.attention.cp_methods import context_attention
from ndparallel.parallel.sequence import segment_ids_from, single_segment

ATTENTION_NAME = "ndparallel"
_SEGMENTS_HOST_KWARG, _SINGLE_KWARG = "ndp_segments_host", "ndp_single_segment"


@dataclass(frozen=True)
class CPSetup:
    """The static part of attention for a run: this rank's place in the cp group, and the method."""

    cp: int
    cp_rank: int
    method: str
    cp_group: dist.ProcessGroup | None

    @classmethod
    def from_topology(cls, topology: Topology) -> "CPSetup":
        layout = topology.layout
        return cls(
            cp=layout.cp,
            cp_rank=topology.cp_rank,
            method=layout.cp_comm_strategy,
            cp_group=topology.cp.get_group() if layout.cp > 1 else None,
        )


@dataclass(frozen=True)
class AttentionContext:
    """What attention needs to know about one micro-batch beyond q, k and v.

    ``segment_ids_host`` covers the whole (padded) rows, (B, S), on the CPU: every decision about which
    keys a query sees is made there, so none waits for the device. The local tokens are the cp rank's
    two chunks.
    """

    segment_ids_host: torch.Tensor
    single_segment: bool
    """Every row is one document with no padding: plain causal attention is exact."""
    setup: CPSetup

    @property
    def cp(self) -> int:
        return self.setup.cp

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
    def batch_size(self) -> int:
        return self.segment_ids_host.shape[0]

    @property
    def seq_len(self) -> int:
        return self.segment_ids_host.shape[1]

    @property
    def chunk_len(self) -> int:
        return self.seq_len // (2 * self.cp)

    def is_plain(self, window: int | None) -> bool:
        """True when plain causal attention over the whole row is exact (one document, no padding)."""
        return self.single_segment and (window is None or window >= self.seq_len)


def attention_inputs(
    input_ids: torch.Tensor, *, single_segment: bool, segments_host: torch.Tensor | None
) -> dict[str, Any]:
    """What a prepared batch passes to the model for this attention, beside its ids and positions: the
    one-document flag always (a Python bool: compiled layers guard on it, no host work per layer); the host
    segment ids only when attention needs a plan (packed or padded rows, or cp > 1); and for whole rows
    ``full_rows_mask``, which tells transformers there is no padding, so it skips a device sync."""
    inputs: dict[str, Any] = {_SINGLE_KWARG: single_segment}
    if segments_host is not None:
        inputs[_SEGMENTS_HOST_KWARG] = segments_host
    if single_segment:
        inputs["attention_mask"] = full_rows_mask(*input_ids.shape, input_ids.device)
    return inputs


def build_attention_context(segment_ids: torch.Tensor, topology: Topology) -> AttentionContext:
    """``segment_ids`` (B, S) of the whole rows (any device; decisions are made on the host)."""
    host = segment_ids.cpu()
    return AttentionContext(
        segment_ids_host=host, single_segment=single_segment(host), setup=CPSetup.from_topology(topology)
    )


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
    segments_host = kwargs.pop(_SEGMENTS_HOST_KWARG, None)
    single = kwargs.pop(_SINGLE_KWARG, None)
    if kwargs.get("softcap") is not None:
        raise ModelError(
            f"attention logit soft-capping (attn_logit_softcapping={kwargs['softcap']}) is not "
            f"supported by ndparallel's fused attention kernels; use a model config without it"
        )
    if segments_host is None and setup.cp > 1:
        raise ConfigError(
            "the model is context-parallel: call it with the inputs of ndparallel.prepare_batch "
            "(batch.model_inputs()), which carry this rank's sequence chunks and their segments"
        )
    if single is None:  # not ndparallel's batch: a plain call
        if attention_mask is not None or query.shape[2] != key.shape[2]:
            # The caller's own padding mask, or decoding with a KV cache: exactly transformers' SDPA path
            # (with the mask transformers built for it).
            return ALL_ATTENTION_FUNCTIONS["sdpa"](
                module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
            )
        segments_host = _segments_of_plain_call(kwargs.get("position_ids"), query)  # host work: plain calls only
        single = single_segment(segments_host)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    window = kwargs.get("sliding_window")
    sinks = kwargs.get("s_aux")
    if setup.cp == 1 and sinks is None and single and (window is None or window >= query.shape[2]):
        # One document per row, no padding: plain causal attention (cuDNN / flash kernels). A prepared batch
        # says so in a flag, so nothing here touches the host and the layer stays one compiled graph.
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, is_causal=True, dropout_p=dropout, scale=scale, enable_gqa=key.shape[1] != query.shape[1]
        )
        return out.transpose(1, 2), None
    if dropout:
        raise ConfigError(
            f"attention dropout {dropout} is not supported with packed/padded or context-parallel batches; "
            f"set the model's attention_dropout to 0"
        )
    return _context_attention(query, key, value, segments_host, single, setup, scale, window, sinks), None


def _segments_of_plain_call(position_ids: torch.Tensor | None, query: torch.Tensor) -> torch.Tensor:
    """A call without ndparallel's batch inputs: documents from the position ids (restarting at 0)."""
    batch, seq = query.shape[0], query.shape[2]
    if position_ids is None:
        return torch.zeros(batch, seq, dtype=torch.long)
    return segment_ids_from(position_ids.expand(batch, -1).cpu(), None)


@functools.lru_cache(maxsize=16)
def _single_document_rows(batch: int, seq: int) -> torch.Tensor:
    """Segment ids of rows that are one document each: one tensor per shape, so its plans are cached."""
    return torch.zeros(batch, seq, dtype=torch.long)


@torch.compiler.disable
def _context_attention(query, key, value, segments_host, single, setup, scale, window, sinks):
    # Outside compiled graphs: collectives, custom autograd and host-side planning (a graph break).
    if segments_host is None:  # a prepared batch of one document per row, at cp 1 (windows or sinks need a plan)
        segments_host = _single_document_rows(query.shape[0], query.shape[2])
    context = AttentionContext(segment_ids_host=segments_host, single_segment=single, setup=setup)
    if sinks is not None and hasattr(sinks, "to_local"):
        sinks = sinks.to_local()  # a tensor-parallel model holds its heads' sinks
    return context_attention(query, key, value, context, scale=scale, window=window, sinks=sinks)


_FULL_ROWS: dict[tuple, torch.Tensor] = {}
_FULL_ROWS_KEPT = 16  # shapes; a run has one or two


def full_rows_mask(batch: int, seq: int, device: torch.device) -> torch.Tensor:
    """The padding mask of ``batch`` whole rows of ``seq`` tokens (all ones), one tensor per shape and device:
    ``_mask_unless_padding`` knows it by identity and builds nothing for it."""
    key = (batch, seq, torch.device(device))
    mask = _FULL_ROWS.get(key)
    if mask is None:
        if len(_FULL_ROWS) >= _FULL_ROWS_KEPT:
            _FULL_ROWS.clear()
        mask = _FULL_ROWS[key] = torch.ones(batch, seq, dtype=torch.bool, device=device)
    return mask


def _is_full_rows_mask(mask) -> bool:
    """``mask`` is a tensor ``full_rows_mask`` made (looked up, never made here: a caller's masks of other
    shapes must not allocate anything)."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        return False
    return _FULL_ROWS.get((mask.shape[0], mask.shape[1], mask.device)) is mask


def _mask_unless_padding(**kwargs):
    """transformers' mask for our attention: none for a batch of whole rows without a 2-D padding mask
    (ndparallel's batches: the attention plans from their segment ids) or with ``full_rows_mask``;
    transformers' SDPA mask when a plain call passes its own padding mask or decodes with a KV cache."""
    square = kwargs.get("q_length") == kwargs.get("kv_length") and not kwargs.get("kv_offset")
    mask = kwargs.get("attention_mask")
    if square and (mask is None or _is_full_rows_mask(mask)):
        return None
    return ALL_MASK_ATTENTION_FUNCTIONS["sdpa"](**kwargs)


def apply_context_parallel(model: nn.Module, topology: Topology) -> None:
    """Route the model's attention through ndparallel (exact for packed/padded rows, CP when cp > 1).

    The attention function is bound to this topology's cp group and registered (transformers' registry is
    the only way a model selects an attention function) under a name of its own, which the model's
    config then selects. The registered function holds only the static ``CPSetup``.
    """
    setup = CPSetup.from_topology(topology)
    group = setup.cp_group.group_name if setup.cp_group is not None else "local"
    name = f"{ATTENTION_NAME}-{group}"
    AttentionInterface.register(name, functools.partial(ndparallel_attention, setup=setup))
    AttentionMaskInterface.register(name, _mask_unless_padding)
    model.set_attn_implementation(name)
