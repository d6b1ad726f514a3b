"""The planner's step-time model part by part, and against our own H200 measurements. No processes."""

import dataclasses
import json
import math
import os

import pytest
from support.paths import RESULTS as RESULTS_DIR

from ndparallel import ConfigError
from ndparallel.mesh.layout import Layout
from ndparallel.planner.comm import AxisComm
from ndparallel.planner.gpus import GPUS
from ndparallel.planner.hardware import Cluster
from ndparallel.planner.parts import MicroBatch, attention_s, layer_pointwise_bytes, linear_s, loss_s, pointwise_s
from ndparallel.planner.perf import _background
from ndparallel.planner.plan import best_layout, plan
from ndparallel.planner.rates import H200_EFFICIENCY, Efficiency, Rates
from ndparallel.planner.shapes import PRESETS, ModelShape
from ndparallel.planner.workload import Workload

H100 = Rates(GPUS["h100-sxm"])
M = ModelShape(vocab=1000, hidden=256, intermediate=1024, layers=2, heads=4, kv_heads=2, head_dim=64)
RESULTS = str(RESULTS_DIR)


def mb(work=None, layout=Layout(), rows=1, ac="none", model=M):
    return MicroBatch(model, layout, work or Workload(seq_len=4096, global_batch_rows=1), rows, ac)


def test_matmuls_are_compute_or_memory_bound():
    rate = 989e12 * H200_EFFICIENCY.matmul
    assert H100.gemm_s(8192, 8192, 8192) == pytest.approx(2 * 8192**3 / rate)
    thin = H100.gemm_s(8192, 64, 8192)  # a tp slice of a key projection: reading x dominates
    assert thin > 2 * 8192 * 64 * 8192 / rate
    assert thin == pytest.approx((2 * (8192 * 8192 + 8192 * 64) + 2 * 8192 * 64) / (3350e9 * H200_EFFICIENCY.stream))
    assert H100.gemm_s(8192, 8192, 8192, "fp8") < H100.gemm_s(8192, 8192, 8192)
    with pytest.raises(ConfigError, match="no fp8 tensor cores"):
        Rates(GPUS["a100-80gb"]).gemm_s(64, 64, 64, "fp8")


def test_attention_runs_at_half_rate_at_half_rows_and_blocks_use_their_own_kernel():
    long = H100.attention_s(1e12, 128, 1e9, backward=False)
    assert H100.attention_s(1e12, 128, H200_EFFICIENCY.attention_half_rows, backward=False) == pytest.approx(2 * long)
    slow = dataclasses.replace(H200_EFFICIENCY, block_attention={128: (0.2, 0.1)})
    rates = Rates(GPUS["h100-sxm"], slow)
    assert rates.attention_s(1e12, 128, 4096, backward=True, blocks=True) > rates.attention_s(
        1e12, 128, 4096, backward=True
    )
    assert Efficiency.from_dict(json.loads(json.dumps(slow.to_dict()))) == slow


def test_linear_time_is_the_sum_of_its_products():
    n = 4096
    shapes = [(256, 256), (256, 128), (256, 128), (256, 256), (256, 1024), (256, 1024), (1024, 256)]
    per_layer = sum(H100.gemm_s(n, o, k) + H100.gemm_s(n, k, o) + H100.gemm_s(k, o, n) for k, o in shapes)
    head = 3 * H100.gemm_s(n, 1000, 256)
    assert linear_s(mb(), H100) == pytest.approx(2 * per_layer + head)
    full = linear_s(mb(ac="full"), H100) - linear_s(mb(), H100)  # one more forward per layer
    assert full == pytest.approx(2 * sum(H100.gemm_s(n, o, k) for k, o in shapes))
    lora = Workload(seq_len=4096, global_batch_rows=1, lora_rank=8)
    big = PRESETS["llama-8b"]
    assert linear_s(mb(lora, model=big), H100) < linear_s(mb(model=big), H100)  # no weight gradient for the base


def test_packed_documents_cp_and_compile():
    one_kernel = Rates(GPUS["h100-sxm"], dataclasses.replace(H200_EFFICIENCY, block_attention=None))
    packed_work = Workload(seq_len=4096, global_batch_rows=1, doc_len=512)
    ring_layout = Layout(cp=2, cp_comm_strategy="ring")
    whole = attention_s(mb(), one_kernel)
    packed = attention_s(mb(packed_work), one_kernel)
    assert whole * 513 / 4097 < packed < whole / 2  # 1/8 of the pairs, slower short rows
    assert attention_s(mb(layout=ring_layout), one_kernel) < whole  # each rank: half the pairs
    # Whole rows at cp 1 run SDPA; packed rows and every CP method the variable-length kernel (its own rates).
    assert attention_s(mb(), H100) == whole
    for work, layout in ((packed_work, Layout()), (None, ring_layout), (None, Layout(cp=2))):
        ratio = attention_s(mb(work, layout=layout), H100) / attention_s(mb(work, layout=layout), one_kernel)
        assert ratio > 1.2, (work, layout)  # H200: FlashAttention 2's varlen kernel is slower than cuDNN's
    eager, compiled = (Workload(seq_len=4096, global_batch_rows=1, compile=c) for c in (False, True))
    assert pointwise_s(mb(compiled), H100) == pytest.approx(pointwise_s(mb(eager), H100) * 0.5, rel=0.05)
    assert loss_s(mb(compiled), H100) == pytest.approx(loss_s(mb(eager), H100) * 6 / 78)
    assert layer_pointwise_bytes(M, 1, 2) == (2 * 32 + 12) * 256 + 10 * 2 * 384 + 4 * 256 + 10 * 1024


def test_deferred_reductions_hide_behind_the_last_micro_batch_only():
    every = AxisComm("fsdp", 0, 0, False, seconds=4.0, last_only_s=0.0)
    deferred = AxisComm("fsdp", 0, 0, False, seconds=4.0, last_only_s=2.0)
    # 4 micro-batches of 1 s compute, overlap 0.8: 1 s of traffic each hides; 2 s issued in the last does not
    assert _background({"fsdp": every}, 1.0, 4, 10, 0.8) == pytest.approx(4 * 0.2)
    assert _background({"fsdp": deferred}, 1.0, 4, 10, 0.8) == pytest.approx(3 * 0.1 + (0.5 + 2.0 - 0.8))


def test_fp8_and_compile_speed_up_an_8b_step():
    def tps(**kw):
        work = Workload(
            seq_len=8192, global_batch_rows=16, micro_batch_sizes=(2,), activation_checkpointing="full", **kw
        )
        return plan("llama-8b", Cluster(gpus_per_node=8), work, constraints={"dp_shard": 8})[0].tokens_per_s_per_gpu

    eager, compiled, fp8 = tps(), tps(compile=True), tps(compile=True, fp8=True)
    assert eager < compiled < fp8 < 1.6 * compiled


def _h200_rows():
    """Measured H200 throughputs by configuration; the path is in the key's last field: True for the runs of
    FSDP on a mesh of one (before the flat one-rank path existed), False for the flat path (the long rows)."""
    rows = {}
    for name in ("h200_memory_sweep_final.jsonl", "h200_longseq.jsonl"):
        for line in open(os.path.join(RESULTS, name)):
            r = json.loads(line)
            rows[(r["shape"], r["seq"], r["micro_batch"], r["ac"], False, r["lora"], None, True)] = r["tokens_per_s"]
    for line in open(os.path.join(RESULTS, "h200_bench.jsonl")):
        r = json.loads(line)
        if r["args"]["compile"] and r["args"]["compare"] != "none":  # the runs RESULTS.md reports
            a = r["args"]
            key = (a["shape"], a["seq"], a["micro_batch"], a["ac"], True, False, None, True)
            rows[key] = r["results"][0]["tokens_per_s"]
    for line in open(os.path.join(RESULTS, "h200_long_rows.jsonl")):  # one row of 16k-196k tokens per step
        r = json.loads(line)
        if r["status"] == "ok" and not r["kind"].startswith("rows-"):
            doc = int(r["kind"][7:]) if r["kind"].startswith("packed-") else None
            rows[(r["shape"], r["length"], 1, r["ac"], False, False, doc, False)] = r["tokens_per_s"]
    return rows


# Eager selective checkpointing of 2048-token rows runs PyTorch's checkpoint policy (a Python dispatch mode)
# over many short kernels: host-bound, which the model does not count (benchmarks/results/RESULTS.md). The 1B's
# predictions are 22% (2048-token rows) and 12% (4096) too fast, the excess shrinking as kernels grow; the
# 3B's selective row (longer kernels) is within 1%.
HOST_BOUND = {
    ("1b", 2048, 4, "selective", False, False, None, True),
    ("1b", 4096, 2, "selective", False, False, None, True),
}


def test_our_h200_throughputs_are_reproduced_within_ten_percent():
    rows = _h200_rows()
    assert len(rows) >= 27 and any(key[-2] for key in rows)  # packed documents among them
    worst = 0.0
    for key, measured in sorted(rows.items(), key=lambda item: str(item[0])):
        shape, seq, b, ac, compiled, lora, doc, fsdp = key
        work = Workload(
            seq_len=seq,
            global_batch_rows=b,
            micro_batch_sizes=(b,),
            activation_checkpointing=ac,
            compile=compiled,
            lora_rank=16 if lora else None,
            doc_len=doc,
            single_rank_fsdp=fsdp,
        )
        cluster = Cluster(nodes=1, gpus_per_node=1, gpu=GPUS["h200"])
        predicted = plan(PRESETS[f"llama-{shape}"], cluster, work)[0].tokens_per_s_per_gpu
        error = predicted / measured - 1
        bound = 0.25 if key in HOST_BOUND else 0.1
        assert abs(error) <= bound, f"{key}: {predicted:,.0f} vs {measured:,.0f}"
        worst = max(worst, abs(error))
    print(f"worst H200 throughput error {worst:.1%}")


def test_best_layout_names_the_gpu_it_planned_for():
    layout, reason = best_layout("llama-8b", 8, 8192, gpu="h200", compile=True)
    assert "on NVIDIA H200 SXM 141GB" in reason and layout.world_size == 8
    _, small = best_layout("llama-70b", 8, 8192, gpu="a100-40gb")
    assert "nothing fits in 39.4 GiB" in small
    assert math.isclose(Cluster(device_memory_gib=80).gpu.memory_gib, 80)


def test_one_rank_runs_the_flat_path_without_fsdp_copies():
    """A world of one is modelled as the engine runs it: no FSDP copies (24 bytes per parameter less than FSDP
    on a mesh of one) and FlatAdamW with clipping folded in; the trainer's step (master_grads False) makes no
    fp32 gradient (10 bytes less again). The H200 runs of both flat variants, not fitted on, are reproduced
    within 5%: fp32 .grad on 2026-12-01 (1B 57,200, 3B 21,391 tokens/s), bf16 gradients read in place on
    2026-12-02 (59,802, 21,740; benchmarks/results/h200_bench_session4_final.jsonl, _session5_final.jsonl)."""
    measured = {  # (shape, seq, micro-batch): {master_grads: tokens/s}
        ("1b", 4096, 2): {True: 57_200, False: 59_802},
        ("3b", 8192, 1): {True: 21_391, False: 21_740},
    }
    cluster = Cluster(nodes=1, gpus_per_node=1, gpu=GPUS["h200"])
    for (shape, seq, b), runs in measured.items():
        speeds = {}
        for path in ("fsdp", True, False):
            work = Workload(
                seq_len=seq,
                global_batch_rows=b,
                micro_batch_sizes=(b,),
                activation_checkpointing="none",
                compile=True,
                single_rank_fsdp=path == "fsdp",
                master_grads=path is True,
            )
            speeds[path] = plan(PRESETS[f"llama-{shape}"], cluster, work)[0].tokens_per_s_per_gpu
        assert speeds[False] > speeds[True] > 1.03 * speeds["fsdp"]
        for master_grads, tokens_per_s in runs.items():
            assert abs(speeds[master_grads] / tokens_per_s - 1) <= 0.05, (shape, master_grads, speeds)
    # in fp32 the gradients are the masters' own: no bf16 gradient to read in place, both modes the same
    fp32 = [
        plan(
            PRESETS["llama-1b"],
            cluster,
            Workload(
                seq_len=4096,
                global_batch_rows=2,
                micro_batch_sizes=(2,),
                activation_checkpointing="none",
                precision="fp32",
                master_grads=m,
            ),
        )[0].tokens_per_s_per_gpu
        for m in (True, False)
    ]
    assert fp32[0] == fp32[1]


def test_the_optimizer_phase_of_8bit_adamw_by_where_the_weights_live():
    """torchao's 8-bit AdamW (one kernel a tensor, ``parts.eight_bit_bytes``): bf16 weights read and write 16 bytes
    a parameter (gradient 2, weight 2+2, moments 4, the clipping norm 2 and its scale 2+2); fp32 masters 34 (the
    same at 4 bytes, + the bf16 copy's re-cast, 6); FlatAdamW reading bf16 gradients in place 30."""
    from ndparallel.planner.parts import eight_bit_bytes, optimizer_s
    from ndparallel.planner.shapes import PRESETS

    def work(**kw):
        return Workload(seq_len=4096, global_batch_rows=1, **kw)

    assert eight_bit_bytes(work(eight_bit_optimizer=True, bf16_weights=True)) == 16
    assert eight_bit_bytes(work(eight_bit_optimizer=True)) == 34
    model, one = PRESETS["llama-8b"], Layout()
    times = {
        name: optimizer_s(model, one, work(**kw), H100, micro_batches=1)
        for name, kw in (
            ("bf16 weights", {"eight_bit_optimizer": True, "bf16_weights": True}),
            ("masters", {"eight_bit_optimizer": True}),
            ("flat adamw", {}),
        )
    }
    assert times["bf16 weights"] == pytest.approx(times["flat adamw"] * 16 / 30)
    assert times["masters"] == pytest.approx(times["flat adamw"] * 34 / 30)
