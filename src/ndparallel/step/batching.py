"""From a global batch to this rank's micro-batch.

Every rank receives the same global batch (B rows of S tokens) and keeps its part:
1. rows: the ``batch`` rank b of N keeps rows [b*B/N, (b+1)*B/N); cp and tp peers keep the same rows;
2. labels are shifted here, once, on the full row (label t is the token t+1), so sharding the
   sequence never separates a token from its target; a document's last token predicts nothing;
3. rows are padded to a multiple of 2*cp*tp (padding is ignored by the loss and attended by nothing);
4. the sequence is split over cp, load-balanced (``parallel/context.py``).

Loss normalisation needs the number of target tokens over all data ranks; ``count_tokens`` in
``token_loss.py`` sums it over the ``loss`` view.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ndparallel.errors import ConfigError
from ndparallel.loss.cross_entropy import IGNORE_INDEX
from ndparallel.mesh.topology import Topology
from ndparallel.parallel.context import attention_inputs
from ndparallel.parallel.sequence import cp_shard, segment_ids_from, single_segment


@dataclass
class Batch:
    """One rank's micro-batch. ``labels`` are already shifted: ``labels[:, t]`` is the target of token t."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    segments_host: torch.Tensor | None
    """Document id of every token of the whole (padded) rows, (B, S) on the host (attention plans from it
    once per batch); None when plain causal attention is exact and no context parallelism needs them."""
    single_segment: bool
    num_input_tokens: torch.Tensor
    """Real (non-padding) input tokens in this rank's part, for throughput (a host scalar tensor)."""
    input_ids_host: torch.Tensor | None = None
    """``input_ids`` in host memory (where the rows came from), for an input embedding kept there
    (``parallel/host_embedding.embed_inputs``); None when the rows came from the device."""

    def model_inputs(self) -> dict[str, Any]:
        """Keyword arguments for the model's forward."""
        # use_cache=False: training needs no KV cache, and one would grow again when checkpointed layers
        # are recomputed in backward.
        inputs: dict[str, Any] = {"input_ids": self.input_ids, "position_ids": self.position_ids, "use_cache": False}
        inputs.update(
            attention_inputs(self.input_ids, single_segment=self.single_segment, segments_host=self.segments_host)
        )
        return inputs

    @property
    def num_tokens(self) -> torch.Tensor:
        """Target tokens in this rank's part (a tensor: no host sync)."""
        return (self.labels != IGNORE_INDEX).sum()


def shift_labels(labels: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Target of each token: the next token's label; -100 at the row's end and at document ends."""
    shifted = torch.full_like(labels, IGNORE_INDEX)
    shifted[:, :-1] = labels[:, 1:]
    if position_ids is not None:
        starts_next = torch.zeros_like(labels, dtype=torch.bool)
        starts_next[:, :-1] = position_ids[:, 1:] == 0
        shifted = shifted.masked_fill(starts_next, IGNORE_INDEX)
    return shifted


def prepare_batch(
    input_ids: torch.Tensor,
    topology: Topology,
    *,
    labels: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    pad_token_id: int = 0,
    local: bool = False,
) -> Batch:
    """This rank's micro-batch of a global batch (``input_ids`` (B, S), the same on every rank).

    ``local=True``: the rows given are already this data rank's (a sampler picked them); only the
    sequence is split.

    ``labels`` follow transformers' convention (unshifted, -100 = ignore; default: the input ids);
    ``attention_mask`` marks real tokens with 1; ``position_ids`` restarting at 0 mark packed documents.
    """
    layout = topology.layout
    if input_ids.dim() != 2:
        raise ConfigError(f"input_ids must be (batch, sequence), got shape {tuple(input_ids.shape)}")
    rows = input_ids.shape[0]
    if not local and rows % layout.batch_size:
        raise ConfigError(
            f"the global batch has {rows} rows, which do not split over dp_replicate x dp_shard = "
            f"{layout.batch_size} data-parallel ranks; use a multiple of {layout.batch_size} rows"
        )
    columns = _whole_rows(input_ids, labels, attention_mask, position_ids)  # input ids, targets, positions, segments
    if not local:
        per_rank = rows // layout.batch_size
        mine = slice(topology.batch_rank * per_rank, (topology.batch_rank + 1) * per_rank)
        columns = [t[mine] for t in columns]
    extra = (-input_ids.shape[1]) % layout.seq_multiple
    if extra:
        columns = [_pad(t, extra, value) for t, value in zip(columns, (pad_token_id, IGNORE_INDEX, 0, -1))]
    input_ids, targets, position_ids, segments = columns

    # Decide on the host (the trainer's rows are on the CPU): no device sync in the step.
    segments_host = segments.cpu()
    single = single_segment(segments_host)
    ids_host = input_ids if input_ids.device.type == "cpu" else None
    input_ids, targets, position_ids = (_to_device(t, topology.device) for t in (input_ids, targets, position_ids))
    needs_segments = layout.cp > 1 or not single
    shard = dict(cp=layout.cp, cp_rank=topology.cp_rank)
    return Batch(
        input_ids_host=None if ids_host is None else cp_shard(ids_host, **shard),
        input_ids=cp_shard(input_ids, **shard),
        labels=cp_shard(targets, **shard),
        position_ids=cp_shard(position_ids, **shard),
        segments_host=segments_host if needs_segments else None,
        single_segment=single,
        num_input_tokens=(cp_shard(segments_host, **shard) != -1).sum(),
    )


def _whole_rows(
    input_ids: torch.Tensor,
    labels: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
) -> list[torch.Tensor]:
    """[input ids, shifted targets, position ids, segment ids] of the whole rows, defaults filled in."""
    padding = None if attention_mask is None else attention_mask == 0
    if labels is None:
        labels = input_ids
    if padding is not None:
        labels = labels.masked_fill(padding, IGNORE_INDEX)
    if position_ids is None:
        seq = torch.arange(input_ids.shape[1], device=input_ids.device)
        position_ids = (
            seq.expand_as(input_ids) if padding is None else (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        )
    return [input_ids, shift_labels(labels, position_ids), position_ids, segment_ids_from(position_ids, padding)]


def _to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cuda" and x.device.type == "cpu":
        return x.contiguous().pin_memory().to(device, non_blocking=True)  # overlaps the copy with queued work
    return x.to(device)


def _pad(x: torch.Tensor, extra: int, value: int) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, extra), value=value)
