"""Ranking, reasons, output formats and best_layout. No processes."""

import functools
import json

import pytest

from ndparallel import ConfigError
from ndparallel.planner.candidates import layout_problems
from ndparallel.planner.evaluate import PlanRow
from ndparallel.planner.hardware import Cluster, groups_cross_nodes
from ndparallel.planner.plan import best_layout, plan
from ndparallel.planner.report import format_table, to_json
from ndparallel.planner.shapes import PRESETS
from ndparallel.planner.workload import Workload


@functools.lru_cache(maxsize=None)
def llama8b(nodes: int, seq: int, features: bool = False):
    """The 8B on H100 nodes; ``features``: the tiled MLP and activation offload where nothing fits (the planner's
    default) instead of off (the trainer's), which the CP and TP trade-offs below are about."""
    switch = "auto" if features else False
    return plan(
        "llama-8b",
        Cluster(nodes=nodes, gpus_per_node=8, device_memory_gib=80),
        Workload(seq_len=seq, global_batch_tokens=1 << 20, tiled_mlp=switch, activation_offload=switch),
    )


CASES = [(1, 8192), (2, 8192), (1, 131072), (2, 131072)]


@pytest.mark.parametrize("nodes, seq", CASES)
def test_rows_are_ranked_fitting_first_and_all_have_reasons(nodes, seq):
    rows = llama8b(nodes, seq)
    fits = [r.fits for r in rows]
    assert fits[0] and fits == sorted(fits, reverse=True)  # every fitting row before the others
    for row in rows:
        assert row.reasons and all(isinstance(x, str) and x and "\n" not in x for x in row.reasons)
        assert row.reasons[0].startswith(("fits:", "does not fit:", "infeasible:"))
        assert row.fits == (row.feasible and row.memory.total <= 0.9 * 80 * 2**30)
        assert row.layout.world_size == 8 * nodes
    assert any(r.reasons[0].startswith("does not fit: needs") for r in rows)
    best = rows[0]
    assert best.tokens_per_s_per_gpu > 0 and best.step_s > best.time.compute_s > 0


def test_sequences_too_long_for_tensor_parallelism_pick_cp_and_say_why():
    # 524,288 tokens fit with tp 8 since the fused loss holds no logits; twice that does not
    best = llama8b(2, 1048576)[0]
    assert best.layout.cp > 1
    cp_reason = next(r for r in best.reasons if "cp needed" in r)
    assert "1048576 tokens" in cp_reason and "GiB" in cp_reason
    assert best.layout.tp <= 8 and not groups_cross_nodes(best.layout, 8)["tp"]


@pytest.mark.parametrize("nodes", [1, 2])
def test_long_rows_that_tensor_parallelism_holds_stay_whole(nodes):
    # 131072 tokens fit with tp inside a node, and whole rows run SDPA (cuDNN's kernel, measured on the H200
    # at about twice the rate of the variable-length kernel every CP method calls): tp beats cp here.
    rows = llama8b(nodes, 131072)
    best = rows[0]
    assert best.layout.cp == 1 and 1 < best.layout.tp <= 8 and not groups_cross_nodes(best.layout, 8)["tp"]
    with_cp = next(r for r in rows if r.layout.cp > 1 and r.fits)
    assert with_cp.time.compute_s > best.time.compute_s


def test_short_sequences_need_no_cp():
    for nodes in (1, 2):
        best = llama8b(nodes, 8192)[0]
        assert best.layout.cp == 1 and best.layout.tp <= 2


def test_two_nodes_explain_tp_and_replicas():
    rows = llama8b(2, 131072)
    best = rows[0]
    if best.layout.tp > 1:
        assert any(
            "kept inside a node (8 GPUs/node)" in r
            and "split over two nodes they would take" in r
            and "the network (" in r
            for r in best.reasons
        )
    # tp never spans nodes among the fitting rows that rank above a layout without tp
    spanning = [r for r in rows if r.layout.tp > 1 and groups_cross_nodes(r.layout, 8)["tp"]]
    assert all(any("spans nodes" in x for x in r.reasons) for r in spanning if r.feasible)
    hsdp = next(r for r in llama8b(2, 8192) if r.layout.shape == (2, 8, 1, 1))
    assert any(
        r.startswith("dp_replicate 2 across nodes: one gradient all-reduce per step")
        and "the network (50 GB/s per GPU)" in r
        for r in hsdp.reasons
    )  # one member per node: one NIC
    fsdp = next(r for r in llama8b(2, 8192) if r.layout.shape == (1, 16, 1, 1))
    assert any("spans nodes" in r and "the network (400 GB/s per GPU on 8 NICs per node)" in r for r in fsdp.reasons)


def test_json_round_trips():
    rows = llama8b(2, 131072)[:12]
    data = json.loads(json.dumps(to_json(rows)))
    assert data == to_json(rows)
    assert [PlanRow.from_dict(d) for d in data] == rows
    assert set(data[0]) >= {
        "layout",
        "micro_batch",
        "activation_checkpointing",
        "memory_bytes",
        "comm",
        "step_s",
        "tokens_per_s_per_gpu",
        "reasons",
        "fits",
    }


def test_table_is_aligned_and_shows_reasons():
    text = format_table(llama8b(1, 131072), top=5, reasons_for=2)
    lines = text.splitlines()
    header, rule, body = lines[0], lines[1], lines[2:7]
    assert len({len(header), len(rule), *map(len, body)}) == 1
    assert "more layouts" in lines[7]
    assert "#1:" in text and "#2:" in text and "#3:" not in text


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_best_layout_is_valid_for_the_world_size(world):
    layout, reason = best_layout(PRESETS["tiny"], world, 64)
    assert layout.world_size == world
    assert not layout_problems(layout, PRESETS["tiny"], 64)
    assert reason and "\n" not in reason


def test_best_layout_when_nothing_fits_returns_the_leanest():
    layout, reason = best_layout("llama-70b", 1, 4096)
    assert layout.world_size == 1 and "nothing fits" in reason


def test_best_layout_honours_constraints_and_long_sequences():
    layout, _ = best_layout("llama-8b", 16, 1048576, gpus_per_node=8)
    assert layout.cp > 1 and layout.tp <= 8
    fixed, _ = best_layout("llama-8b", 8, 8192, constraints={"tp": 2})
    assert fixed.tp == 2 and fixed.world_size == 8


def test_impossible_requests_are_config_errors_or_marked_infeasible():
    with pytest.raises(ConfigError, match="no layout of 8 GPUs splits llama-8b"):
        plan("llama-8b", Cluster(), Workload(seq_len=8192, global_batch_rows=8), constraints={"tp": 3})
    rows = plan("llama-8b", Cluster(), Workload(seq_len=8192, global_batch_rows=12, micro_batch_sizes=(4,)))
    reasons = {r.layout.shape: r.reasons[0] for r in rows}
    assert reasons[(1, 8, 1, 1)].startswith("infeasible: the global batch of 12 rows does not split over 8")
    assert reasons[(1, 2, 1, 4)].startswith("infeasible: no micro-batch size of (4) divides the 6 rows")
    assert reasons[(1, 1, 1, 8)].startswith(("fits", "does not fit"))


@pytest.mark.parametrize("nodes, seq", [(2, 131072), (2, 8192)])
def test_reasons_name_the_link_their_numbers_were_computed_on(nodes, seq):
    cluster = Cluster(nodes=nodes, gpus_per_node=8, device_memory_gib=80)
    checked = 0
    for row in llama8b(nodes, seq)[:25]:
        for line in row.reasons:
            for c in row.comm.values():
                if c.bytes >= 1e8 and f"{c.bytes / 1e9:.1f} GB/step" in line:  # the line quotes this axis
                    link = cluster.link_name(c.crosses_nodes, c.per_node, c.pattern, c.size)
                    assert link in line, (line, link)
                    assert ("network" in link) == c.crosses_nodes
                    checked += 1
    assert checked >= 10


def test_best_layout_for_a_quantized_base():
    """dp_shard_size: auto with load_in_4bit: the planner keeps tp at 1 (NF4 weights cannot be split by columns),
    where a bf16 base would use it; load_in_8bit may use tp."""
    bf16, _ = best_layout("llama-70b", 8, 8192, gpu="h100-sxm", lora_rank=16)
    nf4, reason = best_layout("llama-70b", 8, 8192, gpu="h100-sxm", lora_rank=16, quantized_base="nf4")
    assert bf16.tp > 1 and nf4.tp == 1, (bf16, nf4)
    assert "GiB of" in reason
    int8, _ = best_layout("llama-70b", 8, 8192, gpu="h100-sxm", lora_rank=16, quantized_base="int8")
    assert int8.world_size == 8
