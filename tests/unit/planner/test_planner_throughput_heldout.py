"""The planner's one-GPU throughput on H200 rows its constants were not fitted to.

One H200, 2026-12-02, the one-rank flat path with ``build_optimizer``'s default fp32 gradients:

- ``benchmarks/long_context/bench_long_rows.py`` (``results/h200_long_rows_modes.jsonl``): the 1B shape, one row
per step
  packed with 4,096- or 512-token documents or holding one document, without checkpointing and with selective
  checkpointing, eager. ``benchmarks/planner/planner_fit_h200.py`` fitted its fractions on long rows with full
  checkpointing only. Predicted -6.1% to +2.3% when added.
- ``benchmarks/planner/gpu_memory_sweep.py`` (``results/h200_memory_sweep_lora_8b_long.jsonl``): the 8B shape with
  LoRA r16 on all seven linears at 8k-32k tokens, three checkpointing modes eager and selective compiled; the
  fit has no 8B row. Predicted +1.2% to +2.8% eager, -7.6% compiled.

2026-12-03, the trainer's step (AdamW on the bf16 gradients) with the long-row features, 1B, compiled:
``bench_longest_row.py`` (``results/h200_longest_row.jsonl``: one packed row of 4,096-token documents, full
checkpointing, the fused loss alone or with the tiled MLP and 15 layers offloaded) and ``bench_train.py``
(``results/h200_bench_fused_loss.jsonl``: 4096 x 2, no checkpointing, fused and unfused).
"""

import pytest

from ndparallel.mesh.layout import Layout
from ndparallel.planner.gpus import GPUS
from ndparallel.planner.hardware import Cluster
from ndparallel.planner.plan import plan
from ndparallel.planner.shapes import PRESETS
from ndparallel.planner.workload import Workload

# (checkpointing, document length or None for one document, tokens per row, measured tokens/s): 1B, one row
LONG_ROWS = [
    ("selective", 4096, 16384, 38618),
    ("selective", 512, 16384, 42103),
    ("selective", None, 16384, 32670),
    ("selective", 4096, 32768, 40362),
    ("selective", 512, 32768, 45360),
    ("selective", None, 32768, 25845),
    ("selective", 4096, 65536, 40408),
    ("selective", 512, 65536, 46273),
    ("selective", None, 65536, 17754),
    ("none", 4096, 16384, 42123),
    ("none", 512, 16384, 47813),
    ("none", None, 16384, 34709),
    ("none", 4096, 32768, 43296),
    ("none", 512, 32768, 48780),
    ("none", None, 32768, 27054),
]
# (checkpointing, tokens per row, rows, compiled, measured tokens/s): 8B, LoRA r16
LORA_8B = [
    ("none", 8192, 2, False, 11063),
    ("selective", 16384, 1, False, 8894),
    ("full", 32768, 1, False, 5696),
    ("selective", 16384, 1, True, 11812),
]


def _predicted(shape, **work) -> float:
    cluster = Cluster(nodes=1, gpus_per_node=1, gpu=GPUS["h200"])
    layout = dict(zip(("dp_replicate", "dp_shard", "cp", "tp"), Layout().shape))
    # measured before the fused loss, the tiled MLP and offload (2026-12-03): the step as it ran then
    old = dict(master_grads=True, fused_loss=False, tiled_mlp=False, activation_offload=False)
    return plan(PRESETS[shape], cluster, Workload(**old, **work), constraints=layout)[0].tokens_per_s_per_gpu


@pytest.mark.parametrize("ac, doc, seq, measured", LONG_ROWS)
def test_one_gpu_long_rows_are_predicted_within_ten_percent(ac, doc, seq, measured):
    got = _predicted(
        "llama-1b", seq_len=seq, global_batch_rows=1, micro_batch_sizes=(1,), activation_checkpointing=ac, doc_len=doc
    )
    assert got / measured == pytest.approx(1.0, abs=0.10)


@pytest.mark.parametrize("ac, seq, rows, compiled, measured", LORA_8B)
def test_one_gpu_8b_lora_is_predicted_within_ten_percent(ac, seq, rows, compiled, measured):
    got = _predicted(
        "llama-8b",
        seq_len=seq,
        global_batch_rows=rows,
        micro_batch_sizes=(rows,),
        activation_checkpointing=ac,
        lora_rank=16,
        compile=compiled,
    )
    assert got / measured == pytest.approx(1.0, abs=0.10)


# (tokens per row, rows, checkpointing, documents, tiled MLP, layers offloaded, fused loss, measured tokens/s)
FEATURES = [
    (131072, 1, "full", 4096, False, 0, True, 40480),
    (131072, 1, "full", 4096, True, 15, True, 43965),
    (1048576, 1, "full", 4096, True, 15, True, 44643),
    (4096, 2, "none", None, False, 0, True, 60568),
    (4096, 2, "none", None, False, 0, False, 61018),
]


@pytest.mark.parametrize("seq, rows, ac, doc, tiled, offload, fused, measured", FEATURES)
def test_one_gpu_long_row_features_are_predicted_within_eleven_percent(
    seq, rows, ac, doc, tiled, offload, fused, measured
):
    """Predicted -5.9% / -6.6% (fused / unfused at 4096 x 2: the same GEMMs and loss traffic, as modelled; measured
    0.7% apart), +9.7% (the fused loss alone at 131,072 tokens), -9.1% and -10.2% (tiled and offloaded, 131,072 and
    1,048,576 tokens). The bound is 11%, not the 10% above, because the model charges the tiled MLP its extra
    MLP forward (9% of the step at 1,048,576 tokens) while on the H200 the tiled and offloaded step ran faster than
    the fused-only one (43,965 against 40,480 tokens/s at 131,072): unexplained (planner/parts.py keeps the
    recompute, which the code does run), so the bound says how far off that leaves the prediction."""
    work = dict(
        seq_len=seq,
        global_batch_rows=rows,
        micro_batch_sizes=(rows,),
        activation_checkpointing=ac,
        doc_len=doc,
        compile=True,
        fused_loss=fused,
        tiled_mlp=tiled,
        activation_offload=bool(offload),
        activation_offload_layers=offload or None,
    )
    cluster = Cluster(nodes=1, gpus_per_node=1, gpu=GPUS["h200"], host_memory_gib=128)
    row = plan(PRESETS["llama-1b"], cluster, Workload(**work), constraints={"dp_shard": 1})[0]
    assert (row.tiled_mlp, row.offload_layers) == (tiled, offload)
    assert row.tokens_per_s_per_gpu / measured == pytest.approx(1.0, abs=0.11)


# 2026-12-03 (session 9), ``bench_finetune.py`` through the trainer (``results/h200_finetune_8b_4096.jsonl``): the 8B
# preset, LoRA r16 on every linear, one row of 4,096 tokens (one document), compiled, 50 steps; bf16 or NF4 base;
# (checkpointing, layer inputs offloaded, base, measured tokens/s, measured peak allocated GiB). Not fitted.
# The bf16 offload row is session 11's (``h200_finetune_8b_session11_call3.jsonl``): offload's hooks moved out of
# the compiled checkpoint (session 9 measured 10,031 at 16.78 GiB with the layer compiled inside it). The NF4
# rows ran the dequantization of their day (torch.compile's kernel), which the Triton kernel replaced (2026-12-07);
# their speed is gone with it, their memory is not: ``NF4_MEMORY_8B``. NF4's time is checked on the H100 below.
FINETUNE_8B = [
    ("none", False, None, 14803, 33.69),
    ("full", False, None, 11353, 18.04),
    ("full", True, None, 11388, 17.17),
]
NF4_MEMORY_8B = [("none", False, 24.04), ("full", True, 7.06)]


@pytest.mark.parametrize("ac, offload, base, measured, measured_gib", FINETUNE_8B)
def test_one_gpu_8b_finetune_rows_are_predicted(ac, offload, base, measured, measured_gib):
    """When added: throughput +1.9%, -5.1%, +7.4%; peak memory +4.3%, -2.0%, -0.5%.
    The model charges offload nothing in time; with the layer compiled inside the checkpoint it cost 12%, hence
    the 10% bound and the row at +7.4%. Session 11's offload row (compiled whole): -5.4% and -3.1%."""
    row = _plan_8b_lora(ac, offload, base, "h200")
    assert row.tokens_per_s_per_gpu / measured == pytest.approx(1.0, abs=0.10)
    assert row.memory.allocated / 2**30 / measured_gib == pytest.approx(1.0, abs=0.07)


def _plan_8b_lora(ac: str, offload: bool, base, gpu: str):
    work = Workload(
        seq_len=4096,
        global_batch_rows=1,
        micro_batch_sizes=(1,),
        activation_checkpointing=ac,
        lora_rank=16,
        compile=True,
        quantized_base=base,
        tiled_mlp=False,
        activation_offload=offload,
    )
    cluster = Cluster(nodes=1, gpus_per_node=1, gpu=GPUS[gpu], host_memory_gib=128)
    return plan(PRESETS["llama-8b"], cluster, work, constraints={"dp_shard": 1})[0]


@pytest.mark.parametrize("ac, offload, measured_gib", NF4_MEMORY_8B)
def test_one_gpu_8b_qlora_memory_is_predicted(ac, offload, measured_gib):
    """When added: +6.1% and 0.0% (the NF4 rows of ``FINETUNE_8B`` before the Triton kernel; memory unchanged by it:
    7.53 GiB for the full + offload row on the H100 before and after)."""
    row = _plan_8b_lora(ac, offload, "nf4", "h200")
    assert row.memory.allocated / 2**30 / measured_gib == pytest.approx(1.0, abs=0.07)


def test_one_gpu_8b_qlora_costs_what_the_h100_measured_over_a_bf16_base():
    """2026-12-07 (session 13), one H100 SXM, the same machine in two calls
    (``results/h100_finetune_8b_session13.jsonl``): 8B, LoRA r16 on every linear, 4,096 tokens, full
    checkpointing + offload, compiled: NF4 10,516 tok/s, bf16 10,977, a ratio of 0.958 (the NF4 constant was
    fitted to it: 0.957). The absolute H100 predictions run ~11% low for both bases (the h100-sxm preset's
    rates were never fitted); the ratio is what the dequantization term decides."""
    nf4, bf16 = (_plan_8b_lora("full", True, base, "h100-sxm") for base in ("nf4", None))
    assert nf4.tokens_per_s_per_gpu / bf16.tokens_per_s_per_gpu == pytest.approx(10516 / 10977, abs=0.01)
