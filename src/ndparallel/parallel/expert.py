"""Expert parallelism, and the place of mixture-of-experts blocks on every other axis.

Experts over ep ranks. The ``ep`` ranks of ``topology.experts`` (borrowed from dp_shard x cp x tp) each
hold num_experts / ep consecutive experts: every 3-D expert weight becomes a DTensor ``Shard(0)`` over
``ep``, and FSDP shards it further over ``experts_dp`` (the ranks holding the same experts; their
gradients are summed there). A block's forward, on each rank with T tokens routed to k experts each:

    dispatch   sort the T*k (token, expert) pairs by expert, i.e. by the rank that owns it; exchange the
               per-expert counts (one all-to-all of E integers), then the rows (all-to-all, variable sizes)
    compute    the rows received, regrouped by local expert, through this rank's experts (moe_experts.py)
    combine    the reverse all-to-all; each token's k outputs, weighted by the router, summed

Both all-to-alls are autograd functions whose backward is the reverse exchange, so gradients of the
tokens and of the router weights come back to the rank that routed them. With ep == 1 there is no
exchange. The router and any shared experts stay with their block, on every rank (FSDP-sharded).

Tensor parallelism does not split MoE blocks: between the sequence-parallel norms each tp rank holds its
own slice of the sequence, and runs the block on it (its weights FSDP-sharded over dp_shard x cp x tp,
``topology.experts.tokens``, so their gradients are summed over tp as well). That is why ep can borrow
tp ranks. gpt-oss' per-head attention sinks are split over tp like the heads.

transformers calls the experts through its ``ExpertsInterface``; the function here is registered under a
name bound to this run's ep group, and the model's config selects it (no patching).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from ndparallel.mesh.topology import Topology
from ndparallel.models.decoder import DecoderParts
from ndparallel.models.moe import expert_parameters, moe_blocks, num_experts_of
from ndparallel.models.moe_experts import ExpertSetup, inverse_permutation, register_experts, run_experts
from ndparallel.parallel.comm import all_to_all


@torch.compiler.disable  # outside compiled graphs: collectives, a host sync and data-dependent sizes
def _exchange_and_run(experts: nn.Module, rows: torch.Tensor, counts: torch.Tensor, setup: ExpertSetup) -> torch.Tensor:
    """The rows (grouped by expert) sent to the ep ranks holding their experts, run there, and sent back."""
    ep, local_experts, group = setup.ep_size, setup.num_experts // setup.ep_size, setup.ep_group
    received = torch.empty_like(counts)  # [source rank][local expert]: rows each peer sends to my experts
    dist.all_to_all_single(received, counts, group=group)
    both = torch.stack([counts, received]).cpu().view(2, ep, local_experts)  # the step's one host sync
    send, recv = both[0].sum(1).tolist(), both[1].sum(1).tolist()
    arrived = all_to_all(rows, group, send=send, recv=recv)  # grouped by (source rank, local expert)
    expert_of_row = torch.repeat_interleave(torch.arange(local_experts).repeat(ep), both[1].reshape(-1))
    regroup = torch.argsort(expert_of_row, stable=True).to(rows.device)
    out = run_experts(experts, arrived.index_select(0, regroup), both[1].sum(0))
    out = out.index_select(0, inverse_permutation(regroup))  # back to (source rank, local expert) order
    return all_to_all(out, group, send=recv, recv=send)


def apply_expert_parallel(parts: DecoderParts, topology: Topology) -> None:
    """Split the experts over ep (a no-op but for the experts function when ep == 1, or for a dense model)."""
    blocks = moe_blocks(parts.layers)
    if not blocks:
        return
    ep = topology.layout.ep
    setup, group_name = ExpertSetup(num_experts_of(parts.model.config)), "local"
    if ep > 1:
        mesh = topology.experts.ep
        group, group_name = mesh.get_group(), mesh.get_group().group_name
        for block in blocks:
            shard_experts(block.experts, mesh)
        setup = ExpertSetup(setup.num_experts, ep_size=ep, ep_group=group, exchange=_exchange_and_run)
    register_experts(parts.model, setup, group_name)


def shard_experts(experts: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Every stacked expert tensor (experts first) -> DTensor Shard(0) over ep; each rank keeps its slice only."""
    for name, param in expert_parameters(experts):
        if not isinstance(param, DTensor):
            sharded = distribute_tensor(param.data, ep_mesh, [Shard(0)], src_data_rank=None)
            setattr(experts, name, nn.Parameter(sharded, requires_grad=param.requires_grad))


# ------------------------------------------------------------------------------------------------
# Tensor parallelism around MoE blocks, and their FSDP units
# ------------------------------------------------------------------------------------------------


def apply_moe_tensor_parallel(parts: DecoderParts, tp_mesh: DeviceMesh) -> None:
    """Under tp, run every layer's MLP (MoE block or dense) on the rank's own sequence slice, unsplit, and split
    attention sinks over the heads. Call after ``apply_tensor_parallel`` on a MoE model."""
    if tp_mesh.size() == 1 or not moe_blocks(parts.layers):
        return
    token_local = _TokenLocal(tp_mesh)
    for layer in parts.layers:
        layer.mlp.register_forward_pre_hook(token_local.enter)
        layer.mlp.register_forward_hook(token_local.leave)
        attention = getattr(layer, "self_attn", None)
        sinks = getattr(attention, "sinks", None)
        if isinstance(sinks, nn.Parameter) and not isinstance(sinks, DTensor):
            split = distribute_tensor(sinks.data, tp_mesh, [Shard(0)], src_data_rank=None)  # (heads,) like q_proj
            attention.sinks = nn.Parameter(split, requires_grad=sinks.requires_grad)


class _TokenLocal:
    """Forward hooks that run a block on this tp rank's slice of the sequence."""

    def __init__(self, tp_mesh: DeviceMesh) -> None:
        self.mesh = tp_mesh

    def enter(self, module: nn.Module, args: tuple) -> tuple:
        # (B, S, H) Shard(1) over tp -> this rank's (B, S/tp, H); its gradient returns sequence-sharded.
        if isinstance(args[0], DTensor):
            args = (args[0].to_local(grad_placements=[Shard(1)]), *args[1:])
        return args

    def leave(self, module: nn.Module, args: tuple, output):
        # (B, S/tp, H) -> the Shard(1) DTensor the residual add expects (gpt-oss' block returns a pair).
        first = output[0] if isinstance(output, tuple) else output
        if isinstance(first, DTensor):
            return output
        wrapped = DTensor.from_local(first, self.mesh, [Shard(1)], run_check=False)
        return (wrapped, *output[1:]) if isinstance(output, tuple) else wrapped


def moe_fsdp_units(parts: DecoderParts, topology: Topology) -> list[tuple[nn.Module, DeviceMesh]]:
    """FSDP units that must shard on another mesh than the layers, innermost first: the experts over
    ``experts_dp`` when ep > 1, every layer's MLP over ``tokens`` when tp > 1 (its ranks hold different tokens)."""
    blocks = moe_blocks(parts.layers)
    if not blocks:
        return []
    layout = topology.layout
    units: list[tuple[nn.Module, DeviceMesh]] = []
    if layout.ep > 1:
        units += [(block.experts, topology.experts.experts_dp) for block in blocks]
    if layout.tp > 1:
        units += [(layer.mlp, topology.experts.tokens) for layer in parts.layers]
    return units
