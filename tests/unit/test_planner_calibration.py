"""The memory model against measurements of this implementation (measurements.json). No processes."""

import copy

import pytest

from ndparallel import ConfigError
from ndparallel.planner import compare_to_measurements, load_measurements
from ndparallel.planner.calibration import QUANTITIES, TOLERANCE

ROWS = load_measurements()


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


def test_a_wrong_measurement_is_caught():
    row = copy.deepcopy(ROWS[0])
    row["measured_bytes"] *= 1.5
    (_, predicted, measured, err), = compare_to_measurements([row])
    assert abs(err) > TOLERANCE and measured == ROWS[0]["measured_bytes"] * 1.5


def test_gpu_rows_are_understood():
    # The shape an H200 calibration row takes: a peak of torch.cuda.max_memory_allocated for a training step.
    row = {"case": "h200-llama-1b-fsdp8", "model": "llama-1b",
           "layout": {"dp_replicate": 1, "dp_shard": 8, "cp": 1, "tp": 1, "cp_comm_strategy": "allgather"},
           "seq_len": 8192, "micro_batch": 1, "activation_checkpointing": "selective", "precision": "bf16",
           "quantity": "peak_allocated", "measured_bytes": 30e9}
    (_, predicted, _, _), = compare_to_measurements([row])
    assert 5e9 < predicted < 60e9
    total = compare_to_measurements([{**row, "quantity": "peak_total", "overhead_gib": 3.0}])[0][1]
    assert total == pytest.approx(predicted + 3 * 2**30)
    assert "peak_allocated" in QUANTITIES


def test_unknown_quantity_is_a_config_error():
    with pytest.raises(ConfigError, match="quantity='peak' must be one of"):
        compare_to_measurements([{**ROWS[0], "quantity": "peak"}])
