"""Evaluation: the token-weighted loss over every held-out row, on every layout."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ndparallel.loss.cross_entropy import IGNORE_INDEX
from ndparallel.mesh.topology import Topology
from ndparallel.parallel.host_embedding import embed_inputs
from ndparallel.step.batching import prepare_batch
from ndparallel.step.token_loss import model_loss


@torch.no_grad()
def evaluate(model, rows, topo: Topology, micro_batch_size: int, pad_id: int) -> float:
    """Token-weighted loss over every eval row. Every data rank runs the same number of forwards (FSDP
    gathers are collectives); ranks short of rows repeat a row with its labels ignored."""
    model.eval()
    ranks, me = topo.layout.batch_size, topo.batch_rank
    per_step = ranks * micro_batch_size
    steps = max(1, math.ceil(len(rows) / per_step))
    total = torch.zeros((), device=topo.device, dtype=torch.float64)
    count = torch.zeros((), device=topo.device, dtype=torch.float64)
    for s in range(steps):
        idx = [s * per_step + me * micro_batch_size + i for i in range(micro_batch_size)]
        valid = [i < len(rows) for i in idx]
        data = rows.batch([i if ok else 0 for i, ok in zip(idx, valid)])
        for r, ok in enumerate(valid):
            if not ok:
                data["labels"][r] = IGNORE_INDEX
        batch = prepare_batch(**data, topology=topo, local=True, pad_token_id=pad_id)
        one = torch.ones((), device=topo.device)
        inputs = embed_inputs(model, batch.model_inputs(), batch.input_ids_host)
        total += model_loss(model, inputs, batch.labels, num_tokens=one, topology=topo)[0].double()
        count += batch.num_tokens.double()
    dist.all_reduce(total, group=topo.loss.get_group())
    dist.all_reduce(count, group=topo.loss.get_group())
    model.train()
    return float(total / count.clamp(min=1))
