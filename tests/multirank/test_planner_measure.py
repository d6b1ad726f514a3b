"""The planner's activation model against a fresh measurement of this implementation (multi-rank, CPU).

``benchmarks/results/planner_memory_measurements.json`` was produced by ``benchmarks/planner/planner_measure.py``;
here a few of its cases are measured again so a change to what the implementation saves for backward, or to
the loss's peak, shows up as a failure (then rerun the benchmark and update the activation or loss formulas).
"""

from __future__ import annotations

import pytest
from support.paths import PLANNER_MEASUREMENTS

from ndparallel.planner.shapes import ModelShape
from ndparallel.testing.memory_probe import measure_activations, measure_loss_peak
from ndparallel.testing.planner_calibration import TOLERANCE, compare_to_measurements, load_measurements
from ndparallel.testing.ranks import run_ranks

STORED = {row["case"]: row for row in load_measurements(PLANNER_MEASUREMENTS)}


@pytest.mark.parametrize(
    "case",
    [
        "tiny-single-none-bf16",
        "tiny-gqa4-t2-selective-bf16",
        "tiny-gqa4-c2-ring-none-bf16",
        "tiny-gqa4-t2-none-bf16-lora8",
    ],
)
def test_fresh_measurement_matches_the_stored_one_and_the_model(case):
    row = STORED[case]
    lay = row["layout"]
    config = {
        "dp_replicate_size": lay["dp_replicate"],
        "dp_shard_size": lay["dp_shard"],
        "cp_size": lay["cp"],
        "tp_size": lay["tp"],
        "cp_comm_strategy": lay["cp_comm_strategy"],
    }
    world = lay["dp_replicate"] * lay["dp_shard"] * lay["cp"] * lay["tp"]
    got = run_ranks(
        world,
        measure_activations,
        ModelShape.from_dict(row["model"]),
        config,
        seq_len=row["seq_len"],
        micro_batch=row["micro_batch"],
        activation_checkpointing=row["activation_checkpointing"],
        precision=row["precision"],
        lora_rank=row.get("lora_rank"),
    )
    assert got[0]["retained"] == row["measured_bytes"]
    ((_, predicted, measured, err),) = compare_to_measurements([{**row, "measured_bytes": got[0]["retained"]}])
    assert abs(err) <= TOLERANCE, f"predicted {predicted:,.0f} B, measured {measured:,.0f} B"
    if row["layout"]["cp"] == 1:  # every rank of a tp group keeps the same amount
        assert len({r["retained"] for r in got}) == 1


@pytest.mark.parametrize("case", ["loss-v4096-n256-tp2-bf16", "loss-v1024-n6144-tp2-bf16"])
def test_fresh_loss_peak_matches_the_stored_one_and_the_model(case):
    row = STORED[case]
    got = run_ranks(
        row["layout"]["tp"],
        measure_loss_peak,
        vocab=row["model"]["vocab"],
        tokens=row["seq_len"],
        precision=row["precision"],
    )
    assert got[0]["peak"] == row["measured_bytes"]
    ((_, predicted, measured, err),) = compare_to_measurements([{**row, "measured_bytes": got[0]["peak"]}])
    assert abs(err) <= TOLERANCE, f"predicted {predicted:,.0f} B, measured {measured:,.0f} B"
