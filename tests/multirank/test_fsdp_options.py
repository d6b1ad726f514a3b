"""FSDP knobs do what they say: the shard size FSDP really keeps between forward and backward."""

from __future__ import annotations

import pytest
import torch
from support.scenarios import make_model
from torch.distributed.tensor import DTensor

import ndparallel as ndp
from ndparallel.testing.ranks import RankFailure, run_ranks


def _rows_held_after_forward(layout: dict, reshard) -> tuple[int, list[int]]:
    """q_proj rows of each layer that this rank holds between forward and backward (full rows: 64)."""
    topo = ndp.Topology.build(ndp.ParallelismConfig(**layout))
    model = make_model("llama")
    full_rows = model.model.layers[0].self_attn.q_proj.weight.shape[0]
    ndp.parallelize(model, topo, options=ndp.ParallelOptions(param_dtype=None, reshard_after_forward=reshard))
    batch = ndp.prepare_batch(torch.randint(1, 256, (4, 16), generator=torch.Generator().manual_seed(0)), topo)
    logits = model(**batch.model_inputs()).logits
    held = []
    for layer in model.model.layers:
        weight = layer.self_attn.q_proj.weight
        held.append((weight.to_local() if isinstance(weight, DTensor) else weight).shape[0])
    logits.float().pow(2).mean().backward()  # and backward still runs from that state
    return full_rows, held


@pytest.mark.parametrize("reshard, first_layer_share", [(2, 2), (True, 4), (False, 1)])
def test_reshard_after_forward_keeps_the_asked_shard_size(reshard, first_layer_share):
    """Over 4 FSDP ranks, N=2 keeps each gathered layer sharded over 2 ranks (half its rows per rank);
    true keeps 1/4; false keeps it whole. The last layer stays gathered (backward starts there)."""
    for full_rows, held in run_ranks(4, _rows_held_after_forward, {"dp_shard_size": 4}, reshard):
        assert held == [full_rows // first_layer_share, full_rows], held


def test_reshard_to_a_subgroup_with_tensor_parallel_is_one_clear_error():
    with pytest.raises(
        RankFailure,
        match=r"reshard_after_forward=2 \(a number of ranks\) cannot be combined with "
        r"tensor_parallel_size > 1",
    ):
        run_ranks(2, _rows_held_after_forward, {"dp_shard_size": 1, "tp_size": 2}, 2)
