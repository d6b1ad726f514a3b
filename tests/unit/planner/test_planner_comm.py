"""Communication bytes per axis on a small model worked out by hand, links, and FLOP counts. No processes."""

import pytest

from ndparallel.mesh.layout import Layout
from ndparallel.planner.comm import comm_per_step
from ndparallel.planner.hardware import Cluster, group_placement, groups_cross_nodes
from ndparallel.planner.perf import step_flops
from ndparallel.planner.shapes import PRESETS, ModelShape
from ndparallel.planner.workload import Workload

# One layer: q_proj 100x100, k/v 100x50 each, o_proj 100x100, MLP 3 x 100x400 = 150,000; norms 200.
# All: 2 layers (300,400) + embedding and lm_head 100,000 each + final norm 100 = 500,500.
M = ModelShape(vocab=1000, hidden=100, intermediate=400, layers=2, heads=4, kv_heads=2, head_dim=25)
WORK = Workload(seq_len=1000, global_batch_rows=8)
CLUSTER = Cluster(nodes=1, gpus_per_node=8)


def comm(layout, mode="none", m=1, sync="every_micro_batch", b=1):
    return comm_per_step(
        M, layout, WORK, CLUSTER, micro_batch=b, accumulation=m, activation_checkpointing=mode, gradient_sync=sync
    )


def test_model_counts():
    assert M.layer_split_params() == 150_000 and M.params == 500_500


def test_fsdp_and_hsdp_by_hand():
    c = comm(Layout(dp_shard=4))["fsdp"]
    # all-gather bf16 of everything in forward + the resharded units again in backward (layer 0 and the
    # untied embedding: 150,200 + 100,000), 3/4 sent; fp32 gradient reduce-scatter 4 x 500,500 x 3/4.
    assert c.bytes == pytest.approx(2 * (500_500 + 250_200) * 0.75 + 4 * 500_500 * 0.75)
    assert not c.crosses_nodes
    # NVLink 450 GB/s at the collective efficiency (0.8), 15 us per collective
    assert c.seconds == pytest.approx(c.bytes / (0.8 * 450e9) + c.collectives * 15e-6)
    # two micro-batches reduce-scattered each ('every_micro_batch'): both terms double; 'last_micro_batch': only
    # the gathers, and the one reduction is sent in the last micro-batch
    sharded = comm(Layout(dp_shard=4), m=2)["fsdp"]
    unsharded = comm(Layout(dp_shard=4), m=2, sync="last_micro_batch")["fsdp"]
    assert sharded.bytes == pytest.approx(2 * c.bytes) and sharded.last_only_s == 0
    assert unsharded.bytes == pytest.approx(2 * c.bytes - 4 * 500_500 * 0.75)
    assert unsharded.last_only_s == pytest.approx(4 * 500_500 * 0.75 / (0.8 * 450e9) + 5 * 15e-6)
    hsdp = comm(Layout(dp_replicate=2, dp_shard=4))["dp_replicate"]
    assert hsdp.bytes == pytest.approx(4 * 500_500 / 4 * 2 * 0.5)  # all-reduce of the fp32 shard
    for sync in ("every_micro_batch", "last_micro_batch"):  # replicas all-reduce once per step, on the last one
        rep = comm(Layout(dp_replicate=2, dp_shard=4), m=4, sync=sync)["dp_replicate"]
        assert rep.bytes == pytest.approx(hsdp.bytes) and rep.last_only_s == pytest.approx(rep.seconds)


def test_tp_by_hand():
    c = comm(Layout(tp=2))["tp"]
    # (8 per layer x 2 layers + 4) collectives of bf16 1000 x 100, half sent; 3 fp32 all-reduces of 1000 floats
    assert c.bytes == pytest.approx(20 * 2 * 1000 * 100 * 0.5 + 3 * 4 * 1000 * 2 * 0.5)
    assert c.collectives == 23
    recomputed = comm(Layout(tp=2), mode="selective")["tp"]
    assert recomputed.bytes - c.bytes == pytest.approx(4 * 2 * 2 * 1000 * 100 * 0.5)


@pytest.mark.parametrize(
    "method, per_layer",
    [
        # local K+V: 2 bytes x 2 x 50 wide x 500 tokens = 100,000 (kvb)
        ("allgather", 2 * 100_000),  # all-gather forward, reduce-scatter backward
        ("ring", 2 * 100_000 + 2 * 100_000 * 2),  # K/V each way + two fp32 dK/dV hops
        ("alltoall", 2 * 500 * (200 + 100) * 0.5 * 2),  # q, k, v, out each way; 2 kv heads split over cp 2
    ],
)
def test_cp_by_hand(method, per_layer):
    c = comm(Layout(cp=2, cp_comm_strategy=method))["cp"]
    assert c.bytes == pytest.approx(2 * per_layer)


def test_axes_of_size_one_send_nothing():
    assert comm(Layout()) == {}


@pytest.mark.parametrize(
    "layout, crossing",
    [
        (Layout(dp_replicate=2, dp_shard=8), {"dp_replicate"}),  # HSDP: replicas on different nodes
        (Layout(dp_shard=16), {"fsdp"}),
        (Layout(dp_shard=8, tp=2), {"fsdp"}),  # tp innermost: pairs inside a node
        (Layout(cp=8, tp=2), {"cp", "fsdp"}),  # cp strides over 2, spans 16 ranks
        (Layout(dp_replicate=2, cp=4, tp=2), {"dp_replicate"}),
    ],
)
def test_which_axes_cross_nodes_on_two_nodes_of_eight(layout, crossing):
    got = groups_cross_nodes(layout, 8)
    assert {axis for axis, crosses in got.items() if crosses} == crossing


def test_network_bandwidth_by_how_an_axis_talks():
    two = Cluster(nodes=2, gpus_per_node=8)
    assert group_placement(Layout(dp_shard=16), 8)["fsdp"] == (True, 8)
    assert group_placement(Layout(dp_replicate=2, dp_shard=8), 8)["dp_replicate"] == (True, 1)
    assert two.link_gbps(True, 8) == 400 and two.link_gbps(True, 1) == 50  # one ring per NIC
    assert two.link_gbps(True, 8, "p2p", 16) == 50  # a ring waits on one NIC
    assert two.link_gbps(True, 8, "alltoall", 16) == pytest.approx(50 * 15 / 8)  # 8 of 15 peers elsewhere
    assert two.link_gbps(False, 8) == 450
    fsdp = comm_per_step(
        M, Layout(dp_shard=16), WORK, two, micro_batch=1, accumulation=1, activation_checkpointing="none"
    )["fsdp"]
    assert fsdp.crosses_nodes and fsdp.per_node == 8
    assert fsdp.seconds == pytest.approx(fsdp.bytes / (0.8 * 400e9) + fsdp.collectives * 40e-6)


def test_flops_six_n_plus_causal_attention_and_packed_documents():
    model = PRESETS["llama-8b"]
    work = Workload(seq_len=8192, global_batch_rows=1)
    total, attn = step_flops(model, Layout(), work, "none")
    n = model.matmul_params()
    assert attn == 3 * 4 * 4096 * 32 * 8192 * 8193 / 2  # causal: S(S+1)/2 pairs per row
    assert total == pytest.approx(8192 * 6 * n + attn)
    for method in ("allgather", "ring", "alltoall"):  # every CP method skips the hidden half
        assert step_flops(model, Layout(cp=2, cp_comm_strategy=method), work, "none")[1] == attn
    full, _ = step_flops(model, Layout(), work, "full")
    assert full - total == pytest.approx(8192 * 2 * n + attn / 3)  # one more forward
    packed = Workload(seq_len=8192, global_batch_rows=1, doc_len=1024)
    assert step_flops(model, Layout(), packed, "none")[1] == pytest.approx(attn * 1025 / 8193)
