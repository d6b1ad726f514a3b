"""The router's load-balancing loss of mixture-of-experts models, exact on every layout.

transformers adds ``router_aux_loss_coef * aux`` to the loss when the config's ``output_router_logits`` is
true, with Switch Transformer's loss pooled over the MoE layers and the real (non-padding) tokens:

    aux = E * sum_e f_e * P_e,   f_e = (top-k picks of expert e) / R,   P_e = (sum of p_e over rows) / R

where p = softmax(router logits) per row, a row is one (MoE layer, real token), R counts the rows and E is
the number of experts. f and P are means over the micro-batch's rows, and their product is not a sum over
tokens, so each rank's own aux would not add up to the one-process value. Here, per micro-batch:

1. every rank sums its picks per expert and its rows (no gradient flows through f);
2. one all-reduce of those E + 1 numbers over all ranks gives the global f (every rank of the world holds
   different tokens of the MoE blocks: under tp each rank routes its own slice of the sequence);
3. each rank's share is E * sum_e f_e * (its own sum of p_e) / R, with the global R: the shares add up
   to aux exactly, and so do their gradients (FSDP sums gradients over the data ranks).

Under tp the shares of a tp group are summed over tp in forward (identity in backward), so that, like the
token loss, each rank's share summed over the ``loss`` view is the step's value. With gradient
accumulation each micro-batch's aux is computed over that micro-batch's global rows (what one process
sees when it runs the same global micro-batch) and the step's aux is their mean: the loss this adds is
``coef * mean over micro-batches of aux``. The softmax is taken in float32.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ndparallel.mesh.topology import Topology
from ndparallel.models.moe import moe_facts
from ndparallel.parallel.sequence import PAD_SEGMENT, rank_tokens
from ndparallel.step.batching import Batch


def router_aux_loss(outputs, batch: Batch, *, config, topology: Topology, num_micro_batches: int = 1) -> torch.Tensor:
    """This rank's share of ``router_aux_loss_coef * aux`` for one micro-batch (add it to ``token_loss``).

    ``outputs``: the model's output (its ``router_logits``: one (tokens, E) tensor per MoE layer, present when
    ``config.output_router_logits`` is true). Zero for dense models and when the config asks for no aux loss.
    A collective over all ranks when there are router logits.
    """
    facts = moe_facts(config)
    logits = getattr(outputs, "router_logits", None)
    if facts is None or facts.aux_loss_coef == 0.0 or not logits:
        return torch.zeros((), device=topology.device)
    real = local_token_mask(batch, topology).to(logits[0].device)
    picks, probs = _expert_sums(logits, real, facts.top_k, facts.num_experts)
    counts = torch.cat([picks, (real.sum() * len(logits)).reshape(1)])
    dist.all_reduce(counts)  # every rank: picks per expert and rows of the whole micro-batch
    picks, rows = counts[:-1], counts[-1].clamp(min=1)
    share = facts.num_experts * torch.sum(picks / rows * probs / rows)
    share = share * (facts.aux_loss_coef / num_micro_batches)
    if topology.layout.tp > 1:
        share = _SumOverGroup.apply(share, topology.tp.get_group())
    return share


def local_token_mask(batch: Batch, topology: Topology) -> torch.Tensor:
    """1.0 for each real token this rank routes, 0.0 for padding, flattened as the router sees them: the rows'
    cp chunks, and under tp this rank's slice of them (B * S_local)."""
    layout = topology.layout
    tp = dict(tp=layout.tp, tp_rank=topology.tp_rank)
    if batch.segments_host is None:  # one document per row, no padding: every token of the cp part is real
        return rank_tokens(torch.ones_like(batch.input_ids, dtype=torch.float32), cp=1, cp_rank=0, **tp).reshape(-1)
    # decided on the host, as attention is; a small copy (one float per local token)
    local = rank_tokens(batch.segments_host, cp=layout.cp, cp_rank=topology.cp_rank, **tp)
    return (local != PAD_SEGMENT).float().to(batch.input_ids.device, non_blocking=True).reshape(-1)


def _expert_sums(
    logits: tuple[torch.Tensor, ...], real: torch.Tensor, top_k: int, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(top-k picks per expert, summed router probabilities per expert) over layers and real tokens."""
    picks = torch.zeros(num_experts, device=real.device)
    probs = torch.zeros(num_experts, device=real.device)
    for layer_logits in logits:
        p = torch.softmax(layer_logits.float(), dim=-1)  # (tokens, E)
        chosen = torch.topk(p, top_k, dim=-1).indices.reshape(-1)
        picks = picks.scatter_add(0, chosen, real.repeat_interleave(top_k))
        probs = probs + (p * real[:, None]).sum(dim=0)
    return picks.detach(), probs


class _SumOverGroup(torch.autograd.Function):
    """Forward: the sum over ``group``. Backward: the gradient as is (each rank keeps its own share's)."""

    @staticmethod
    def forward(ctx, x, group):
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None
