"""Communication bytes per axis on a small model worked out by hand, links, and FLOP counts. No processes."""

import pytest

from ndparallel.layout import Layout
from ndparallel.planner.comm import comm_per_step
from ndparallel.planner.hardware import Cluster, groups_cross_nodes
from ndparallel.planner.perf import step_flops
from ndparallel.planner.shapes import PRESETS, ModelShape
from ndparallel.planner.workload import Workload

# One layer: q_proj 100x100, k/v 100x50 each, o_proj 100x100, MLP 3 x 100x400 = 150,000; norms 200.
# All: 2 layers (300,400) + embedding and lm_head 100,000 each + final norm 100 = 500,500.
M = ModelShape(vocab=1000, hidden=100, intermediate=400, layers=2, heads=4, kv_heads=2, head_dim=25)
WORK = Workload(seq_len=1000, global_batch_rows=8)
CLUSTER = Cluster(nodes=1, gpus_per_node=8)


def comm(layout, mode="none", m=1, sync="last", b=1):
    return comm_per_step(M, layout, WORK, CLUSTER, micro_batch=b, accumulation=m, activation_checkpointing=mode,
                         grad_sync=sync)


def test_model_counts():
    assert M.layer_split_params() == 150_000 and M.params == 500_500


def test_fsdp_and_hsdp_by_hand():
    c = comm(Layout(dp_shard=4))["fsdp"]
    # all-gather bf16 of everything in forward + the resharded units again in backward (layer 0 and the
    # untied embedding: 150,200 + 100,000), 3/4 sent; fp32 gradient reduce-scatter 4 x 500,500 x 3/4.
    assert c.bytes == pytest.approx(2 * (500_500 + 250_200) * 0.75 + 4 * 500_500 * 0.75)
    assert not c.crosses_nodes
    assert c.seconds == pytest.approx(c.bytes / 450e9 + c.collectives * 15e-6)
    # two micro-batches reduced every time: both terms double; reduced once: only the gathers do
    assert comm(Layout(dp_shard=4), m=2, sync="every")["fsdp"].bytes == pytest.approx(2 * c.bytes)
    assert comm(Layout(dp_shard=4), m=2)["fsdp"].bytes == pytest.approx(2 * c.bytes - 4 * 500_500 * 0.75)
    hsdp = comm(Layout(dp_replicate=2, dp_shard=4))["dp_replicate"]
    assert hsdp.bytes == pytest.approx(4 * 500_500 / 4 * 2 * 0.5)   # all-reduce of the fp32 shard


def test_tp_by_hand():
    c = comm(Layout(tp=2))["tp"]
    # (8 per layer x 2 layers + 4) collectives of bf16 1000 x 100, half sent; 3 fp32 all-reduces of 1000 floats
    assert c.bytes == pytest.approx(20 * 2 * 1000 * 100 * 0.5 + 3 * 4 * 1000 * 2 * 0.5)
    assert c.collectives == 23
    recomputed = comm(Layout(tp=2), mode="selective")["tp"]
    assert recomputed.bytes - c.bytes == pytest.approx(4 * 2 * 2 * 1000 * 100 * 0.5)


@pytest.mark.parametrize("method, per_layer", [
    # local K+V: 2 bytes x 2 x 50 wide x 500 tokens = 100,000 (kvb)
    ("allgather", 2 * 100_000),                      # all-gather forward, reduce-scatter backward
    ("ring", 2 * 100_000 + 2 * 100_000 * 2),         # K/V each way + two fp32 dK/dV hops
    ("alltoall", 2 * 500 * (200 + 100) * 0.5 * 2),   # q, k, v, out each way; 2 kv heads split over cp 2
])
def test_cp_by_hand(method, per_layer):
    c = comm(Layout(cp=2, cp_comm_strategy=method))["cp"]
    assert c.bytes == pytest.approx(2 * per_layer)


def test_axes_of_size_one_send_nothing():
    assert comm(Layout()) == {}


@pytest.mark.parametrize("layout, crossing", [
    (Layout(dp_replicate=2, dp_shard=8), {"dp_replicate"}),       # HSDP: replicas on different nodes
    (Layout(dp_shard=16), {"fsdp"}),
    (Layout(dp_shard=8, tp=2), {"fsdp"}),                         # tp innermost: pairs inside a node
    (Layout(cp=8, tp=2), {"cp", "fsdp"}),                         # cp strides over 2, spans 16 ranks
    (Layout(dp_replicate=2, cp=4, tp=2), {"dp_replicate"}),
])
def test_which_axes_cross_nodes_on_two_nodes_of_eight(layout, crossing):
    got = groups_cross_nodes(layout, 8)
    assert {axis for axis, crosses in got.items() if crosses} == crossing


def test_flops_six_n_plus_attention():
    model = PRESETS["llama-8b"]
    work = Workload(seq_len=8192, global_batch_rows=1)
    total, attn = step_flops(model, Layout(), work, "none")
    n = model.matmul_params()
    assert attn == 8192 * 12 * 8192 * 4096 * 32 * 0.5                  # causal kernel skips half
    assert total == pytest.approx(8192 * 6 * n + attn)
    gathered, attn_ag = step_flops(model, Layout(cp=2, cp_comm_strategy="allgather"), work, "none")
    assert attn_ag == 2 * attn                                          # explicit mask: every score
    full, _ = step_flops(model, Layout(), work, "full")
    assert full - total == pytest.approx(8192 * (2 * n + attn / 8192 / 3))  # one more forward
