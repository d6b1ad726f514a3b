"""The memory model against measurements of this implementation
(benchmarks/results/planner_memory_measurements.json). No processes."""

import copy

import pytest
from support.paths import PLANNER_MEASUREMENTS

from ndparallel import ConfigError
from ndparallel.testing.planner_calibration import QUANTITIES, TOLERANCE, compare_to_measurements, load_measurements

ROWS = load_measurements(PLANNER_MEASUREMENTS)
GPU = [r for r in ROWS if r["quantity"] == "peak_allocated"]


def test_measurements_cover_every_cp_method_tp_and_checkpointing_mode():
    assert len(ROWS) >= 30
    seen = {(r["layout"]["cp"] > 1 and r["layout"]["cp_comm_strategy"]) for r in ROWS}
    assert {"allgather", "ring", "alltoall"} <= seen
    modes = {r["activation_checkpointing"] for r in ROWS if "activation_checkpointing" in r}
    assert modes == {"none", "selective", "full"}
    assert any(r["layout"]["tp"] > 1 for r in ROWS)
    assert {r["quantity"] for r in ROWS} >= {"activations_retained", "layer_saved", "layer_retained", "loss_peak"}


@pytest.mark.parametrize("case, predicted, measured, err", compare_to_measurements(ROWS), ids=[r["case"] for r in ROWS])
def test_prediction_within_tolerance(case, predicted, measured, err):
    assert measured > 0
    assert abs(err) <= TOLERANCE, f"{case}: predicted {predicted:,.0f} B, measured {measured:,.0f} B ({err:+.1%})"


def test_h200_rows_cover_the_issue_requirement():
    # 1B and 3B shapes, several sequence lengths, all three checkpointing modes, LoRA; one GPU, eager.
    assert {r["model"]["name"] for r in GPU} >= {"llama-1b", "llama-3b", "llama-8b"}
    assert all(r["device"] == "NVIDIA H200" and r["torch"] and r["date"] and r["source"] for r in GPU)
    for name in ("llama-1b", "llama-3b"):
        rows = [r for r in GPU if r["model"]["name"] == name]
        assert {r["activation_checkpointing"] for r in rows} == {"none", "selective", "full"}
        assert len({r["seq_len"] for r in rows}) >= 2
    assert len({r["seq_len"] for r in GPU}) >= 5
    assert any(r.get("lora_rank") for r in GPU)
    assert {r.get("quantized_base") for r in GPU} == {None, "nf4", "int8"}
    assert {r.get("compile", False) for r in GPU} == {False, True}


def test_h200_peaks_within_tolerance_and_report_the_worst():
    table = compare_to_measurements(GPU)
    assert len(table) >= 15
    case, predicted, measured, err = max(table, key=lambda t: abs(t[3]))
    print(
        f"worst H200 row: {case}: predicted {predicted / 2**30:.2f} GiB, measured {measured / 2**30:.2f} GiB "
        f"({err:+.2%})"
    )
    assert abs(err) <= TOLERANCE
    # The model reproduces every eager peak, and every compiled full fine-tune's, to 0.5% (compiled LoRA: 4-6%
    # over, planner_validation.md says why; the tiled MLP with offload: the test below); a change that loses
    # this should say why there.
    exact = [
        t
        for t, row in zip(table, GPU)
        if not (row.get("compile") and row.get("lora_rank")) and not row.get("activation_offload_layers")
    ]
    case, _, _, err = max(exact, key=lambda t: abs(t[3]))
    assert abs(err) < 0.005, f"{case}: {err:+.2%}"
    assert all(abs(t[3]) < 0.07 for t in table)


LONG_ROWS = [r for r in GPU if r["date"] >= "2026-12-03"]  # the trainer with the long-row features


def test_rows_measured_before_the_long_row_features_say_so():
    """Every row of the trainer before the fused loss carries fused_loss: false, so the default (true, the
    trainer's now) changes nothing an old row predicts; the CPU rows of the features say what they ran."""
    old = [r for r in ROWS if not ({"tiled_mlp", "chunk_rows", "device"} & set(r))]  # CPU rows before the features
    old += [r for r in GPU if r not in LONG_ROWS]
    assert len(old) >= 100 and all(r["fused_loss"] is False for r in old)
    # the 1B's 4,096 x 2 fused rows of session 10 (none 27.56 GiB, selective 24.56) measured a loss that held two
    # chunks of logits at once; it frees the first now: none re-measured in session 11 (27.07 GiB, the 0.49 GiB
    # predicted), selective still waits for a measurement of the code as it is
    assert {r["case"] for r in LONG_ROWS if r["fused_loss"]} == {
        "h200-1b-s4096-b2-none-compiled-fused",
        "h200-1b-s131072-b1-full-compiled-fused",
        "h200-1b-s131072-b1-full-compiled-fused-tiled-offload15",
        "h200-1b-s1048576-b1-full-compiled-fused-tiled-offload15",
    }
    assert {r["quantity"] for r in ROWS if r.get("tiled_mlp") or r.get("activation_offload_layers")} >= {
        "activations_retained",
        "layer_retained",
        "step_peak",
        "peak_allocated",
    }


def test_h200_long_row_features_within_their_bound():
    """The H200 rows with the long-row features (1B, compiled, one rank; held out). The fused loss alone, and the
    unfused row measured beside it, are predicted to 0.5%, like every row before them. With the tiled MLP and
    offload the bound is -0.5% to +3%: the planner takes the worst layer of the backward, whose attention
    buffers are counted from FlashAttention 2's code and not measured (planner/backward.py), so it may be high
    by those; it must not be low by more than the allocator's rounding, or a plan it calls fitting would run
    out of memory (measured: +1.4% at 131,072 tokens, +2.1% at 1,048,576)."""
    table = {case: err for case, _, _, err in compare_to_measurements(LONG_ROWS)}
    assert len(table) == 5, sorted(table)
    for case, err in table.items():
        if "offload" in case:
            assert -0.005 <= err <= 0.03, f"{case}: {err:+.2%}"
        else:
            assert abs(err) < 0.005, f"{case}: {err:+.2%}"


def test_a_wrong_measurement_is_caught():
    row = copy.deepcopy(ROWS[0])
    row["measured_bytes"] *= 1.5
    ((_, predicted, measured, err),) = compare_to_measurements([row])
    assert abs(err) > TOLERANCE and measured == ROWS[0]["measured_bytes"] * 1.5


def test_gpu_rows_are_understood():
    # The shape an H200 calibration row takes: a peak of torch.cuda.max_memory_allocated for a training step.
    row = {
        "case": "h200-llama-1b-fsdp8",
        "model": "llama-1b",
        "layout": {"dp_replicate": 1, "dp_shard": 8, "cp": 1, "tp": 1, "cp_comm_strategy": "allgather"},
        "seq_len": 8192,
        "micro_batch": 1,
        "activation_checkpointing": "selective",
        "precision": "bf16",
        "quantity": "peak_allocated",
        "measured_bytes": 30e9,
    }
    ((_, predicted, _, _),) = compare_to_measurements([row])
    assert 5e9 < predicted < 60e9
    total = compare_to_measurements([{**row, "quantity": "peak_total", "overhead_gib": 3.0}])[0][1]
    assert total == pytest.approx(predicted + 3 * 2**30)
    assert "peak_allocated" in QUANTITIES


def test_unknown_quantity_is_a_config_error():
    with pytest.raises(ConfigError, match="quantity='peak' must be one of"):
        compare_to_measurements([{**ROWS[0], "quantity": "peak"}])
