"""Per-layer torch.compile with activation checkpointing makes a graph, and computes what eager does.

transformers 5.25 installs the ``kernels`` package, whose hub-kernel routing sets and resets a Python global
in every attention forward. Inside a checkpoint that Dynamo traces as one higher-order op that was a graph
break, and the whole checkpointed layer then ran eagerly with no message: `torch_compile: true` with full or
selective checkpointing trained uncompiled. In a forked process of its own (Dynamo's caches are
process-wide); fp32 on CPU."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import ndparallel as ndp
from ndparallel.testing.ranks import run_ranks


def _compiled_step(mode: str, compile_: bool, offload_layers: int = 0):
    from torch._dynamo.utils import counters  # a test's view of Dynamo's work (not library code)

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg)
    topo = ndp.Topology.build(ndp.ParallelismConfig(dp_shard_size=1))
    options = ndp.ParallelOptions(
        param_dtype=None, activation_checkpointing=mode, compile=compile_, activation_offload_layers=offload_layers
    )
    ndp.parallelize(model, topo, options=options)
    ids = torch.randint(0, 128, (1, 64), generator=torch.Generator().manual_seed(1))
    batch = ndp.prepare_batch(topology=topo, input_ids=ids)
    n = ndp.count_tokens(batch.num_tokens, topo)
    loss, _ = ndp.model_loss(model, batch.model_inputs(), batch.labels, num_tokens=n, topology=topo)
    if offload_layers:  # between forward and backward the offloaded input holds no device storage
        stashed = model.model.layers[0].activation_offload._stashed.values()
        assert [local.untyped_storage().nbytes() for local, _ in stashed] == [0] * offload_layers
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    breaks = {reason.splitlines()[0]: count for reason, count in counters["graph_break"].items()}
    return float(loss), grads, counters["stats"]["unique_graphs"], breaks


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_checkpointed_layers_compile_and_match_eager(mode):
    loss, grads, graphs, breaks = run_ranks(1, _compiled_step, mode, True)[0]
    assert graphs >= 1 and not breaks, (graphs, breaks)
    want_loss, want_grads, _, _ = run_ranks(1, _compiled_step, mode, False)[0]
    assert abs(loss - want_loss) <= 1e-5 * abs(want_loss)
    assert grads.keys() == want_grads.keys()
    for name, grad in grads.items():
        assert torch.allclose(grad, want_grads[name], rtol=1e-4, atol=1e-6), name


def test_offloaded_layers_compile_whole_and_match_plain_checkpointing():
    """With activation offloading the checkpoint wrapper's forward is compiled, checkpoint included, and the
    offload's hooks run eagerly around it: no graph break, and the same numbers as compiled full
    checkpointing without offload, bit for bit (offload moves storage, not values)."""
    loss, grads, graphs, breaks = run_ranks(1, _compiled_step, "full", True, 1)[0]
    assert graphs >= 1 and not breaks, (graphs, breaks)
    want_loss, want_grads, _, _ = run_ranks(1, _compiled_step, "full", True, 0)[0]
    assert loss == want_loss
    assert grads.keys() == want_grads.keys()
    for name, grad in grads.items():
        assert torch.equal(grad, want_grads[name]), name
