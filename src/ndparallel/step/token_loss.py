"""The loss of a step, as a user's own loop calls it: the global token count, this rank's share of the
token-weighted loss (fused with lm_head, or from logits), and the reductions for logging and checks.

Loss normalisation: the loss of a step is (sum of token losses over every data rank and micro-batch) /
(number of target tokens over every data rank and micro-batch). Each rank backpropagates its own
sum / global count and FSDP sums gradients over the data ranks, so loss and gradients equal the
single-process ones whatever the padding, packing, micro-batching or layout.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ndparallel.loss.cross_entropy import cross_entropy_sum, vocab_offset
from ndparallel.loss.fused import linear_cross_entropy_sum
from ndparallel.loss.head import loss_head_of
from ndparallel.mesh.topology import Topology
from ndparallel.parallel.sequence import cp_gather


def count_tokens(local_count: torch.Tensor | int, topology: Topology) -> torch.Tensor:
    """Global number of target tokens: ``local_count`` summed over the ``loss`` view (one all-reduce)."""
    total = torch.as_tensor(local_count, device=topology.device, dtype=torch.float32).clone()
    dist.all_reduce(total, group=topology.loss.get_group())
    return total


def token_loss(
    logits: torch.Tensor, labels: torch.Tensor, *, num_tokens: torch.Tensor, topology: Topology, compiled: bool = False
) -> torch.Tensor:
    """This rank's share of the step loss: its token-loss sum / the global token count.

    ``logits`` are the model's (B, L, V) — or (B, L, V/tp) under tensor parallelism, vocabulary-split.
    Summed over the ``loss`` view, the shares give the step loss. ``compiled``: fuse the loss kernels
    with torch.compile (GPU).
    """
    if topology.layout.tp > 1:
        group = topology.tp.get_group()
        start = vocab_offset(logits.shape[-1], group, topology.tp_rank, logits.device)
        total = cross_entropy_sum(logits, labels, tp_group=group, vocab_start=start, compiled=compiled)
    else:
        total = cross_entropy_sum(logits, labels, compiled=compiled)
    return total / num_tokens.clamp(min=1)


def model_loss(
    model: nn.Module,
    inputs: dict,
    labels: torch.Tensor,
    *,
    num_tokens: torch.Tensor,
    topology: Topology,
    compiled: bool = False,
):
    """Run ``model`` on ``inputs`` and return (this rank's share of the step loss, the model's outputs).

    With a ``LossHead`` (``parallelize``'s default) the logits are never made: the head hands its input to
    the fused linear + cross-entropy (``loss/fused.py``) and ``outputs.logits`` is empty. Otherwise the
    model's logits go through ``token_loss``. Either way the share is (sum of token losses) / ``num_tokens``.
    """
    head = loss_head_of(model)
    if head is None:
        outputs = model(**inputs)
        return token_loss(outputs.logits, labels, num_tokens=num_tokens, topology=topology, compiled=compiled), outputs
    with head.capture() as captured:
        outputs = model(**inputs)
    (hidden,) = captured
    total = linear_cross_entropy_sum(
        hidden,
        head.local_weight(),
        labels,
        bias=head.local_bias(),
        transform=head.transform,
        tp_group=topology.tp.get_group() if topology.layout.tp > 1 else None,
        vocab_start=head.vocab_start,
        kernels=compiled,
    )
    total = total + outputs.logits.sum()  # exactly 0: ties the model's output into the loss (loss/head.py)
    return total / num_tokens.clamp(min=1), outputs


def gather_logits(logits: torch.Tensor, topology: Topology) -> torch.Tensor:
    """Full (B, S, V) logits of this rank's rows from vocabulary- (tp) and sequence- (cp) split parts.

    For checks and debugging: it materializes what parallelism avoids materializing. A collective.
    """
    if topology.layout.tp > 1:
        # The last vocabulary slice may be narrower (torch.chunk split): pad to the widest, trim after.
        group = topology.tp.get_group()
        widths = [torch.zeros((), dtype=torch.long, device=logits.device) for _ in range(topology.layout.tp)]
        dist.all_gather(widths, torch.tensor(logits.shape[-1], device=logits.device), group=group)
        widest = int(max(widths))
        padded = torch.nn.functional.pad(logits, (0, widest - logits.shape[-1])).contiguous()
        parts = [torch.empty_like(padded) for _ in widths]
        dist.all_gather(parts, padded, group=group)
        logits = torch.cat([part[..., : int(w)] for part, w in zip(parts, widths)], dim=-1)
    return cp_gather(logits, topology, dim=1)


def reduce_loss(local_share: torch.Tensor, topology: Topology) -> torch.Tensor:
    """The step loss from the ranks' shares (for logging; this is a collective)."""
    total = local_share.detach().clone()
    dist.all_reduce(total, group=topology.loss.get_group())
    return total
